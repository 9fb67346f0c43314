"""Endpoint: one served subject. Decode and validate, call the handler, reply, count; never crash."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from baton.proto.codec import decode
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.limits import Limits

from .wire import connection_epoch, encode_for

log = logging.getLogger(__name__)
REDELIVER_S = 5.0  # how long a reply sent around a reconnect is sent again while nobody is there to take it

# A handler returns one reply (or None: no reply), or is an async generator yielding several.
Handler = Callable[[Any], Awaitable[Any] | AsyncIterator[Any]]


@dataclass
class EndpointStats:
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # by error code
    latency_total_s: float = 0.0
    latency_max_s: float = 0.0
    disconnects: int = 0  # streams closed because the client stopped listening

    def record(self, code: ErrorCode | None, seconds: float) -> None:
        self.requests += 1
        if code is not None:
            self.errors[code.value] = self.errors.get(code.value, 0) + 1
        self.latency_total_s += seconds
        self.latency_max_s = max(self.latency_max_s, seconds)

    @property
    def latency_mean_s(self) -> float:
        return self.latency_total_s / self.requests if self.requests else 0.0


class Endpoint:
    """Serves `subject`: each message is handled in its own task, at most `max_in_flight` at once
    (beyond that the reply is `busy`). Handler errors become error replies: BatonError keeps its
    code, anything else is `internal` and logged with the request id."""

    def __init__(self, nc: Client, subject: str, request_cls: type, handler: Handler, *,
                 queue: str | None, limits: Limits, max_in_flight: int):
        self.subject, self.queue = subject, queue
        self.stats = EndpointStats()
        self._nc, self._request_cls, self._handler = nc, request_cls, handler
        self._limits, self._max_in_flight = limits, max_in_flight
        self._tasks: set[asyncio.Task] = set()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self.subject, queue=self.queue or "", cb=self._on_message)

    async def stop(self, grace_s: float) -> None:
        """Stop taking messages; let running handlers finish for `grace_s`, then cancel them
        (their callers get `unavailable`)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may already be closed
                log.debug("unsubscribe %s: %s", self.subject, exc)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for task in set(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _on_message(self, msg: Msg) -> None:
        if len(self._tasks) >= self._max_in_flight:
            self.stats.record(ErrorCode.BUSY, 0.0)
            await self._reply_error(msg.reply, BatonError(
                ErrorCode.BUSY, f"{self.subject}: {self._max_in_flight} requests in flight; retry later"),
                connection_epoch(self._nc))
            return
        task = asyncio.create_task(self._handle(msg), name=f"serve {self.subject}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, msg: Msg) -> None:
        started, code, request = time.perf_counter(), None, None
        epoch = connection_epoch(self._nc)
        try:
            request = decode(msg.data, self._request_cls, self._limits)
            result = self._handler(request)
            if inspect.isasyncgen(result):
                await self._stream(msg.reply, result, request, epoch)
            else:
                await self._answer(msg.reply, await result, epoch)
        except BatonError as exc:
            code = exc.code
            log.debug("%s: request %s: %s", self.subject, _request_id(request), exc)
            await self._reply_error(msg.reply, exc, epoch)
        except asyncio.CancelledError:
            code = ErrorCode.UNAVAILABLE
            await self._reply_error(msg.reply, BatonError(code, f"{self.subject}: service is shutting down"), epoch)
            raise
        except Exception as exc:
            code = ErrorCode.INTERNAL
            log.exception("%s: request %s failed", self.subject, _request_id(request))
            await self._reply_error(msg.reply, BatonError(
                code, f"{self.subject}: request {_request_id(request)} failed: {type(exc).__name__}: {exc}"), epoch)
        finally:
            self.stats.record(code, time.perf_counter() - started)

    async def _stream(self, reply_subject: str, replies: AsyncIterator[Any], request: Any, epoch: int) -> None:
        """Publish a streaming reply. Each chunk carries a probe reply subject: once the client's
        inbox has no subscriber any more (it stopped listening or disconnected), the server answers
        the probe with a 503 "no responders" status, and the stream is closed, which runs the
        handler's cleanup (the router then cancels the request and frees its slots). A stream whose
        connection was re-made meanwhile ends with `unavailable`: chunks sent around the reconnect
        may be lost, and the client must not take what arrives for the whole reply."""
        gone = asyncio.Event()

        async def on_probe(msg: Msg) -> None:
            if msg.headers and msg.headers.get("Status") == "503":
                gone.set()
        probe = await self._nc.subscribe(self._nc.new_inbox(), cb=on_probe) if reply_subject else None
        try:
            async with aclosing(replies):
                async for reply in replies:
                    if connection_epoch(self._nc) != epoch:
                        raise BatonError(ErrorCode.UNAVAILABLE, f"{self.subject}: the NATS connection was lost "
                                         "while the reply streamed, so part of it may be lost; send the request again")
                    if gone.is_set():
                        log.info("%s: request %s: the client stopped listening; cancelled",
                                 self.subject, _request_id(request))
                        self.stats.disconnects += 1
                        return
                    await self._reply(reply_subject, reply, probe.subject if probe else "")
        finally:
            if probe is not None:
                await probe.unsubscribe()

    async def _reply(self, reply_subject: str, message: Any, probe: str = "") -> None:
        if reply_subject and message is not None:
            await self._nc.publish(reply_subject, encode_for(reply_subject, message, self._nc.max_payload),
                                   reply=probe)

    async def _answer(self, reply_subject: str, message: Any, epoch: int) -> None:
        """The one reply to a request. If the connection was re-made while it was handled (e.g.
        nats-server restarted), the requester may not have subscribed again yet, and the server
        would drop the reply: it goes with a probe then, and again while the probe comes back 503
        "no responders", for up to REDELIVER_S."""
        if connection_epoch(self._nc) == epoch or self._nc.is_closed or not reply_subject or message is None:
            return await self._reply(reply_subject, message)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REDELIVER_S
        while self._nc.is_reconnecting and loop.time() < deadline:
            await asyncio.sleep(0.05)
        while not await self._delivered(reply_subject, message) and loop.time() < deadline:
            await asyncio.sleep(0.2)

    async def _delivered(self, reply_subject: str, message: Any) -> bool:
        """False when the server answered the reply's probe with "no responders"."""
        probe = await self._nc.subscribe(self._nc.new_inbox(), max_msgs=1)
        try:
            await self._reply(reply_subject, message, probe.subject)
            answer = await probe.next_msg(timeout=1.0)
        except nats.errors.TimeoutError:  # nothing came back: somebody took it
            return True
        finally:
            with contextlib.suppress(nats.errors.Error):
                await probe.unsubscribe()
        return not (answer.headers and answer.headers.get("Status") == "503")

    async def _reply_error(self, reply_subject: str, error: BatonError, epoch: int) -> None:
        if not reply_subject:
            return
        try:
            await self._answer(reply_subject, error.to_reply(), epoch)
        except Exception as exc:  # closed connection: the caller will time out; nothing else to do
            log.warning("%s: could not send error reply %s: %s", self.subject, error.code.value, exc)


def _request_id(request: Any) -> str:
    return str(getattr(request, "request_id", None) or "-")
