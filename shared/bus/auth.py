"""NATS users and subject permissions for Baton's own server (`baton up` generates them).

Two kinds of users in one account with JetStream:
    service   registry, router, prefill, decode: every subject (internal traffic, JetStream,
              replies to clients)
    client    the public API only: may publish to `baton.v1.>` and subscribe only to its own reply
              inboxes `_INBOX_<user>.>` (it connects with that inbox prefix), so it can neither
              see nor forge internal traffic, nor read another client's replies. It may also
              publish to the reply subject of a message it received (`allow_responses`): the probe
              of a stream chunk, pinged to learn whether the router serving it is still alive.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass

from baton.proto.subjects import PUBLIC


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str
    inbox_prefix: str | None = None  # clients: their private reply-inbox prefix

    def connect_options(self) -> dict:
        """Keyword arguments for `Bus.connect`."""
        options = {"user": self.user, "password": self.password}
        return options | ({"inbox_prefix": self.inbox_prefix} if self.inbox_prefix else {})

    def as_dict(self) -> dict:
        return asdict(self)


def new_service() -> Credentials:
    return Credentials("service", secrets.token_urlsafe(24))


def new_client(user: str = "client") -> Credentials:
    return Credentials(user, secrets.token_urlsafe(24), inbox_prefix=f"_INBOX_{user}")


def server_config(service: Credentials, clients: list[Credentials]) -> str:
    """A nats-server config (JSON is valid nats-server syntax) with these users and permissions."""
    users = [{"user": service.user, "password": service.password,
              "permissions": {"publish": ">", "subscribe": ">"}}]
    users += [{"user": c.user, "password": c.password,
               "permissions": {"publish": {"allow": [f"{PUBLIC}.>"]},
                               "subscribe": {"allow": [f"{c.inbox_prefix}.>"]},
                               "allow_responses": {"max": 1000, "expires": "30m"}}} for c in clients]
    return json.dumps({"accounts": {"BATON": {"jetstream": "enabled", "users": users}}}, indent=2) + "\n"
