"""Who a request is from, for a fair share of what a service does for many clients at once (the
router's tokenization, services/router/tokenize.py).

A Bus names the client on every request it sends to a subject in `subjects.ACKNOWLEDGED`
(`subjects.CLIENT_HEADER`): its own connection's id, or, where `acting_for` is set (a frontend
serving its own clients, e.g. the HTTP server per peer address), that name. The Endpoint sets
`request_sender` for the handler: the header, else the reply subject without its last token
(nats-py's requests from one connection share that prefix).
"""
from __future__ import annotations

from contextvars import ContextVar

from nats.aio.msg import Msg

from baton.proto import subjects

acting_for: ContextVar[str] = ContextVar("acting_for", default="")
request_sender: ContextVar[str] = ContextVar("request_sender", default="")


def sender_of(msg: Msg) -> str:
    named = msg.headers.get(subjects.CLIENT_HEADER) if msg.headers else None
    return named or (msg.reply or "").rpartition(".")[0]
