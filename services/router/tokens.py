"""Every flow's token stream on one subscription.

Decode publishes a request's TokenChunks to the subject the router gave it at reservation,
`<prefix>.<n>`; one wildcard subscription, made once at start-up, hands each message to the queue
of the flow (attempt) that owns the subject. Per request that saves a SUB and a round trip to the
server that a fresh inbox needs before decode may publish to it (nats-py's request() muxes its
replies the same way). A message for a subject nobody owns (an attempt that already ended) is
dropped.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

from nats.aio.msg import Msg

from baton.proto.errors import BatonError
from baton.proto.internal import TokenChunk
from baton.shared.bus import Bus
from baton.shared.bus.wire import decode_reply_from

log = logging.getLogger("baton.router.tokens")


class TokenInbox:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.prefix = bus.connection.new_inbox()
        self._routes: dict[str, asyncio.Queue] = {}
        self._numbers = itertools.count()

    async def start(self) -> None:
        await self.bus.subscribe(f"{self.prefix}.*", self._deliver)

    def open(self, events: asyncio.Queue) -> str:
        """A fresh subject whose chunks go to `events` as ("chunk", TokenChunk) or ("error",
        BatonError) until `close(subject)`."""
        subject = f"{self.prefix}.{next(self._numbers)}"
        self._routes[subject] = events
        return subject

    def close(self, subject: str) -> None:
        self._routes.pop(subject, None)

    async def _deliver(self, msg: Msg) -> None:
        events = self._routes.get(msg.subject)
        if events is None:
            log.debug("dropped a message for %s: its flow has ended", msg.subject)
            return
        try:
            events.put_nowait(("chunk", decode_reply_from(msg.subject, msg.data, TokenChunk, self.bus.limits)))
        except BatonError as exc:
            events.put_nowait(("error", exc))
