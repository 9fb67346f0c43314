"""`baton serve http`: the OpenAI-compatible HTTP frontend (aiohttp).

    POST /v1/completions         POST /v1/chat/completions      (JSON, or SSE with "stream": true)
    GET  /v1/models              GET  /v1/models/{model}
    GET  /health                 GET  /metrics                  (Prometheus)

With API keys configured (`http.api_key`, `http.api_key_file`), every route but /health needs
`Authorization: Bearer <key>`; the keys are compared in constant time and never logged.

It is a client of the public NATS API and nothing more: each HTTP request becomes one
`baton.v1.generate` (text prompt or token ids; chat messages rendered by `api.render_chat`), the
reply or the stream of chunks becomes OpenAI JSON / server-sent events, and Baton error codes
become HTTP statuses (`api.STATUS`). A client that goes away mid-request gets its generation
cancelled (`baton.v1.cancel`), so no decode slot works for nobody.

Streaming answers are started only once the first chunk is in, so errors the router finds before
any token (bad_request, too_large, busy, unavailable) still get their real HTTP status; an error
after that arrives as an SSE event `{"error": {...}}`, as vLLM and OpenAI send it.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from typing import Any

import prometheus_client as prom
from aiohttp import web

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import CancelReply, CancelRequest, GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from baton.shared.bus.senders import acting_for
from baton.shared.config import Config

from . import api

log = logging.getLogger("baton.http")
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ROUTER_PROBE_TTL_S = 5.0


class Metrics:
    """Per-frontend Prometheus metrics, in their own registry (several frontends may share a process)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        self.requests = prom.Counter("baton_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=self.registry)
        self.latency = prom.Histogram("baton_http_request_seconds", "time to the complete answer", ["route"],
                                      registry=self.registry)
        self.ttft = prom.Histogram("baton_http_time_to_first_token_seconds", "streams: time to the first chunk",
                                   ["route"], registry=self.registry)
        self.tokens = prom.Counter("baton_http_completion_tokens", "completion tokens returned", ["route"],
                                   registry=self.registry)

    def exposition(self) -> bytes:
        return prom.generate_latest(prom.REGISTRY) + prom.generate_latest(self.registry)


class Frontend:
    def __init__(self, bus: Bus, cfg: Config) -> None:
        self.bus, self.cfg = bus, cfg
        self.model = cfg.model_name
        self.created = int(time.time())
        self.metrics = Metrics()
        self.api_keys = [k.encode() for k in cfg.http_api_keys()]
        self._vocab: api.Vocab | None = None  # loaded on the first request that needs it
        self._router_seen = 0.0  # monotonic time a router last answered the health probe
        self._background: set[asyncio.Task] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.http.max_body_bytes, middlewares=[self._errors, self._auth])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model_card),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_endpoint),
        ])
        return app

    # --- routes --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        call = api.parse_completion(await self._body(request), self.model)
        return await self._generate(request, call, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        call = api.parse_chat(await self._body(request), self.model, self.cfg.http.default_max_tokens)
        return await self._generate(request, call, "chat")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(api.models(self.model, self.created))

    async def model_card(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model:
            raise api.HttpError(404, f"the model '{request.match_info['model']}' does not exist",
                                code="model_not_found", param="model")
        return web.json_response(api.model_card(self.model, self.created))

    async def health(self, request: web.Request) -> web.Response:
        """200 when connected to NATS and a router answered within the last few seconds (probed
        with a cancel of an unknown request id: public API only), else 503 and why."""
        if not self.bus.connection.is_connected:
            return web.json_response({"status": "unavailable", "reason": "not connected to NATS"}, status=503)
        if time.monotonic() - self._router_seen > ROUTER_PROBE_TTL_S:
            try:
                await self.bus.request(subjects.CANCEL, CancelRequest(request_id="health-probe"), CancelReply,
                                       timeout=3.0)
                self._router_seen = time.monotonic()
            except BatonError as exc:
                return web.json_response({"status": "unavailable", "reason": f"router: {exc}"}, status=503)
        return web.json_response({"status": "ok", "model": self.model})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

    # --- generation ----------------------------------------------------------------------
    async def _generate(self, request: web.Request, call: api.Call, route: str) -> web.StreamResponse:
        header_id = request.headers.get("X-Request-Id")
        call = api.with_request_id(call, header_id if header_id and REQUEST_ID.fullmatch(header_id) else None)
        started = time.monotonic()
        acting_for.set(f"http {request.remote}")  # the router's fair share of tokenization is per peer address
        if call.stream:
            response = await self._stream(request, call, route, started)
        else:
            replies = await self._unary(call)
            self.metrics.tokens.labels(route).inc(sum(r.usage.completion_tokens for r in replies))
            response = web.json_response(api.response(call, replies, self.vocab(call)),
                                         headers={"X-Request-Id": call.request.request_id})
        self.metrics.latency.labels(route).observe(time.monotonic() - started)
        return response

    async def _unary(self, call: api.Call) -> list[GenerateReply]:
        """One reply per choice, asked for all at once; the first failure fails the call."""
        pending = [asyncio.create_task(self._one(r)) for r in call.requests]
        try:
            return list(await asyncio.gather(*pending))
        finally:
            for task in pending:
                task.cancel()  # a no-op for the finished; the others cancel their request (`_one`)

    async def _one(self, request: GenerateRequest) -> GenerateReply:
        done = False
        try:
            reply = await self.bus.request(subjects.GENERATE, request, GenerateReply,
                                           timeout=self.cfg.http.request_timeout_s)
            done = True
            return reply
        except BatonError as exc:
            done = exc.code != ErrorCode.TIMEOUT  # our own deadline: the router may still be working
            raise
        finally:
            if not done:  # the client left (handler cancelled) or we gave up waiting
                self._cancel(request.request_id)

    async def _stream(self, request: web.Request, call: api.Call, route: str, started: float) -> web.StreamResponse:
        rid = call.request.request_id
        unfinished = {r.request_id for r in call.requests}
        response: web.StreamResponse | None = None
        try:
            async with ChoiceStreams(self.bus, call, self.cfg.http.request_timeout_s) as chunks:
                index, chunk = await chunks.next()  # errors before the first token get their HTTP status
                self.metrics.ttft.labels(route).observe(time.monotonic() - started)
                response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": rid})
                await response.prepare(request)
                for event in api.first_chunks(call):
                    await _send(response, event)
                vocab, states = self.vocab(call), [api.StreamState() for _ in call.requests]
                usages: list = [None] * len(call.requests)
                while True:
                    for event in api.stream_chunks(call, chunk, vocab, states[index], index):
                        await _send(response, event)
                    self.metrics.tokens.labels(route).inc(len(chunk.token_ids))
                    if chunk.finished:
                        unfinished.discard(call.requests[index].request_id)
                        usages[index] = chunk.usage
                        if not unfinished:
                            for event in api.last_chunks(call, usages):
                                await _send(response, event)
                            break
                    try:
                        index, chunk = await chunks.next()
                    except BatonError as exc:
                        if exc.code == ErrorCode.TIMEOUT:  # our own deadline: the router may still be working
                            unfinished.clear()
                        await _send(response, api.HttpError.from_baton(exc).body())
                        break
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
        except ConnectionError:  # the client went away while we wrote
            log.info("client left request %s", rid)
            return response
        except BatonError as exc:
            if exc.code == ErrorCode.TIMEOUT:
                unfinished.clear()
            raise
        finally:
            for request_id in unfinished:
                self._cancel(request_id)

    def vocab(self, call: api.Call) -> api.Vocab | None:
        """The tokenizer's strings, for the calls that need token ids turned into text."""
        if call.needs_vocab and self._vocab is None:
            self._vocab = api.Vocab(self.cfg.model.path)
        return self._vocab

    def _cancel(self, request_id: str) -> None:
        """Cancel in the background: this handler may itself be being cancelled."""
        async def cancel() -> None:
            try:
                reply = await self.bus.request(subjects.CANCEL, CancelRequest(request_id=request_id), CancelReply,
                                               timeout=5.0)
                log.info("cancelled %s (was running: %s)", request_id, reply.cancelled)
            except BatonError as exc:
                log.warning("cancel %s failed: %s", request_id, exc)
        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self, timeout: float = 5.0) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)

    # --- plumbing ------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise api.HttpError(413, f"the request body is larger than {self.cfg.http.max_body_bytes} bytes "
                                     "(http.max_body_bytes)", code=ErrorCode.TOO_LARGE.value) from None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise api.bad(f"the request body is not valid JSON: {exc}") from None

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_keys and request.path != "/health":
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                raise _unauthorized("no API key: send 'Authorization: Bearer <key>'")
            given = given.strip().encode()
            if not any([hmac.compare_digest(given, k) for k in self.api_keys]):  # every key: constant time
                raise _unauthorized("incorrect API key")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        try:
            response = await handler(request)
        except api.HttpError as exc:
            response = _error(exc)
        except BatonError as exc:
            response = _error(api.HttpError.from_baton(exc))
        except web.HTTPException as exc:  # 404 / 405 from routing
            response = _error(api.HttpError(exc.status, exc.reason, code=None))
        self.metrics.requests.labels(route, str(response.status if response is not None else 499)).inc()
        return response


class ChoiceStreams:
    """Every choice's stream of chunks at once, merged: `next()` returns (choice index, chunk) in
    arrival order and raises the first error any stream raised."""

    def __init__(self, bus: Bus, call: api.Call, timeout_s: float) -> None:
        self.bus, self.call, self.timeout_s = bus, call, timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "ChoiceStreams":
        self.tasks = [asyncio.create_task(self._pump(index, r)) for index, r in enumerate(self.call.requests)]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def next(self) -> tuple[int, StreamChunk]:
        index, item = await self.queue.get()  # each stream's own per-message timeout bounds the wait
        if isinstance(item, BaseException):
            raise item
        return index, item

    async def _pump(self, index: int, request: GenerateRequest) -> None:
        try:
            async with self.bus.stream_request(subjects.GENERATE, request, StreamChunk,
                                               timeout_per_message=self.timeout_s) as chunks:
                chunk = None
                async for chunk in chunks:
                    self.queue.put_nowait((index, chunk))
            if chunk is None or not chunk.finished:
                raise BatonError(ErrorCode.INTERNAL, f"the stream of {request.request_id} ended before its last chunk")
        except BatonError as exc:
            self.queue.put_nowait((index, exc))


def _unauthorized(message: str) -> api.HttpError:
    return api.HttpError(401, message, code="invalid_api_key")


def _error(exc: api.HttpError) -> web.Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    if exc.status >= 500:
        log.warning("%d %s", exc.status, exc.message)
    return web.json_response(exc.body(), status=exc.status, headers=headers)


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


async def start(bus: Bus, cfg: Config, port: int | None = None) -> tuple[web.AppRunner, Frontend, int]:
    """Serve on cfg.http.host:port (`port` overrides; 0 picks a free one); returns the bound port."""
    frontend = Frontend(bus, cfg)
    runner = web.AppRunner(frontend.app(), handler_cancellation=True, access_log=None, shutdown_timeout=10.0)
    await runner.setup()
    site = web.TCPSite(runner, cfg.http.host, cfg.http.port if port is None else port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the real port when 0 was asked
    return runner, frontend, bound


async def serve(stop: asyncio.Event, bus: Bus, cfg: Config) -> None:
    runner, frontend, port = await start(bus, cfg)
    keys = len(frontend.api_keys)
    log.info("OpenAI-compatible API on http://%s:%d/v1 (model %s; %s)", cfg.http.host, port, frontend.model,
             f"{keys} API key{'s' if keys > 1 else ''} accepted" if keys else "no API key needed")
    await stop.wait()
    await runner.cleanup()  # stop accepting, let running requests finish (up to shutdown_timeout)
    await frontend.wait_background()
    await bus.close()
