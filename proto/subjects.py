"""Every NATS subject Baton uses. Public subjects live under `baton.v1`, internal ones under
`baton.internal.v1`, so server permissions can give clients the first and services both."""
from __future__ import annotations

import re

from .fields import ID_PATTERN

PUBLIC = "baton.v1"
INTERNAL = "baton.internal.v1"

# --- public (request/reply, router queue group) ---
GENERATE = f"{PUBLIC}.generate"
CANCEL = f"{PUBLIC}.cancel"
# Subjects whose servers acknowledge receipt (proto/README.md, "Receipts"): a request with the
# header RECEIPT_HEADER gets an empty message on `<reply subject>.receipt` as soon as a server
# takes it, whose reply subject probes that server; it may be sent again, with the same reply
# subject, until one comes, and a server handles each reply subject once. Every reply the server
# sends names it in SENDER_HEADER (the probe), so a client keeps to one server's replies.
ACKNOWLEDGED = frozenset({GENERATE})
RECEIPT_HEADER = "Baton-Receipt"
SENDER_HEADER = "Baton-Sender"
# who a request to an ACKNOWLEDGED subject is from (a connection, or a frontend's own client), for
# fair shares among clients (shared/bus/senders.py)
CLIENT_HEADER = "Baton-Client"
RECEIPT_SUFFIX = ".receipt"

# --- between routers (every router, no queue group): the owner of a request acts on a cancel ---
ROUTER_CANCEL = f"{INTERNAL}.router.cancel"

# --- kv-registry (request/reply, registry queue group) ---
REGISTER = f"{INTERNAL}.registry.register"
HEARTBEAT = f"{INTERNAL}.registry.heartbeat"
DEREGISTER = f"{INTERNAL}.registry.deregister"
LOOKUP = f"{INTERNAL}.registry.lookup"
PLAN = f"{INTERNAL}.registry.plan"

# --- published by the registry when a worker joins or leaves ---
WORKER_EVENTS = f"{INTERNAL}.workers.events"

# --- published by each prefill worker when its prefix cache changes; every router reads them ---
PREFIX_EVENTS = f"{INTERNAL}.prefixes.events"

# --- queue groups ---
ROUTER_QUEUE = "baton-router"
REGISTRY_QUEUE = "baton-registry"


def decode_reserve(worker_id: str) -> str:
    return f"{INTERNAL}.decode.{_checked(worker_id)}.reserve"


def decode_release(worker_id: str) -> str:
    return f"{INTERNAL}.decode.{_checked(worker_id)}.release"


def decode_prefixes(worker_id: str) -> str:
    """PrefixQuery -> PrefixEvents (snapshot): the prompts the worker's turn cache holds."""
    return f"{INTERNAL}.decode.{_checked(worker_id)}.prefixes"


def prefill_dispatch(worker_id: str) -> str:
    return f"{INTERNAL}.prefill.{_checked(worker_id)}.dispatch"


def prefill_target(worker_id: str) -> str:
    return f"{INTERNAL}.prefill.{_checked(worker_id)}.target"


def prefill_release(worker_id: str) -> str:
    return f"{INTERNAL}.prefill.{_checked(worker_id)}.release"


def prefill_prefixes(worker_id: str) -> str:
    """PrefixQuery -> PrefixEvents (snapshot): everything the worker's prefix cache holds."""
    return f"{INTERNAL}.prefill.{_checked(worker_id)}.prefixes"


def _checked(worker_id: str) -> str:
    if not isinstance(worker_id, str) or not re.fullmatch(ID_PATTERN, worker_id):
        raise ValueError(f"worker id {worker_id!r} must match {ID_PATTERN}")
    return worker_id
