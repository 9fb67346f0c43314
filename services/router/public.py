"""The public API's request handling, over any source of request flows: `baton.v1.generate` and
`baton.v1.cancel` (the routers' queue group), validation, tokenization, text deltas, stop strings,
stream chunks, summaries and cancels. The router drives each request through the cluster (a
`Flow`); the aggregated baseline through its in-process engine (a `Job`). Both are a
`RequestFlow`, the one surface this module reads (tests/test_router_public.py checks both).
Never imports torch: the tokenizer is the `tokenizers` library."""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol, runtime_checkable

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode, bad_request
from baton.proto.internal import PrefillDone, SamplingParams
from baton.proto.public import (CancelReply, CancelRequest, GenerateReply, GenerateRequest, Logprobs, SpecStats,
                                StreamChunk, Timing, Usage, check_logprob_size)
from baton.shared.bus import Bus
from baton.shared.bus.senders import request_sender
from baton.shared.config import RouterSection
from baton.shared.metrics import ServiceMetrics, Stamps, log_request
from baton.shared.model.config import ModelConfig
from baton.shared.model.tokenizer import TextTokenizer

from .text import TextStream
from .tokenize import FairTokenizer

EARLY_CANCEL_KEEP_S = 30.0  # how long a cancel for a not-yet-seen request id is remembered


@dataclass
class Outcome:
    """How a request ended: `finish_reason` or an error, with its speculation counts."""
    finish_reason: str | None = None
    error: BatonError | None = None
    spec: dict = field(default_factory=lambda: {"verify_steps": 0, "drafted": 0, "accepted": 0})


@runtime_checkable
class RequestFlow(Protocol):
    """One request in flight, as `PublicAPI` drives it: its tokens as they come, then `outcome`."""
    outcome: Outcome
    served_by: str  # the workers that served it, for the request log
    prefill_done: PrefillDone | None  # prefill's own timing, where there is a separate prefill
    prompt_logprobs: Logprobs | None  # set before the first tokens are yielded, when asked for
    at: Stamps  # stage times, for the request log ("received" is stamped here)
    migrated_after: int  # tokens sent before the request moved to other workers (0: never)

    def tokens(self) -> AsyncIterator[tuple[list[int], Logprobs | None]]: ...

    def cancel(self, reason: str = "cancelled") -> None: ...

    def stop(self) -> None: ...  # a stop string matched: end at the next step


OpenFlow = Callable[[str, list[int], int, SamplingParams], Awaitable[RequestFlow]]


class PublicAPI:
    def __init__(self, bus: Bus, model: ModelConfig, tokenizer: TextTokenizer, config: RouterSection,
                 open_flow: OpenFlow, metrics: ServiceMetrics) -> None:
        """`open_flow(request_id, token_ids, max_tokens, sampling)`: what drives one request."""
        self.bus, self.model, self.tokenizer, self.config = bus, model, tokenizer, config
        self.open_flow, self.metrics = open_flow, metrics
        self.flows: dict[str, RequestFlow] = {}
        self._early_cancels: dict[str, float] = {}  # request id -> until when a cancel that beat its request counts
        self._tokenize = FairTokenizer(tokenizer.encode)  # off the event loop, a fair share per client

    async def serve(self) -> None:
        await self.bus.serve(subjects.GENERATE, GenerateRequest, self.generate, queue=subjects.ROUTER_QUEUE,
                             max_in_flight=self.config.max_in_flight)
        await self.bus.serve(subjects.CANCEL, CancelRequest, self.cancel, queue=subjects.ROUTER_QUEUE)
        await self.bus.serve(subjects.ROUTER_CANCEL, CancelRequest, self.cancel_owned)

    def close(self, reason: str) -> None:
        """Cancel every request in flight and stop the tokenizer threads."""
        for flow in self.flows.values():
            flow.cancel(reason)
        self._tokenize.close()

    # --- handlers -------------------------------------------------------------------------
    def generate(self, req: GenerateRequest):
        """A streaming request gets an async generator of chunks, else a coroutine of one reply."""
        return self._stream(req) if req.stream else self._unary(req)

    async def cancel(self, req: CancelRequest) -> CancelReply:
        """Any router may receive the cancel; the one driving the request acts on it. A cancel
        that arrives before its request (they race on the wire) is remembered for a while, and the
        request is aborted as soon as it starts."""
        if self.cancel_owned_now(req.request_id):
            return CancelReply(request_id=req.request_id, cancelled=True)
        self._remember_cancel(req.request_id)
        try:
            return await self.bus.request(subjects.ROUTER_CANCEL, req, CancelReply, timeout=1.0)
        except BatonError:
            return CancelReply(request_id=req.request_id, cancelled=False)

    async def cancel_owned(self, req: CancelRequest) -> CancelReply | None:
        if self.cancel_owned_now(req.request_id):
            return CancelReply(request_id=req.request_id, cancelled=True)
        self._remember_cancel(req.request_id)
        return None

    def _remember_cancel(self, request_id: str, keep_s: float = EARLY_CANCEL_KEEP_S) -> None:
        now = time.monotonic()
        if len(self._early_cancels) > 10_000:
            self._early_cancels = {r: t for r, t in self._early_cancels.items() if t > now}
        self._early_cancels[request_id] = now + keep_s

    def cancel_owned_now(self, request_id: str) -> bool:
        flow = self.flows.get(request_id)
        if flow is not None:
            flow.cancel("cancelled by the client")
        return flow is not None

    # --- generation -----------------------------------------------------------------------
    async def _prepare(self, req: GenerateRequest) -> tuple[GenerateRequest, str, list[int]]:
        if req.prompt is not None:
            self._check_context(self.tokenizer.min_tokens(req.prompt), req.max_tokens, "at least ")
            ids = await self._tokenize.encode(request_sender.get(), req.prompt)
            if not ids:
                raise bad_request("field 'prompt': encodes to no tokens")
        else:
            ids = list(req.token_ids)
        vocab = self.model.vocab_size
        bad = next((t for t in ids + list(req.stop_token_ids) if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        self._check_context(len(ids), req.max_tokens)
        check_logprob_size(req, len(ids))
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self.flows:
            raise bad_request(f"request id {request_id} is already in flight")
        return req, request_id, ids

    def _check_context(self, prompt_tokens: int, max_tokens: int, bound: str = "") -> None:
        """A prompt that alone fills the model's context is `too_large` (HTTP 413); one that fits
        but leaves too little room for max_tokens is `bad_request` (400). With `bound` "at least ",
        the count is the tokenizer's cheap lower bound: a prompt far too long is refused before
        tokenizing."""
        context = self.model.max_position_embeddings
        if prompt_tokens >= context:
            raise BatonError(ErrorCode.TOO_LARGE, f"prompt ({bound}{prompt_tokens} tokens) does not fit the model's "
                             f"context of {context} tokens")
        if prompt_tokens + max_tokens > context:
            raise bad_request(f"prompt ({bound}{prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                              f"context of {context} tokens")

    async def _run(self, req: GenerateRequest, request_id: str, ids: list[int]) -> AsyncIterator[dict]:
        """Yields StreamChunk fields: deltas (token_ids, text, logprobs; the first one with tokens
        also the prompt's logprobs, when asked for), then the summary (finished=True ...)."""
        started = time.monotonic()
        received = round(started * 1000, 3)
        stop_ids = list(req.stop_token_ids)
        if self.tokenizer.eos_token_id is not None and not req.ignore_eos:
            stop_ids.append(self.tokenizer.eos_token_id)
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                  stop_token_ids=stop_ids, draft_tokens=req.draft_tokens, min_tokens=req.min_tokens,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty,
                                  logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
        flow = await self.open_flow(request_id, ids, req.max_tokens, sampling)
        flow.at["received"] = received
        text, n_tokens, ttft = TextStream(self.tokenizer, req.stop, frozenset(stop_ids), req.min_tokens), 0, None
        self.flows[request_id] = flow
        if self._early_cancels.pop(request_id, 0.0) > time.monotonic():
            flow.cancel("cancelled before it started")
        self.metrics.in_flight.inc()
        last_chunk, completed = None, False
        try:
            async with aclosing(flow.tokens()) as tokens:  # closing it releases what the flow holds
                async for new_ids, logprobs in tokens:
                    now = time.monotonic()
                    if last_chunk is not None:
                        self.metrics.itl.observe(now - last_chunk)
                    last_chunk = now
                    ids_out, delta = text.add(new_ids)  # all of new_ids, or none once a stop string matched
                    if ids_out or delta:
                        yield self._delta(ids_out, delta, logprobs if ids_out else None,
                                          flow if ttft is None else None, ids)
                    ttft = ttft if ttft is not None else (now - started) * 1000
                    n_tokens += len(ids_out)
                    if text.stopped and ids_out:  # the chunk that matched: later ones bring no tokens
                        flow.stop()
            completed = True
        finally:
            self.flows.pop(request_id, None)
            self.metrics.in_flight.dec()
            if not completed:  # the client went away mid-stream (or the router is stopping)
                self.metrics.requests.labels("disconnected").inc()
                log_request("router", request_id, outcome="disconnected", completion_tokens=n_tokens,
                            workers=flow.served_by)
        outcome = flow.outcome
        total = (time.monotonic() - started) * 1000
        reason = "stop" if text.stopped else outcome.finish_reason
        result = outcome.error.code.value if outcome.error is not None else reason
        self.metrics.requests.labels(result).inc()
        self.metrics.e2e.observe(total / 1000)
        if ttft is not None:
            self.metrics.ttft.observe(ttft / 1000)
        done = flow.prefill_done
        log_request("router", request_id, outcome=result, prompt_tokens=len(ids), completion_tokens=n_tokens,
                    ttft_ms=ttft, total_ms=round(total, 2), workers=flow.served_by, spec=outcome.spec,
                    prefill_ms=done.prefill_ms if done else None, transfer_ms=done.transfer_ms if done else None,
                    transfer_bytes=done.transfer_bytes if done else None,
                    cached_tokens=done.cached_tokens if done else None, at=flow.at,
                    migrated_after=flow.migrated_after or None)
        if outcome.error is not None:
            raise outcome.error
        if rest := text.finish():
            yield dict(token_ids=[], text=rest)
        yield dict(finished=True, finish_reason=reason, usage=Usage(prompt_tokens=len(ids), completion_tokens=n_tokens,
                                                                  cached_tokens=done.cached_tokens if done else 0),
                   spec=SpecStats(**outcome.spec), timing=Timing(ttft_ms=ttft if ttft is not None else total, total_ms=total))

    @staticmethod
    def _delta(ids: list[int], text: str, logprobs: Logprobs | None, first_of: RequestFlow | None,
               prompt: list[int]) -> dict:
        """One delta's fields; `first_of`: the flow whose first delta this is (it carries the
        prompt's logprobs, with the prompt's token ids, when they were asked for)."""
        delta = dict(token_ids=ids, text=text)
        if logprobs is not None:
            delta["logprobs"] = logprobs
        if first_of is not None and first_of.prompt_logprobs is not None:
            delta.update(prompt_logprobs=first_of.prompt_logprobs, prompt_token_ids=prompt)
        return delta

    async def _unary(self, req: GenerateRequest) -> GenerateReply:
        req, request_id, ids = await self._prepare(req)
        tokens, pieces, logprobs, extra = [], [], [], {}
        async for fields in self._run(req, request_id, ids):
            if fields.pop("finished", False):
                if logprobs:
                    extra["logprobs"] = Logprobs.joined(logprobs)
                return GenerateReply(request_id=request_id, token_ids=tokens, text="".join(pieces), **fields, **extra)
            tokens += fields.pop("token_ids")
            pieces.append(fields.pop("text"))
            if "logprobs" in fields:
                logprobs.append(fields.pop("logprobs"))
            extra.update(fields)  # the prompt's logprobs and token ids, from the first delta
        raise BatonError(ErrorCode.INTERNAL, f"request {request_id} ended without a summary")

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        req, request_id, ids = await self._prepare(req)
        async for fields in self._run(req, request_id, ids):
            yield StreamChunk(request_id=request_id, **{"token_ids": [], "text": "", **fields})
