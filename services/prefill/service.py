"""prefill: run prompts through the target (and the MTP layer over the prompt's window when the
draft state travels), WRITE the state into decode's reserved slots over NIXL, reply when done.

The router dispatches a prompt and reserves decode slots at the same time; where the state goes
(a PrefillTarget) arrives while the prompt computes, so the reservation costs no latency.
Dispatches queue up; a batcher runs the queued prompts in chunked, batched forwards on the engine
thread (a batch takes up to `prefill_batch_tokens` prompt tokens, so a burst reaches decode in
parts), stages each request whose target is known (aux row, descriptors), and starts one WRITE per
request; a request whose target is still to come waits for it (or for its release, or
the transfer deadline) holding its computed state. A request's own slots are freed only once its
WRITE is finished or failed (nothing in flight), or it was released. A `cache_only` dispatch (a
prompt its decode worker computes itself) is computed and kept in the prefix cache, nothing else.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import torch

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (Ack, PrefillDispatch, PrefillDone, PrefillTarget, PrefixEvents, PrefixQuery,
                                  ReleaseRequest, TokenChunk, WorkerLoad, WriteStarting)
from baton.shared.bus import Bus
from baton.shared.engine.runner import PrefillOutput
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence
from baton.shared.kv.allocator import KVError
from baton.shared.kv.aux import pack_aux
from baton.shared.kv.prefix_cache import Hit, PrefixCache
from baton.shared.transfer.regions import Descriptor

from baton.shared.metrics import log_request

from baton.shared.transfer.notices import request_tag
from .jobs import Job, Jobs, take_batch
from ..worker import FIRST_TOKENS_WAIT_S, Worker, WorkerConfig, publish_changes, snapshot_message, speculation

log = logging.getLogger("baton.prefill")
Staged = list[Descriptor] | BatonError | None  # a computed request's WRITE list, why it has none,
# or None: its target is still to come


class PrefillWorker(Worker):
    def __init__(self, bus: Bus, config: WorkerConfig) -> None:
        spec = speculation(config.worker)
        # the store holds draft windows only to send them (draft state transfer): decode makes the others
        self.send_draft = spec.enabled and spec.draft_state == "transfer"
        super().__init__(bus, config, draft_windows=self.send_draft, copy_threads=config.worker.transfer_threads)
        self.cache = (PrefixCache(self.store, config.worker.prefix_cache, self.model.cfg.hidden_size)
                      if config.worker.prefix_cache else None)
        self._evictions_counted = 0  # of cache.evictions, those in the metrics already
        self.capacity = self.store.free_capacity()  # what the loop reports: the engine thread's snapshot
        self.queue: deque[Job] = deque()  # dispatched, not yet batched (in order)
        self._queued = asyncio.Event()  # set when the queue gets a job
        self.jobs = Jobs()
        self.queued_tokens = 0
        self.requests_total = 0
        self.draining = False  # stopping: new prompts are refused, held ones finish
        self._tasks: set[asyncio.Task] = set()
        self._batching: asyncio.Task | None = None

    def load(self) -> WorkerLoad:
        """Loop: the heartbeat's load, from the capacity the engine thread last published (only
        that thread touches the store)."""
        free = self.capacity
        self.metrics.free_pages.set(free.pages)
        self.metrics.free_slots.set(free.slots)
        self.metrics.queue.set(len(self.queue))
        return WorkerLoad(free_pages=free.pages, free_slots=free.slots, active_requests=len(self.jobs),
                          queued_prompt_tokens=self.queued_tokens, requests_total=self.requests_total,
                          draining=self.draining)

    async def _serve(self) -> None:
        worker_id = self.config.worker.id
        await self.bus.serve(subjects.prefill_dispatch(worker_id), PrefillDispatch, self.dispatch)
        await self.bus.serve(subjects.prefill_target(worker_id), PrefillTarget, self.target)
        await self.bus.serve(subjects.prefill_release(worker_id), ReleaseRequest, self.release)
        await self.bus.serve(subjects.prefill_prefixes(worker_id), PrefixQuery, self.prefixes)
        self._batching = asyncio.create_task(self._batcher(), name="prefill-batcher")

    async def _leave(self) -> None:
        log.info("stopping: no new prompts; finishing %d in flight", len(self.jobs))
        self.draining = True
        await self.membership.beat()  # routers stop picking this worker
        await self._drain(self.config.worker.transfer_deadline_s)
        await self.membership.stop()  # "left": decode now releases what it still holds for us
        await self.bus.close(grace_s=1.0)
        self._batching.cancel()

    async def _drain(self, timeout_s: float) -> None:
        """Finish the requests held (compute, wait for a target, WRITE) for up to `timeout_s`;
        then end those still without a target, and wait for every WRITE in flight to end, however
        long. Only then may this worker leave: decode releases a departed sender's slots at once,
        and a WRITE still in flight would land in them after reuse (sglang #27372)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._holding() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._holding():
            waiting = self.jobs.without_target()
            log.warning("stopping: %d requests still held after %g s; ending the %d without a target",
                        len(self.jobs), timeout_s, len(waiting))
            for job in waiting:
                self.jobs.settle(job.request_id, BatonError(
                    ErrorCode.UNAVAILABLE, f"request {job.request_id}: prefill worker {self.config.worker.id} stopped"))
        next_report = loop.time() + 1.0  # those just ended go at once; WRITEs in flight may not
        while self._holding():
            if loop.time() >= next_report:
                log.warning("stopping: waiting for %d requests' WRITEs to end before deregistering (a WRITE "
                            "into a decode that stopped progressing waits for it)", len(self.jobs))
                next_report = loop.time() + 10.0
            await asyncio.sleep(0.05)

    def _holding(self) -> bool:
        """A request is queued, computing, waiting for its target, or being written."""
        return bool(self.jobs) or bool(self._tasks)

    async def _peer_left(self, worker_id: str) -> None:
        await self.agent.remove_peer(worker_id)  # our writes to it stop; their requests fail

    async def dispatch(self, req: PrefillDispatch) -> PrefillDone:
        if self.draining:
            raise BatonError(ErrorCode.UNAVAILABLE, f"prefill worker {self.config.worker.id} is stopping; "
                             f"request {req.request_id} goes elsewhere")
        if req.request_id in self.jobs:
            raise BatonError(ErrorCode.BAD_REQUEST, f"request {req.request_id} is already dispatched here")
        vocab, context = self.model.cfg.vocab_size, self.model.cfg.max_position_embeddings
        if not req.token_ids or max(req.token_ids) >= vocab:
            raise BatonError(ErrorCode.BAD_REQUEST, f"request {req.request_id}: a prompt needs 1+ token ids "
                             f"in 0..{vocab - 1}")
        if len(req.token_ids) >= context:  # the router checks too; a dispatch from elsewhere must not hold the engine
            raise BatonError(ErrorCode.BAD_REQUEST, f"request {req.request_id}: a prompt of {len(req.token_ids)} "
                             f"tokens leaves no room in the model's context of {context}")
        if req.cache_only and self.cache is None:
            return PrefillDone(request_id=req.request_id, first_token_id=0, transfer_bytes=0, prefill_ms=0.0,
                               transfer_ms=0.0)  # no cache to keep it in
        job = Job(req, asyncio.get_running_loop().create_future())
        job.at.mark("received")
        self.jobs.add(job)
        self.queued_tokens += len(req.token_ids)
        if not req.cache_only:  # work, not a request: decode serves that one
            self.requests_total += 1
        self.queue.append(job)
        self._queued.set()
        try:
            return await job.done
        finally:
            self.jobs.remove(job)

    async def target(self, msg: PrefillTarget) -> Ack:
        self.jobs.settle(msg.request_id, msg)
        return Ack()

    async def release(self, msg: ReleaseRequest) -> Ack:
        self.jobs.settle(msg.request_id, BatonError(ErrorCode.UNAVAILABLE, f"request {msg.request_id} was "
                                                    f"released before its state had a target: {msg.reason}"))
        return Ack()

    async def prefixes(self, _query: PrefixQuery) -> PrefixEvents:
        """Everything the prefix cache holds, for a router that starts or missed a change."""
        seq, held = await self.engine.call(self.cache.snapshot) if self.cache else (0, [])
        return snapshot_message(self.membership.registration, self.store.page_size, seq, held)

    async def _publish_prefixes(self) -> None:
        """The cache's changes since the last batch, if any, to every router (in seq order: the
        batcher alone publishes, one batch at a time)."""
        if self.cache is not None:
            await publish_changes(self.bus, self.membership.registration, self.store.page_size,
                                  await self.engine.call(self.cache.take_changes))

    async def _batcher(self) -> None:
        while True:
            while not self.queue:
                self._queued.clear()
                await self._queued.wait()
            jobs = take_batch(self.queue, self.config.worker.max_batch, self.config.worker.prefill_batch_tokens)
            self.queued_tokens -= sum(len(j.dispatch.token_ids) for j in jobs)
            started = time.monotonic()
            for job in jobs:
                job.at.mark("batched")
            try:
                outputs = await self.engine.call(self._compute, jobs)
            except Exception as exc:  # noqa: BLE001 - every job gets the error, the batcher goes on
                log.exception("prefill batch failed")
                await self.engine.call(self._free_batch, jobs)
                for job in jobs:
                    _fail(job, BatonError(ErrorCode.INTERNAL, f"prefill failed: {exc}"))
                continue
            prefill_ms = (time.monotonic() - started) * 1000
            self.metrics.prefill_seconds.observe(prefill_ms / 1000)
            for job, seq, out, staged, _ in outputs:
                self._own(self._deliver(job, seq, out, staged, prefill_ms))
            if self.cache is not None:  # queued behind the batch, ahead of any request's free
                try:
                    await self.engine.call(self._cache_prompts, outputs)
                except Exception:  # noqa: BLE001 - a cache that missed a prompt fails no request
                    log.exception("prefix cache: a batch's prompts were not kept")
            await self._publish_prefixes()

    def _compute(self, jobs: list[Job]) -> list[tuple[Job, Sequence, PrefillOutput, Staged, Hit | None]]:
        """Engine thread: allocate, prefill the batch; stage the requests whose target is known.
        Their prompts go into the prefix cache after (`_cache_prompts`), while the WRITEs are on the wire."""
        seqs, hits = [], []
        for job in jobs:
            job.at.mark("computing")
            d = job.dispatch
            if isinstance(job.outcome, BatonError):  # released while queued
                job.done.get_loop().call_soon_threadsafe(_fail, job, job.outcome)
                continue
            try:
                hits.append(self._allocate(d))
            except KVError as exc:
                job.done.get_loop().call_soon_threadsafe(_fail, job, BatonError(ErrorCode.BUSY, str(exc)))
                continue
            params = SamplingParams.of(d.sampling, d.sampling.seed)
            seqs.append((job, Sequence(d.request_id, list(d.token_ids), 1, params,
                                       prompt_logprobs=d.sampling.prompt_logprobs,
                                       output_in_prompt=d.sampling.output_in_prompt,
                                       device=self.store.device)))
        starts = [h.start if h else 0 for h in hits]
        outputs = self.runner.prefill([s for _, s in seqs], starts, self._chunk_boundary(seqs, hits)) if seqs else []
        self._stream_first_tokens([job for job, _ in seqs], outputs)
        for (job, seq), out, hit in zip(seqs, outputs, hits):
            self._join_hit(job, seq, out, hit)
        targets = [job.target for job, _ in seqs]  # set on the loop thread; read once here
        self._fill_draft_windows([(seq, out, target) for (_, seq), out, target in zip(seqs, outputs, targets)
                                  if target])
        results = []
        for (job, seq), out, target, hit in zip(seqs, outputs, targets, hits):
            results.append((job, seq, out, self._try_stage(job, target, seq, out) if target else None, hit))
            job.at.mark("computed")
        self.capacity = self.store.free_capacity()
        return results

    def _stream_first_tokens(self, jobs: list[Job], outputs: list[PrefillOutput]) -> None:
        """Engine thread: each first token the router asked for goes to the loop at once, ahead of
        the draft windows, the aux rows and the WRITE (decode sends it again once the state landed).
        The engine thread waits (at most FIRST_TOKENS_WAIT_S) until the loop has written them: when
        it computed on, it held the core and the GIL the loop needed to send them (stop 57: sampled
        -> published 0.54 -> 0.15 ms p50, the control plane 1.7 -> 1.3 ms)."""
        sending = []
        for job, out in zip(jobs, outputs):
            job.at.mark("sampled")
            if job.dispatch.first_token_to is not None:
                sending.append((job, out.first_token))
        if sending:
            written = threading.Event()
            sending[0][0].done.get_loop().call_soon_threadsafe(self._own, self._send_first_tokens(sending, written))
            written.wait(FIRST_TOKENS_WAIT_S)

    def _own(self, coro) -> None:
        """Loop: run `coro` as a task of this worker's (drained and awaited before it leaves)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_first_tokens(self, sending: list[tuple[Job, int]], written: threading.Event) -> None:
        """Loop: publish each (job, first token) and write them to the socket before the engine
        thread goes on."""
        try:
            for job, token in sending:
                try:
                    await self.bus.publish(job.dispatch.first_token_to, TokenChunk(
                        request_id=job.request_id, seq=0, token_ids=[token], source="prefill"))
                    job.at.mark("first_token")
                except BatonError as exc:  # only the head start is lost: decode streams the token too
                    log.warning("request %s: first token not sent ahead of decode: %s", job.request_id, exc)
            self.bus.write_pending()
        finally:
            written.set()

    def _allocate(self, d: PrefillDispatch) -> Hit | None:
        """Engine thread: the request's KV, from the longest cached prompt end it extends (not
        with prompt logprobs, which need every position computed)."""
        if self.cache is None:
            self.store.allocate(d.request_id, len(d.token_ids))
            return None
        return self.cache.allocate(d.request_id, list(d.token_ids), use=d.sampling.prompt_logprobs is None)

    def _chunk_boundary(self, seqs: list[tuple[Job, Sequence]], hits: list[Hit | None]):
        """Engine thread: cache the end of each prefill chunk inside a prompt (a later prompt that
        shares only its beginning starts there)."""
        if self.cache is None:
            return None

        def on_chunk(i: int, end: int, hidden: torch.Tensor) -> None:
            seq, hit, first = seqs[i][1], hits[i], 0
            if hit is not None:
                hidden, first = hit.joined(self.cache, hidden)
            self.cache.insert(seq.request_id, seq.prompt[:end], hidden, first, boundary=True)
        return on_chunk

    def _join_hit(self, job: Job, seq: Sequence, out: PrefillOutput, hit: Hit | None) -> None:
        """Engine thread: a hit's cached hidden rows join the computed ones (the draft window and
        the aux row may reach below the computed part)."""
        job.cached_tokens = hit.start if hit else 0
        self.metrics.computed_tokens.inc(len(seq.prompt) - job.cached_tokens)
        if hit is not None:
            out.hidden, out.hidden_start = hit.joined(self.cache, out.hidden)
            self.metrics.cached_tokens.inc(hit.start)

    def _cache_prompts(self, outputs: list[tuple[Job, Sequence, PrefillOutput, Staged, Hit | None]]) -> None:
        """Engine thread, after `_compute` and before any of its requests is freed (engine calls run
        in order; a free is queued only once a WRITE ended): each prompt's end into the prefix
        cache. Off the hand-off's path: the insert and its evictions took ~0.9 ms a request."""
        for _, seq, out, _, hit in outputs:
            self.metrics.prefix_lookups.labels("hit" if hit else "miss").inc()
            self.cache.insert(seq.request_id, seq.prompt, out.hidden, out.hidden_start, hit)
        self.metrics.prefix_evictions.inc(self.cache.evictions - self._evictions_counted)
        self._evictions_counted = self.cache.evictions
        self.metrics.prefix_entries.set(len(self.cache))
        self.capacity = self.store.free_capacity()

    def _fill_draft_windows(self, targeted: list[tuple[Sequence, PrefillOutput, PrefillTarget]]) -> None:
        """Engine thread: the draft windows that travel, for the whole batch in one forward."""
        if self.send_draft:
            send = [(seq, out) for seq, out, target in targeted if target.transfer_plan.draft_state == "transfer"]
            self.runner.fill_draft_windows([seq for seq, _ in send], [out for _, out in send])

    def _stage_late(self, job: Job, target: PrefillTarget, seq: Sequence, out: PrefillOutput) -> list[Descriptor] | BatonError:
        """Engine thread: a request whose target came after its prefill: its draft window, then `_try_stage`."""
        self._fill_draft_windows([(seq, out, target)])
        return self._try_stage(job, target, seq, out)

    def _free_batch(self, jobs: list[Job]) -> None:
        """Engine thread: free what a failed batch had allocated."""
        for job in jobs:
            try:
                self.store.free(job.request_id)
            except KVError:
                pass  # its allocation had failed (busy), or it was never reached
        self.capacity = self.store.free_capacity()

    def _free(self, request_id: str) -> None:
        """Engine thread: free one request's KV and publish the capacity left."""
        self.store.free(request_id)
        self.capacity = self.store.free_capacity()

    async def _deliver(self, job: Job, seq: Sequence, out: PrefillOutput, staged: Staged,
                       prefill_ms: float) -> None:
        """Send a computed request once its target is known; or drop it (released, deadline, a
        target that does not fit), freeing its slots."""
        if job.dispatch.cache_only:
            await self._kept(job, out, prefill_ms)
            return
        if staged is None:
            staged, prefill_ms = await self._stage_when_targeted(job, seq, out, prefill_ms)
        if isinstance(staged, BatonError):
            await self.engine.call(self._free, job.request_id)
            _fail(job, staged)
            return
        await self._send(job, job.target, out, staged, prefill_ms)

    async def _kept(self, job: Job, out: PrefillOutput, prefill_ms: float) -> None:
        """A cache-only request: the batcher has queued its prompt into the prefix cache
        (`_cache_prompts`, ahead of this free); nothing goes to decode."""
        await self.engine.call(self._free, job.request_id)
        self.metrics.requests.labels("cached").inc()
        log_request("prefill", job.request_id, outcome="cached", prompt_tokens=len(job.dispatch.token_ids),
                    prefill_ms=round(prefill_ms, 2), at=job.at)
        if not job.done.done():
            job.done.set_result(PrefillDone(request_id=job.request_id, first_token_id=out.first_token,
                                            transfer_bytes=0, prefill_ms=prefill_ms, transfer_ms=0.0,
                                            cached_tokens=job.cached_tokens))

    async def _stage_when_targeted(self, job: Job, seq: Sequence, out: PrefillOutput,
                                   prefill_ms: float) -> tuple[list[Descriptor] | BatonError, float]:
        try:
            await asyncio.wait_for(job.settled.wait(), self.config.worker.transfer_deadline_s)
        except asyncio.TimeoutError:
            self.jobs.settle(job.request_id, BatonError(ErrorCode.TIMEOUT, f"request {job.request_id}: "
                             f"no target within {self.config.worker.transfer_deadline_s:g} s"))
        if isinstance(job.outcome, BatonError):
            return job.outcome, prefill_ms
        started = time.monotonic()
        staged = await self.engine.call(self._stage_late, job, job.target, seq, out)
        return staged, prefill_ms + (time.monotonic() - started) * 1000

    def _try_stage(self, job: Job, target: PrefillTarget, seq: Sequence,
                   out: PrefillOutput) -> list[Descriptor] | BatonError:
        """Engine thread: `_stage`; a target that does not fit this request (e.g. a decode
        allocation that does not hold its positions) fails this request, not its batch."""
        try:
            return self._stage(job, target, seq, out)
        except ValueError as exc:
            return BatonError(ErrorCode.BAD_REQUEST, f"request {job.request_id}: its target does not fit: {exc}")

    def _stage(self, job: Job, target: PrefillTarget, seq: Sequence, out: PrefillOutput) -> list[Descriptor]:
        """Engine thread: the aux row and the descriptors to WRITE (the draft window, if it travels,
        is filled by the caller, `_fill_draft_windows`)."""
        L = len(seq.prompt)
        rows = target.transfer_plan.aux_hidden_rows(L)
        pack_aux(self.store.aux_row(seq.request_id), self.store.aux_layout, request_tag(seq.request_id),
                 out.first_token, out.hidden[-rows:] if rows else torch.zeros(0, self.model.cfg.hidden_size,
                                                                             device=self.store.device))
        src = self.store.allocation(seq.request_id)
        return target.transfer_plan.descriptors(L, src, target.decode_allocation)

    async def _announce(self, decode_worker_id: str, request_id: str) -> None:
        """Tell decode the WRITE starts, so it looks for it closely from now on (a hint: lost, the
        state lands all the same and decode finds it up to 1 ms later)."""
        try:
            await self.bus.publish(subjects.decode_incoming(decode_worker_id), WriteStarting(request_id=request_id))
        except BatonError as exc:
            log.info("request %s: decode not told that its WRITE starts: %s", request_id, exc)

    async def _send(self, job: Job, target: PrefillTarget, out: PrefillOutput, descriptors: list[Descriptor],
                    prefill_ms: float) -> None:
        rid = job.dispatch.request_id
        job.at.mark("write")
        await self._announce(target.decode_worker_id, rid)
        try:
            result = await self.agent.write(target.decode_worker_id, descriptors, request_tag(rid),
                                            self.config.worker.transfer_deadline_s)
            job.at.mark("written")
        finally:
            await self.engine.call(self._free, rid)  # nothing of ours is in flight any more
        self.metrics.requests.labels(result.status.value).inc()
        log_request("prefill", rid, outcome=result.status.value, prompt_tokens=len(job.dispatch.token_ids),
                    prefill_ms=round(prefill_ms, 2), transfer_ms=round(result.seconds * 1000, 2),
                    transfer_bytes=result.nbytes, descriptors=len(descriptors), decode=target.decode_worker_id,
                    error=result.error or None, at=job.at)
        if result.ok:
            self.metrics.transfer_bytes.inc(result.nbytes)
            self.metrics.transfer_seconds.observe(result.seconds)
        else:
            self.metrics.transfer_failures.inc()
        if job.done.done():
            return
        if not result.ok:
            job.done.set_exception(BatonError(ErrorCode.INTERNAL if result.status.value == "failed"
                                              else ErrorCode.UNAVAILABLE, f"transfer of {rid}: {result.error}"))
            return
        job.done.set_result(PrefillDone(request_id=rid, first_token_id=out.first_token, transfer_bytes=result.nbytes,
                                        prefill_ms=prefill_ms, transfer_ms=result.seconds * 1000,
                                        prompt_logprobs=out.prompt_logprobs, cached_tokens=job.cached_tokens))


def _fail(job: Job, error: BatonError) -> None:
    if not job.done.done():
        job.done.set_exception(error)
