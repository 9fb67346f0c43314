"""The aggregated baseline's scheduler: prefill and decode in one process, on one KVStore.

Continuous batching on one engine thread. Each turn of the loop:

    reap    finished or aborted requests: free their KV, end their token streams
    admit   waiting requests (FIFO; at most `prefill_tokens` prompt tokens per turn, and only
            while fewer than `max_batch` run) are prefilled in one batched, chunked forward:
            target (+ the MTP layer over the prompt's window), first token
    step    decode steps over every running request (draft -> verify -> accept), back to back on
            the engine thread until one of them ends or a request arrives or is cancelled

It is the same engine code as the prefill and decode services (`ModelRunner`), with the handoff
done as `LocalEngine` does it: by sharing the store, with no NATS hop and no NIXL transfer.
Because prefill runs between decode steps, a long prompt stalls every running stream for the
time of its prefill; that stall is what disaggregation removes, and what `bench/sweep.py`
measures.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable

import torch

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import Logprobs
from baton.shared import wake_latency
from baton.shared.config import WorkerSection
from baton.shared.engine.runner import ModelRunner, PrefillOutput
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import DECODE_SEED_SALT, Sequence
from baton.shared.kv.allocator import KVError, OutOfCapacity
from baton.shared.kv.budget import reservation
from baton.shared.kv.store import KVStore
from baton.shared.model.model import BatonLM
from baton.shared.metrics import Stamps

from ..router.public import Outcome
from ..worker import EngineThread, speculation

log = logging.getLogger("baton.aggregated")
PREFILL_TOKENS = 4096  # prompt tokens prefilled per turn (at least one prompt): bounds a decode stall


class Job:
    """One request in the engine, a `RequestFlow` (the router's Flow is the other one): its tokens
    arrive on `tokens()`; `cancel()` stops it at the next step boundary (finish_reason "abort")."""

    def __init__(self, seq: Sequence, decode_gen: torch.Generator | None, wake: Callable[[], None]) -> None:
        self.seq, self.decode_gen, self._wake = seq, decode_gen, wake  # wake(): the engine's batch changed
        self.outcome = Outcome()
        self.served_by = "aggregated"  # for the request log (a Flow names its worker pair)
        self.prefill_done = None  # no separate prefill step to time
        self.prompt_logprobs = None  # set at prefill when asked for, before the first tokens
        self.sent = 0  # tokens pushed so far
        self.at = Stamps()  # the router adds "received"; the engine has no hops to stamp
        self.migrated_after = 0  # one process: a request never moves to other workers
        self.abort = ""  # set by cancel(); the loop reaps the job at the next turn
        self.done = False
        self._events: asyncio.Queue = asyncio.Queue()

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.done and not self.abort:
            self.abort = reason
            self._wake()

    def stop(self) -> None:
        """A stop string matched: end at the next step; the counts come with the end."""
        self.cancel("stop string")

    async def tokens(self) -> AsyncIterator[tuple[list[int], Logprobs | None]]:
        """(token ids, their logprobs if asked for) as they are generated; afterwards `outcome`
        says how the request ended.
        Closing it early (the client went away) cancels the job."""
        try:
            while True:
                kind, value = await self._events.get()
                if kind == "tokens":
                    yield value
                elif kind == "end":
                    self.outcome.finish_reason = value
                    self.outcome.spec = self.seq.stats.as_dict()
                    return
                else:
                    self.outcome.error = value
                    return
        finally:
            self.cancel("the client went away")  # a no-op once the job ended

    # --- called by the engine loop ------------------------------------------------------------
    def _push(self, tokens: list[int]) -> None:
        if tokens:
            reported = self.seq.output_logprobs
            logprobs = None if reported is None else reported[self.sent:self.sent + len(tokens)]
            self.sent += len(tokens)
            self._events.put_nowait(("tokens", (tokens, logprobs)))

    def _end(self, finish_reason: str) -> None:
        if not self.done:
            self.done = True
            self._events.put_nowait(("end", finish_reason))

    def _fail(self, error: BatonError) -> None:
        if not self.done:
            self.done = True
            self._events.put_nowait(("error", error))


class AggregatedEngine:
    """Owns the model runner, the store and the engine thread; `submit` a request, read its job."""

    def __init__(self, model: BatonLM, worker: WorkerSection = WorkerSection(),
                 prefill_tokens: int = PREFILL_TOKENS) -> None:
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be at least 1, got {prefill_tokens}")
        self.worker, self.spec, self.prefill_tokens = worker, speculation(worker), prefill_tokens
        self.store = KVStore.for_worker(model.cfg, worker, draft_enabled=self.spec.enabled, dtype=model.dtype,
                                        device=model.device)
        self.runner = ModelRunner(model, self.store, self.spec, worker.prefill_chunk)
        self.thread = EngineThread()
        self.wake_latency = wake_latency.hold(worker.cpu_wake_latency_us)  # held until close()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.steps = 0  # decode steps run (for tests and logs)
        self.wake = asyncio.Event()
        self._changed = threading.Event()  # ends the engine thread's run of steps (`ModelRunner.run`)
        self._loop_task: asyncio.Task | None = None
        self._closed = False

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="aggregated-engine")

    async def close(self, reason: str = "the service is shutting down") -> None:
        """Fail what is still in flight with `unavailable`, stop the loop, free everything."""
        self._closed = True
        self._changed.set()  # a run of steps in flight returns after its step
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        jobs = list(self.waiting) + self.running
        self.waiting.clear()
        self.running.clear()
        await self.thread.call(self._free, [j.request_id for j in jobs])
        for job in jobs:
            job._fail(BatonError(ErrorCode.UNAVAILABLE, reason))
        self.thread.close()
        if self.wake_latency is not None:
            self.wake_latency.close()

    async def submit(self, request_id: str, prompt: list[int], max_tokens: int, params: SamplingParams,
                     stop_token_ids: list[int] = (), draft_tokens: int | None = None, min_tokens: int = 0,
                     logprobs: int | None = None, prompt_logprobs: int | None = None) -> Job:
        """Reserve KV for the request (busy when full) and queue it for prefill; `draft_tokens`
        caps speculation for this request, `min_tokens` delays its stop tokens, `logprobs` and
        `prompt_logprobs` ask for the tokens' logprobs (see Sequence).

        Seeds as in the disaggregated system: the first token is drawn with `params.seed`
        (prefill's stream), later ones with the seed salted as decode salts it, so a seeded
        sampled request gives the same tokens either way."""
        if self._closed:
            raise BatonError(ErrorCode.UNAVAILABLE, "the service is shutting down")
        seq = Sequence(request_id, list(prompt), max_tokens, params, frozenset(stop_token_ids),
                       draft_tokens=draft_tokens, min_tokens=min_tokens, logprobs=logprobs,
                       prompt_logprobs=prompt_logprobs, device=self.store.device)
        decode_gen = None
        if not params.greedy:
            decode_gen = seq.gen if params.seed is None else \
                torch.Generator(device=self.store.device).manual_seed((params.seed ^ DECODE_SEED_SALT) % 2**64)
        positions = reservation(len(seq.prompt), max_tokens, self.spec.draft_tokens)
        self._changed.set()  # the run in flight returns, so that the engine thread takes the allocation
        try:
            await self.thread.call(self.store.allocate, request_id, positions)
        except OutOfCapacity as exc:
            raise BatonError(ErrorCode.BUSY, f"aggregated: {exc}") from None
        except KVError as exc:
            raise BatonError(ErrorCode.BAD_REQUEST, f"aggregated: {exc}") from None
        job = Job(seq, decode_gen, self._batch_changed)
        self.waiting.append(job)
        self._batch_changed()
        return job

    def _batch_changed(self) -> None:
        self._changed.set()
        self.wake.set()

    # --- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._reap()
            if batch := self._admissible():
                await self._admit(batch)
            if active := [j for j in self.running if not (j.abort or j.seq.finish_reason)]:
                await self._step(active)
            elif not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()

    async def _reap(self) -> None:
        ended = [j for j in self.running if j.abort or j.seq.finish_reason] + [j for j in self.waiting if j.abort]
        if not ended:
            return
        self.running = [j for j in self.running if j not in ended]
        self.waiting = deque(j for j in self.waiting if j not in ended)
        await self.thread.call(self._free, [j.request_id for j in ended])
        for job in ended:
            job._end(job.seq.finish_reason or "abort")

    def _admissible(self) -> list[Job]:
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.worker.max_batch:
            n = len(self.waiting[0].seq.prompt)
            if batch and tokens + n > self.prefill_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    async def _admit(self, batch: list[Job]) -> None:
        loop = asyncio.get_running_loop()

        def sampled(outputs: list[PrefillOutput]) -> None:  # engine thread: the first tokens, ahead of the draft windows
            for job, out in zip(batch, outputs):
                if job.seq.logprobs is None and job.seq.prompt_logprobs is None:  # else they come with them
                    loop.call_soon_threadsafe(job._push, [out.first_token])
        try:
            await self.thread.call(self._prefill, batch, sampled)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the engine goes on
            log.exception("prefill of %d requests failed", len(batch))
            await self._fail(batch, exc)
            return
        for job in batch:
            job._push(job.seq.output[job.sent:])
        self.running += batch

    async def _step(self, jobs: list[Job]) -> None:
        """Steps over `jobs` on the engine thread until the batch must change; each step's tokens
        are pushed to the jobs as soon as it is done (before the run returns)."""
        loop = asyncio.get_running_loop()

        def pushed(emitted: list[list[int]]) -> None:  # on the loop, in step order
            self.steps += 1
            for job, tokens in zip(jobs, emitted):
                if not job.abort:
                    job._push(tokens)
        self._changed.clear()
        try:
            await self.thread.call(self.runner.run, [j.seq for j in jobs], self._changed,
                                   lambda emitted, _seconds: loop.call_soon_threadsafe(pushed, emitted))
        except Exception as exc:  # noqa: BLE001
            log.exception("decode steps over %d requests failed", len(jobs))
            self.running = [j for j in self.running if j not in jobs]
            await self._fail(jobs, exc)

    async def _fail(self, jobs: list[Job], exc: Exception) -> None:
        await self.thread.call(self._free, [j.request_id for j in jobs])
        for job in jobs:
            job._fail(BatonError(ErrorCode.INTERNAL, f"request {job.request_id} failed: {type(exc).__name__}: {exc}"))

    # --- engine thread ------------------------------------------------------------------------
    def _prefill(self, batch: list[Job], sampled: Callable[[list[PrefillOutput]], None]) -> None:
        """Prefill the prompts and start decoding them, exactly as prefill + decode would (the
        first tokens to `sampled` as soon as they are drawn, as prefill streams them)."""
        state = self.spec.draft_state if self.spec.enabled else "cold"
        outputs = self.runner.prefill_and_start([j.seq for j in batch], state, on_sampled=sampled)
        for job, out in zip(batch, outputs):
            job.prompt_logprobs = out.prompt_logprobs
            job.seq.gen = job.decode_gen  # decode draws from its own stream (see submit)

    def _free(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            try:
                self.store.free(rid)
            except KVError:
                pass  # already freed
