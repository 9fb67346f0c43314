"""ReplyStream: several replies to one request on an inbox subject, ending at `finished=True` or an
error."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Generic, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.limits import Limits

from .deadline import after_pause
from .wire import connection_epoch, decode_reply_from, gone, nats_errors_mapped

log = logging.getLogger(__name__)
M = TypeVar("M")
RECEIPT_S = 2.0  # a request to an ACKNOWLEDGED subject with no receipt this long is sent again


class ReplyStream(Generic[M]):
    """Async iterator of `cls` messages arriving on `self.subject`.

    The last message is the first with `finished` true; an error reply raises its BatonError;
    `timeout_per_message` seconds of silence raise timeout. After `liveness_s` of silence the
    sender is pinged on the reply subject of its last message (its probe): "no responders" means
    the sender is gone, and the stream raises unavailable within seconds instead of at its timeout.
    A stream whose connection was lost and re-made meanwhile (e.g. nats-server restarted) raises
    unavailable too: messages sent while it was away are gone, so what follows would have a gap.
    A request to a subject in `subjects.ACKNOWLEDGED` is sent again every RECEIPT_S until a server
    acknowledges it (core NATS may lose it on the way, e.g. to a server cut off from the cluster),
    the receipt's probe is pinged like a chunk's, and only that server's replies count. One reply
    awaited across a reconnect is asked for again at every `liveness_s` of silence: the server we
    were on may have dropped it, and the sender sends it again if it went out.
    The subscription is removed when the stream ends, on `close()`, on leaving `async with`, or
    when the bus closes.
    """

    def __init__(self, nc: Client, cls: type[M], timeout_per_message: float, limits: Limits,
                 request: tuple[str, bytes], on_close: Callable[["ReplyStream"], None],
                 settling: Callable[[], Callable[[], bool]] = lambda: lambda: False, liveness_s: float = 2.0,
                 one_reply: bool = False, client: str = ""):
        """`one_reply`: the first reply ends it (Bus.request to an ACKNOWLEDGED subject). `client`:
        who the request is from (senders.py), named with receipts."""
        if not one_reply and "finished" not in {f.name for f in msgspec.structs.fields(cls)}:
            raise TypeError(f"{cls.__name__} has no 'finished' field to end a stream")
        self._one_reply, self._client = one_reply, client
        self._receipts = request[0] in subjects.ACKNOWLEDGED
        inbox = nc.new_inbox()  # receipts: replies on `<inbox>.r`, the receipt on `<inbox>.r.receipt`
        self.subject, self._listen = (f"{inbox}.r", f"{inbox}.>") if self._receipts else (inbox, inbox)
        self._sender: str | None = None  # receipts: the probe of the server that took the request
        self._sent_at = 0.0  # receipts: when the request last went out (loop time)
        self._ping: asyncio.Task | None = None  # the sender's probe pinged (_check_sender)
        self._nc, self._cls, self._limits = nc, cls, limits
        self._timeout, self._liveness_s = timeout_per_message, liveness_s
        self._probe = ""  # the sender's probe subject: the reply subject of its last message
        self._request_subject, self._request_data = request  # published with reply=self.subject
        self._on_close = on_close
        self._settling = settling  # Bus.settling: whether "no responders" may mean "not subscribed again yet"
        self._still_settling: Callable[[], bool] = lambda: False
        self._sub: Subscription | None = None
        self._epoch = 0  # the connection the stream subscribed on (wire.connection_epoch)
        self._done = False

    async def start(self) -> None:
        """Subscribe, then publish the request; idempotent."""
        if self._sub is not None or self._done:
            return
        try:
            with nats_errors_mapped(self._request_subject):
                self._epoch, self._still_settling = connection_epoch(self._nc), self._settling()
                self._sub = await self._nc.subscribe(self._listen)
            await self._send()
        except BaseException:
            await self.close()
            raise

    async def __anext__(self) -> M:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        try:
            item = await self._next()
        except BaseException:
            await self.close()
            raise
        if self._one_reply or item.finished:
            await self.close()
        return item

    async def _next(self) -> M:
        deadline = asyncio.get_running_loop().time() + self._timeout
        while True:
            msg = await self._receive(deadline)
            self._check_connection()
            sender = msg.headers.get(subjects.SENDER_HEADER) if msg.headers else None
            if msg.subject != self.subject:  # the receipt: its reply subject probes the server that took it
                self._sender, self._probe = self._sender or msg.reply, self._probe or msg.reply
                continue
            if sender and self._sender and sender != self._sender:
                continue  # a second server took a resend too: only the first one's replies count
            self._sender = self._sender or sender
            break
        self._probe = msg.reply or self._probe
        if msg.headers and msg.headers.get("Status") == "503":
            if not self._still_settling():
                raise BatonError(ErrorCode.UNAVAILABLE, f"no service is listening on {self._request_subject}")
            await asyncio.sleep(0.1)  # nobody got it: the server restarted and the services are subscribing again
            await self._send()
            return await self._next()
        return decode_reply_from(self._request_subject, msg.data, self._cls, self._limits)

    async def _receive(self, deadline: float) -> Msg:
        """The next message by `deadline` (loop time), pinging the sender or sending an
        unacknowledged request again at every `liveness_s` of silence."""
        loop = asyncio.get_running_loop()
        with nats_errors_mapped(self._request_subject, self._timeout):
            while True:
                wait_s, waited_from = max(min(self._liveness_s, deadline - loop.time()), 1e-3), loop.time()
                try:
                    return await self._sub.next_msg(timeout=wait_s)
                except nats.errors.TimeoutError:
                    if loop.time() >= deadline:  # unless paused past it: what came meanwhile is still unread
                        if (deadline := after_pause(waited_from + wait_s, loop.time())) is None:
                            raise
                    self._check_connection()
                    self._check_sender()
                    if self._one_reply and self._sender and connection_epoch(self._nc) != self._epoch:
                        await self._ask_for_the_reply()
                    if self._receipts and self._sender is None and loop.time() - self._sent_at >= RECEIPT_S:
                        await self._send()  # lost on the way, or its receipt was: a server takes it once

    async def _send(self) -> None:
        headers = {subjects.RECEIPT_HEADER: "1", subjects.CLIENT_HEADER: self._client} if self._receipts else None
        self._sent_at = asyncio.get_running_loop().time()
        with nats_errors_mapped(self._request_subject):
            await self._nc.publish(self._request_subject, self._request_data, reply=self.subject, headers=headers)

    async def _ask_for_the_reply(self) -> None:
        """Ask the sender for its one reply again (sent if it already went out; else it comes when ready)."""
        if self._nc.is_connected:
            await self._nc.publish(self._sender, b"", headers={subjects.RESEND_HEADER: self.subject})

    def _check_connection(self) -> None:
        """A gap is possible in a stream; one reply lost with a connection is asked for again."""
        if not self._one_reply and connection_epoch(self._nc) != self._epoch:
            raise BatonError(ErrorCode.UNAVAILABLE, f"{self._request_subject}: the NATS connection was lost "
                             "while the reply streamed, so part of it may be lost; send the request again")

    def _check_sender(self) -> None:
        """Unavailable if the last ping of the sender's probe found it gone (wire.gone); else
        ping it again. The ping runs beside the wait for the next message, which it never delays."""
        ping, self._ping = self._ping, None
        if ping is not None and ping.done() and not ping.cancelled() and ping.exception() is None and ping.result():
            raise BatonError(ErrorCode.UNAVAILABLE, f"{self._request_subject}: the service serving "
                             "this request (the router) is gone")
        if self._probe and (ping is None or ping.done()):
            self._ping = asyncio.create_task(gone(self._nc, self._probe, self._liveness_s / 2))
        elif ping is not None:
            self._ping = ping  # still waiting for its answer

    async def close(self) -> None:
        if self._done:
            return
        self._done = True
        if self._ping is not None:
            self._ping.cancel()
        self._on_close(self)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the connection may already be closed
                log.debug("unsubscribe %s: %s", self.subject, exc)

    def __aiter__(self) -> "ReplyStream[M]":
        return self

    async def __aenter__(self) -> "ReplyStream[M]":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
