"""Bus: the typed NATS client every Baton service uses; no service hand-rolls msgpack or subjects."""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.limits import DEFAULT_LIMITS, Limits

from .deadline import within
from .endpoint import Endpoint, Handler
from .senders import acting_for
from .stream import ReplyStream
from .wire import decode_reply_from, encode_for, nats_errors_mapped

log = logging.getLogger(__name__)
M = TypeVar("M")
SETTLE_S = 5.0  # after a reconnect, how long "no responders" may only mean "not subscribed again yet"
PING_S = 5.0  # client pings to its server this far apart ...
MAX_PINGS_OUT = 3  # ... and this many unanswered make the connection lost (reconnect elsewhere)


class Bus:
    """A NATS connection plus the codec: typed request/reply, publish, streams and endpoints.

    Use `await Bus.connect(...)`, then `await bus.close()` (or `async with`), which stops the
    endpoints, lets their handlers finish within a grace period, closes open streams and drains.
    """

    def __init__(self, nc: Client, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        self.endpoints: list[Endpoint] = []
        self._nc = nc
        self._streams: set[ReplyStream] = set()
        self.client_id = uuid.uuid4().hex[:12]  # names this connection's requests (senders.py)
        self.on_reconnected: list[Callable[[], None]] = []  # called once the connection is back

    @classmethod
    async def connect(cls, url: str | list[str], name: str, *,
                      user: str | None = None, password: str | None = None, token: str | None = None,
                      creds_file: str | None = None, tls_ca_file: str | None = None,
                      tls_cert_file: str | None = None, tls_key_file: str | None = None,
                      connect_timeout_s: float = 5.0, reconnect_wait_s: float = 0.5,
                      max_reconnect_attempts: int = -1, drain_timeout_s: float = 5.0,
                      inbox_prefix: str | None = None,
                      limits: Limits = DEFAULT_LIMITS) -> "Bus":
        """Connect within `connect_timeout_s` or raise BatonError(unavailable); `url` may list
        several servers (a list, or comma-separated), tried in turn. Once connected, lost
        connections are retried every `reconnect_wait_s` (-1 attempts: forever); a server that
        stops answering pings (PING_S apart, MAX_PINGS_OUT unanswered) counts as lost, so a client
        of a silently cut-off server moves to another within ~20 s, not nats-py's 4 minutes."""
        tls = None
        if tls_ca_file or tls_cert_file:
            tls = ssl.create_default_context(cafile=tls_ca_file)
            if tls_cert_file:
                tls.load_cert_chain(tls_cert_file, tls_key_file)
        nc = nats.NATS()
        tls_error: ssl.SSLError | None = None  # a refused handshake may end as a plain reset after it

        async def on_error(exc: Exception) -> None:
            nonlocal tls_error
            if isinstance(exc, ssl.SSLError):
                tls_error = exc
            await _log_error(exc)

        async def disconnected() -> None:
            if not nc.is_closed:
                log.warning("%s: NATS connection lost; reconnecting", name)

        buses: list[Bus] = []  # the one made below, once connected

        async def reconnected() -> None:
            log.info("%s: NATS reconnected to %s", name, nc.connected_url.netloc if nc.connected_url else "?")
            for callback in buses[0].on_reconnected if buses else ():
                callback()

        servers = [u.strip() for u in url.split(",") if u.strip()] if isinstance(url, str) else url
        options = dict(
            servers=servers, name=name, ping_interval=PING_S, max_outstanding_pings=MAX_PINGS_OUT, user=user, password=password, token=token,
            user_credentials=creds_file, tls=tls, connect_timeout=min(connect_timeout_s, 2.0),
            reconnect_time_wait=reconnect_wait_s, max_reconnect_attempts=max_reconnect_attempts,
            drain_timeout=drain_timeout_s, error_cb=on_error, disconnected_cb=disconnected,
            reconnected_cb=reconnected, **({"inbox_prefix": inbox_prefix} if inbox_prefix else {}))
        try:
            await asyncio.wait_for(nc.connect(**options), connect_timeout_s)
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            await nc.close()
            reason = tls_error or nc.last_error or exc  # a TLS refusal says more than the reset after it
            raise BatonError(ErrorCode.UNAVAILABLE, f"cannot connect to NATS at {url} within "
                             f"{connect_timeout_s:g} s: {type(reason).__name__} {reason}".rstrip()) from None
        buses.append(cls(nc, limits))
        return buses[0]

    @property
    def connection(self) -> Client:
        """The nats-py client, for what the bus does not wrap (JetStream key-value)."""
        return self._nc

    async def request(self, subject: str, message: Any, reply_cls: type[M], timeout: float = 5.0,
                      joined_at: float = 0.0) -> M:
        """One request, one reply of type `reply_cls`; an error reply raises its BatonError.
        `joined_at`: when the responder was first seen (monotonic): within SETTLE_S of it, "no
        responders" may only mean its subscriptions have not reached our server yet (a NATS
        cluster propagates them over its routes), and the request is sent again."""
        data = encode_for(subject, message, self._nc.max_payload)
        settling = self.settling(joined_at)
        if subject in subjects.ACKNOWLEDGED:
            return await self._request_with_receipt(subject, data, reply_cls, timeout, settling)
        with nats_errors_mapped(subject, timeout):
            while True:
                try:  # nats-py's own timer off (None): ours gives a reply that came during a pause its chance
                    sending = asyncio.ensure_future(self._nc.request(subject, data, timeout=None))
                    try:
                        await asyncio.sleep(0)  # its task queues the message ...
                    except asyncio.CancelledError:
                        sending.cancel()  # it would wait for its reply forever (no timer of its own)
                        raise
                    self.write_pending()  # ... which goes out now, not on nats-py's flusher's turn
                    msg = await within(sending, timeout)
                    break
                except nats.errors.NoRespondersError:
                    if not settling():
                        raise
                await asyncio.sleep(0.1)
        return decode_reply_from(subject, msg.data, reply_cls, self.limits)

    async def _request_with_receipt(self, subject: str, data: bytes, reply_cls: type[M], timeout: float,
                                    settling: Callable[[], bool]) -> M:
        """`request` to a subject in `subjects.ACKNOWLEDGED`, as a one-message ReplyStream: sent
        again until a server acknowledges it, then that server is pinged while the reply is awaited
        (unavailable within seconds once it is gone), and only its reply counts."""
        stream = ReplyStream(self._nc, reply_cls, timeout, self.limits, (subject, data), self._streams.discard,
                             lambda: settling, one_reply=True, client=self._client())
        async with self._track(stream):
            return await stream.__anext__()

    def settling(self, joined_at: float = 0.0) -> Callable[[], bool]:
        """For a request sent now: whether a "no responders" answer may only mean that the server
        was restarted and its services have not subscribed again yet (they do a moment after we
        reconnect), or that the responder joined at `joined_at` and its subscriptions are still on
        their way. Nobody received the message then, so sending it again duplicates nothing."""
        reconnects, reconnecting = self._nc.stats["reconnects"], not self._nc.is_connected
        until = 0.0  # SETTLE_S after the first "no responders" since the reconnect

        def settling() -> bool:
            nonlocal until
            if time.monotonic() < joined_at + SETTLE_S:
                return True
            if not reconnecting and self._nc.stats["reconnects"] == reconnects:
                return False
            until = until or time.monotonic() + SETTLE_S
            return time.monotonic() < until
        return settling

    def write_pending(self) -> bool:
        """Write what nats-py has queued to the socket now; True if there was something. nats-py
        queues every message and its flusher task writes the queue on a later turn of the loop:
        one write for many messages (a decode step's chunks), but a lone message on the first
        token's path (the dispatch, the first token) waits for it. Uses nats-py 2.x internals
        (`_pending`, `_transport`); where they differ, nothing is written here and the flusher
        writes as before (tests/test_bus_request.py fails then)."""
        nc = self._nc
        pending, transport = getattr(nc, "_pending", None), getattr(nc, "_transport", None)
        if not (pending and transport is not None and nc.is_connected and hasattr(nc, "_pending_data_size")):
            return False
        transport.writelines(pending)
        nc._pending, nc._pending_data_size = [], 0  # the flusher finds nothing left
        return True

    @staticmethod
    async def let_out() -> None:
        """Let what tasks started this turn of the loop send reach the socket before the caller
        goes on: a `request` is written after two turns (its task, nats-py's request task). For a
        message on the critical path that must not wait behind the caller's own next work (the
        router's dispatch, before its reservation)."""
        for _ in range(2):
            await asyncio.sleep(0)

    async def publish(self, subject: str, message: Any, reply: str = "") -> None:
        """`reply`: a probe subject, answered with a 503 "no responders" once nobody listens on `subject`."""
        data = encode_for(subject, message, self._nc.max_payload)
        with nats_errors_mapped(subject):
            await self._nc.publish(subject, data, reply=reply)

    def stream_request(self, subject: str, message: Any, chunk_cls: type[M],
                       timeout_per_message: float = 30.0) -> ReplyStream[M]:
        """Send a request whose replies are several `chunk_cls` messages, the last `finished`.

        async with bus.stream_request(GENERATE, request, StreamChunk) as chunks:
            async for chunk in chunks: ...
        """
        data = encode_for(subject, message, self._nc.max_payload)
        return self._track(ReplyStream(self._nc, chunk_cls, timeout_per_message, self.limits,
                                       (subject, data), self._streams.discard, self.settling, client=self._client()))

    def _client(self) -> str:
        return acting_for.get() or self.client_id

    async def subscribe(self, subject: str, callback: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """A raw subscription (`callback(msg)` per message, in order), known to the server on return."""
        with nats_errors_mapped(subject):
            sub = await self._nc.subscribe(subject, cb=callback)
        await self._sync_with_server(subject)
        return sub

    async def serve(self, subject: str, request_cls: type, handler: Handler, *,
                    queue: str | None = None, max_in_flight: int = 256) -> Endpoint:
        """Serve `subject`: `handler(request)` returns the reply (None: no reply) or is an async
        generator yielding several (a streaming reply). See Endpoint for error handling."""
        endpoint = Endpoint(self._nc, subject, request_cls, handler, queue=queue,
                            limits=self.limits, max_in_flight=max_in_flight)
        await endpoint.start()
        self.endpoints.append(endpoint)
        await self._sync_with_server(subject)  # serving, as far as the server knows, on return
        return endpoint

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop endpoints (handlers get `grace_s` to finish), close streams, drain, disconnect."""
        await asyncio.gather(*(endpoint.stop(grace_s) for endpoint in self.endpoints))
        self.endpoints.clear()
        for stream in list(self._streams):
            await stream.close()
        if self._nc.is_closed:
            return
        try:
            await self._nc.drain()
        except Exception as exc:  # drain timed out or the connection broke: close regardless
            log.warning("NATS drain failed: %s", exc)
            await self._nc.close()

    async def __aenter__(self) -> "Bus":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _sync_with_server(self, subject: str, timeout: float = 5.0) -> None:
        """Return once the server has processed everything sent so far. nats-py 2.16's flush()
        writes its PING ahead of commands still buffered, so the first PONG can come back before
        the server saw a new SUB; the second PING leaves after the buffer has been written."""
        with nats_errors_mapped(subject, timeout):
            await self._nc.flush(timeout)
            await self._nc.flush(timeout)

    def _track(self, stream: ReplyStream[M]) -> ReplyStream[M]:
        self._streams.add(stream)
        return stream


async def _log_error(exc: Exception) -> None:
    log.warning("NATS error: %s %s", type(exc).__name__, exc)
