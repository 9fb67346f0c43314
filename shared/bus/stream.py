"""ReplyStream: several replies to one request on an inbox subject, ending at `finished=True` or an
error."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import fields
from typing import Any, Callable, Generic, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.limits import Limits

from .wire import connection_epoch, decode_reply_from, nats_errors_mapped

log = logging.getLogger(__name__)
M = TypeVar("M")


class ReplyStream(Generic[M]):
    """Async iterator of `cls` messages arriving on `self.subject`.

    The last message is the first with `finished` true; an error reply raises its BatonError;
    `timeout_per_message` seconds of silence raise timeout. After `liveness_s` of silence the
    sender is pinged on the reply subject of its last message (its probe): "no responders" means
    the sender is gone, and the stream raises unavailable within seconds instead of at its timeout.
    A stream whose connection was lost and re-made meanwhile (e.g. nats-server restarted) raises
    unavailable too: messages sent while it was away are gone, so what follows would have a gap.
    The subscription is removed when the stream ends, on `close()`, on leaving `async with`, or
    when the bus closes.
    """

    def __init__(self, nc: Client, cls: type[M], timeout_per_message: float, limits: Limits,
                 request: tuple[str, bytes], on_close: Callable[["ReplyStream"], None],
                 settling: Callable[[], Callable[[], bool]] = lambda: lambda: False, liveness_s: float = 2.0):
        if "finished" not in {f.name for f in fields(cls)}:
            raise TypeError(f"{cls.__name__} has no 'finished' field to end a stream")
        self.subject = nc.new_inbox()
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
                self._sub = await self._nc.subscribe(self.subject)
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
        if item.finished:
            await self.close()
        return item

    async def _next(self) -> M:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        with nats_errors_mapped(self._request_subject, self._timeout):
            while True:
                try:
                    msg = await self._sub.next_msg(timeout=max(min(self._liveness_s, deadline - loop.time()), 1e-3))
                    break
                except nats.errors.TimeoutError:
                    if loop.time() >= deadline:
                        raise
                    self._check_connection()
                    await self._check_sender()
        self._check_connection()
        self._probe = msg.reply or self._probe
        if msg.headers and msg.headers.get("Status") == "503":
            if not self._still_settling():
                raise BatonError(ErrorCode.UNAVAILABLE, f"no service is listening on {self._request_subject}")
            await asyncio.sleep(0.1)  # nobody got it: the server restarted and the services are subscribing again
            await self._send()
            return await self._next()
        return decode_reply_from(self._request_subject, msg.data, self._cls, self._limits)

    async def _send(self) -> None:
        with nats_errors_mapped(self._request_subject):
            await self._nc.publish(self._request_subject, self._request_data, reply=self.subject)

    def _check_connection(self) -> None:
        if connection_epoch(self._nc) != self._epoch:
            raise BatonError(ErrorCode.UNAVAILABLE, f"{self._request_subject}: the NATS connection was lost "
                             "while the reply streamed, so part of it may be lost; send the request again")

    async def _check_sender(self) -> None:
        """Ping the sender's probe: its subscription receives and ignores the ping (a timeout here),
        unless the sender is gone, when the server answers "no responders"."""
        if not self._probe:
            return
        try:
            await self._nc.request(self._probe, b"", timeout=self._liveness_s / 2)
        except nats.errors.NoRespondersError:
            raise BatonError(ErrorCode.UNAVAILABLE, f"{self._request_subject}: the service serving "
                             "this request (the router) is gone") from None
        except (asyncio.TimeoutError, nats.errors.Error):  # alive, or NATS itself unreachable for now
            pass

    async def close(self) -> None:
        if self._done:
            return
        self._done = True
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
