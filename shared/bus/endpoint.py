"""Endpoint: one served subject. Decode and validate, call the handler, reply, count; never crash."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from baton.proto import subjects
from baton.proto.codec import decode
from baton.proto.errors import BatonError, ErrorCode, ErrorReply
from baton.proto.limits import Limits

from .senders import request_sender, sender_of
from .wire import connection_epoch, encode_for

log = logging.getLogger(__name__)
# A stream whose last chunks went out on a connection lost before the server took them: they may be
# lost, and the client, still waiting for the end, is told so (it ignores this if the end reached it).
_STREAM_END_LOST = ("the NATS connection was lost as the reply's last chunks went out, so they may be lost; "
                    "send the request again")
REDELIVER_S = 5.0  # how long a reply sent around a reconnect is sent again while nobody is there to take it
ACK_S = 20.0  # how long a unary reply waits for the server's PONG after it (> nats-py's ping-out, PING_S x 3)
RECEIPTS_KEPT = 65_536  # reply subjects of the latest requests taken, so that a resend is told apart
ANSWERS_KEPT_S = 120.0  # how long a unary answer is kept to be sent again when its client asks (SentAnswers)
ANSWERS_KEPT_BYTES = 32 << 20  # ... and how much of them at most

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


class SentAnswers:
    """The latest unary answers of an endpoint with receipts, encoded, by reply subject. A client
    whose connection was re-made while it waited may have lost its answer with the server it was
    on (the answer went out whole on ours); it asks for it again (`subjects.RESEND_HEADER`).
    Bounded by age and bytes: the oldest go first."""

    def __init__(self, keep_s: float = ANSWERS_KEPT_S, max_bytes: int = ANSWERS_KEPT_BYTES):
        self._keep_s, self._max_bytes = keep_s, max_bytes
        self._answers: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # reply subject -> (sent at, data)
        self._bytes = 0

    def add(self, reply_subject: str, data: bytes) -> None:
        self._drop(reply_subject)
        self._answers[reply_subject] = (time.monotonic(), data)
        self._bytes += len(data)
        self._trim()

    def get(self, reply_subject: str) -> bytes | None:
        self._trim()
        entry = self._answers.get(reply_subject)
        return entry[1] if entry else None

    def _drop(self, reply_subject: str) -> None:
        if (entry := self._answers.pop(reply_subject, None)) is not None:
            self._bytes -= len(entry[1])

    def _trim(self) -> None:
        now = time.monotonic()
        while self._answers:
            reply_subject, (sent_at, _) = next(iter(self._answers.items()))
            if now - sent_at <= self._keep_s and self._bytes <= self._max_bytes:
                return
            self._drop(reply_subject)


class Endpoint:
    """Serves `subject`: each message is handled in its own task, at most `max_in_flight` at once
    (beyond that the reply is `busy`). Handler errors become error replies: BatonError keeps its
    code, anything else is `internal` and logged with the request id. A subject in
    `subjects.ACKNOWLEDGED` acknowledges receipt (`_acknowledge_receipt`)."""

    def __init__(self, nc: Client, subject: str, request_cls: type, handler: Handler, *,
                 queue: str | None, limits: Limits, max_in_flight: int):
        self.subject, self.queue = subject, queue
        self.stats = EndpointStats()
        self._nc, self._request_cls, self._handler = nc, request_cls, handler
        self._limits, self._max_in_flight = limits, max_in_flight
        self._tasks: set[asyncio.Task] = set()  # handlers: at most max_in_flight
        self._confirming: set[asyncio.Task] = set()  # sent replies waiting for the server's PONG (_confirm)
        self._sub: Subscription | None = None
        self._probe: Subscription | None = None  # receipts: this endpoint's probe, named in every reply
        self._taken: OrderedDict[str, None] = OrderedDict()  # receipts: reply subjects of requests taken
        self._sent = SentAnswers()  # receipts: unary answers, to send again when a client asks

    async def start(self) -> None:
        if self.subject in subjects.ACKNOWLEDGED:
            self._probe = await self._nc.subscribe(self._nc.new_inbox(), cb=self._on_probe)
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
        if self._tasks or self._confirming:
            await asyncio.wait(self._tasks | self._confirming, timeout=grace_s)
        for task in self._tasks | self._confirming:
            task.cancel()
        if self._tasks or self._confirming:
            await asyncio.wait(self._tasks | self._confirming)
        if self._probe is not None:  # last: clients ping it while the handlers finish
            with contextlib.suppress(Exception):  # the connection may already be closed
                await self._probe.unsubscribe()

    async def _on_message(self, msg: Msg) -> None:
        if self._probe is not None and not await self._acknowledge_receipt(msg):
            return
        if len(self._tasks) >= self._max_in_flight:
            self.stats.record(ErrorCode.BUSY, 0.0)
            await self._reply_error(msg.reply, BatonError(
                ErrorCode.BUSY, f"{self.subject}: {self._max_in_flight} requests in flight; retry later"),
                connection_epoch(self._nc))
            return
        task = asyncio.create_task(self._handle(msg), name=f"serve {self.subject}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acknowledge_receipt(self, msg: Msg) -> bool:
        """A request that asks for a receipt (RECEIPT_HEADER) gets one on `<reply>.receipt` at once,
        with this endpoint's probe as its reply subject. False for a resend of one already taken
        (the same reply subject): acknowledged again, handled once."""
        if not (msg.reply and msg.headers and msg.headers.get(subjects.RECEIPT_HEADER)):
            return True
        try:
            await self._nc.publish(msg.reply + subjects.RECEIPT_SUFFIX, b"", reply=self._probe.subject)
        except nats.errors.Error as exc:  # the client sends it again
            log.debug("%s: receipt not sent: %s", self.subject, exc)
        if msg.reply in self._taken:
            self._taken.move_to_end(msg.reply)
            return False
        self._taken[msg.reply] = None
        if len(self._taken) > RECEIPTS_KEPT:
            self._taken.popitem(last=False)
        return True

    async def _handle(self, msg: Msg) -> None:
        started, code, request = time.perf_counter(), None, None
        epoch = connection_epoch(self._nc)
        request_sender.set(sender_of(msg))  # this task's (and its handler's) context only
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
            if reply_subject:
                self._confirm_later(reply_subject, BatonError(ErrorCode.UNAVAILABLE, _STREAM_END_LOST).to_reply(),
                                    epoch)
        finally:
            if probe is not None:
                await probe.unsubscribe()

    async def _reply(self, reply_subject: str, message: Any, probe: str = "") -> None:
        if reply_subject and message is not None:
            await self._publish(reply_subject, encode_for(reply_subject, message, self._nc.max_payload), probe)

    async def _publish(self, reply_subject: str, data: bytes, probe: str = "") -> None:
        """An encoded reply, naming this endpoint's probe (SENDER_HEADER) where it has receipts."""
        sender = {subjects.SENDER_HEADER: self._probe.subject} if self._probe is not None else None
        await self._nc.publish(reply_subject, data, reply=probe, headers=sender)

    async def _answer(self, reply_subject: str, message: Any, epoch: int) -> None:
        """The one reply to a request. If the connection was re-made while it was handled (e.g.
        nats-server restarted), the requester may not have subscribed again yet, and the server
        would drop the reply: it goes with a probe then, and again while the probe comes back 503
        "no responders", for up to REDELIVER_S. A reply sent on a connection that is lost before
        the server acknowledged it (a PONG after it) may be lost with the socket's unsent bytes
        (a partition: nats-py gives up on a silent server only after PING_S x MAX_PINGS_OUT), and
        goes again the same way on the next connection; a requester ignores a second copy."""
        if self._nc.is_closed or not reply_subject or message is None:
            return await self._reply(reply_subject, message)
        data = encode_for(reply_subject, message, self._nc.max_payload)
        if self._probe is not None:
            self._sent.add(reply_subject, data)
        if connection_epoch(self._nc) != epoch:
            return await self._redeliver(reply_subject, message)
        await self._publish(reply_subject, data)
        self._confirm_later(reply_subject, message, epoch)

    def _confirm_later(self, reply_subject: str, message: Any, epoch: int) -> None:
        """Once what went out on connection `epoch` is confirmed by the server (`_acknowledged`),
        nothing; if that connection was lost first, `message` goes on the next one (`_redeliver`)."""
        task = asyncio.create_task(self._confirm(reply_subject, message, epoch), name=f"confirm {self.subject}")
        self._confirming.add(task)  # stop() waits for it like for a handler; not counted as one
        task.add_done_callback(self._confirming.discard)

    async def _confirm(self, reply_subject: str, message: Any, epoch: int) -> None:
        try:
            if not await self._acknowledged(epoch) and not self._nc.is_closed:
                log.info("%s: a reply went out on a connection lost before the server took it; sending %s",
                         self.subject, "an error" if isinstance(message, ErrorReply) else "it again")
                await self._redeliver(reply_subject, message)
        except Exception as exc:  # e.g. the connection closed meanwhile: the requester times out
            log.warning("%s: could not send a reply again: %s", self.subject, exc)

    async def _redeliver(self, reply_subject: str, message: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REDELIVER_S
        while self._nc.is_reconnecting and loop.time() < deadline:
            await asyncio.sleep(0.05)
        while not await self._delivered(reply_subject, message) and loop.time() < deadline:
            await asyncio.sleep(0.2)

    async def _acknowledged(self, epoch: int) -> bool:
        """True once the server answered a PING sent after what we published on connection
        `epoch` (so it has those bytes), or the bus is closing; False if that connection was lost
        first, or no PONG came within ACK_S. nats-py writes a flush's PING ahead of commands still
        buffered, so the second PING is the one that follows the reply (Bus._sync_with_server)."""
        for _ in range(2):
            pong = asyncio.ensure_future(self._nc.flush(timeout=ACK_S))
            pong.add_done_callback(_retrieve)  # never cancelled: a cancelled PONG future stops nats-py's read loop
            while not pong.done():
                if self._nc.is_closed or self._nc.is_draining:
                    return True  # closing: nothing more can be sent
                if connection_epoch(self._nc) != epoch:
                    return False  # nats-py dropped the PONG with the connection; the flush times out unseen
                await asyncio.wait([pong], timeout=0.05)
            if pong.exception() is not None:
                return self._nc.is_closed
        return True

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

    async def _on_probe(self, msg: Msg) -> None:
        """A client's ping of the probe (taken and ignored: the client knows this endpoint lives),
        or its ask for a unary answer again (`subjects.RESEND_HEADER`), sent if it went out."""
        reply_subject = msg.headers.get(subjects.RESEND_HEADER) if msg.headers else None
        if reply_subject and (data := self._sent.get(reply_subject)) is not None:
            try:
                await self._publish(reply_subject, data)
            except nats.errors.Error as exc:  # the client asks again
                log.debug("%s: answer not sent again: %s", self.subject, exc)

    async def _reply_error(self, reply_subject: str, error: BatonError, epoch: int) -> None:
        if not reply_subject:
            return
        try:
            await self._answer(reply_subject, error.to_reply(), epoch)
        except Exception as exc:  # closed connection: the caller will time out; nothing else to do
            log.warning("%s: could not send error reply %s: %s", self.subject, error.code.value, exc)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _request_id(request: Any) -> str:
    return str(getattr(request, "request_id", None) or "-")
