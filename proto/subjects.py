"""Every NATS subject Baton uses. Public subjects live under `baton.v1`, internal ones under
`baton.internal.v1`, so server permissions can give clients the first and services both."""
from __future__ import annotations

import re
from typing import Callable

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
# a client whose connection was re-made while it waited for a unary reply may have lost it with the
# server it was on: it publishes to the sender's probe with this header naming its reply subject,
# and the sender sends the reply again if it already went out (shared/bus/endpoint.py `SentAnswers`)
RESEND_HEADER = "Baton-Resend"

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


def _per_worker(role: str, verb: str) -> Callable[[str], str]:
    """The subject of one worker's endpoint, `baton.internal.v1.<role>.<worker_id>.<verb>`."""
    def subject(worker_id: str) -> str:
        if not isinstance(worker_id, str) or not re.fullmatch(ID_PATTERN, worker_id):
            raise ValueError(f"worker id {worker_id!r} must match {ID_PATTERN}")
        return f"{INTERNAL}.{role}.{worker_id}.{verb}"
    subject.__name__ = f"{role}_{verb}"
    return subject


decode_reserve = _per_worker("decode", "reserve")
decode_release = _per_worker("decode", "release")
decode_incoming = _per_worker("decode", "incoming")  # WriteStarting, published by prefill (no reply)
decode_prefixes = _per_worker("decode", "prefixes")  # PrefixQuery -> PrefixEvents snapshot: what its turn cache holds
prefill_dispatch = _per_worker("prefill", "dispatch")
prefill_target = _per_worker("prefill", "target")
prefill_release = _per_worker("prefill", "release")
prefill_prefixes = _per_worker("prefill", "prefixes")  # PrefixQuery -> PrefixEvents snapshot: its prefix cache
