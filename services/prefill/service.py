"""prefill: run prompts through the target (and the MTP layer over the prompt's window when the
draft state travels), WRITE the state into decode's reserved slots over NIXL, reply when done.

Dispatches queue up; a batcher runs every queued prompt in one chunked, batched forward on the
engine thread, then starts one WRITE per request. A request's own slots are freed only once its
WRITE is finished or failed (nothing in flight).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import PrefillDispatch, PrefillDone, WorkerLoad
from baton.shared.bus import Bus
from baton.shared.engine.runner import ModelRunner, PrefillOutput, SpecConfig
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence
from baton.shared.kv.allocator import KVError
from baton.shared.kv.aux import pack_aux
from baton.shared.kv.codec import from_plain
from baton.shared.kv.components import Allocation
from baton.shared.kv.plan import TransferPlan
from baton.shared.kv.store import KVStore
from baton.shared.model.checkpoint import fingerprint, load_model
from baton.shared.transfer.agent import TransferAgent
from baton.shared.transfer.regions import Descriptor

from baton.shared.metrics import ServiceMetrics, log_request

from baton.shared.transfer.notices import request_tag
from ..worker import (EngineThread, Membership, WorkerConfig, on_worker_left, peer_lookup, registration,
                      regions_of)

log = logging.getLogger("baton.prefill")


@dataclass
class Job:
    dispatch: PrefillDispatch
    plan: TransferPlan
    decode_alloc: Allocation
    done: asyncio.Future
    received: float


class PrefillWorker:
    def __init__(self, bus: Bus, config: WorkerConfig) -> None:
        self.bus, self.config = bus, config
        self.model = load_model(config.model)
        send_draft = config.spec and config.draft_state == "transfer"
        self.store = KVStore(self.model.cfg, mode=config.mode, num_pages=config.num_pages,
                             page_size=config.page_size, num_slots=config.num_slots,
                             max_draft_tokens=config.draft_tokens, draft_enabled=send_draft)
        self.runner = ModelRunner(self.model, self.store, SpecConfig(config.spec, config.draft_tokens,
                                                                     config.draft_state), config.prefill_chunk)
        self.send_draft = send_draft
        self.manifest = self.store.manifest(config.worker_id, fingerprint(config.model), role="prefill")
        self.agent = TransferAgent(config.worker_id, regions_of(self.manifest), lookup=peer_lookup(bus))
        self.engine = EngineThread()
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.queued_tokens = 0
        self.active = 0
        self.requests_total = 0
        self.membership = Membership(bus, registration(config, self.manifest, self.agent.metadata(),
                                                       self.model.cfg.max_position_embeddings), self.load)
        self._tasks: set[asyncio.Task] = set()
        self.metrics = ServiceMetrics("prefill")

    def load(self) -> WorkerLoad:
        free = self.store.free_capacity()
        self.metrics.free_pages.set(free.pages)
        self.metrics.free_slots.set(free.slots)
        self.metrics.queue.set(self.queue.qsize())
        return WorkerLoad(free_pages=free.pages, free_slots=free.slots, active_requests=self.active,
                          queued_prompt_tokens=self.queued_tokens, requests_total=self.requests_total)

    async def run(self, stop: asyncio.Event) -> None:
        self.metrics.serve_from_env()
        async with self.agent:
            await self.bus.serve(subjects.prefill_dispatch(self.config.worker_id), PrefillDispatch, self.dispatch)
            await on_worker_left(self.bus, self._peer_left)
            await self.membership.start()
            batcher = asyncio.create_task(self._batcher(), name="prefill-batcher")
            await stop.wait()
            log.info("stopping: no new prompts; finishing %d in flight", self.active)
            await self.membership.stop()
            await self.bus.close(grace_s=self.config.transfer_deadline_s)
            batcher.cancel()
            for task in set(self._tasks):
                await asyncio.wait([task])
        self.engine.close()

    async def _peer_left(self, worker_id: str) -> None:
        await self.agent.remove_peer(worker_id)  # our writes to it stop; their requests fail

    async def dispatch(self, req: PrefillDispatch) -> PrefillDone:
        try:
            plan = from_plain(TransferPlan, req.transfer_plan)
            decode_alloc = from_plain(Allocation, req.decode_allocation)
        except ValueError as exc:
            raise BatonError(ErrorCode.BAD_REQUEST, f"prefill dispatch {req.request_id}: {exc}")
        job = Job(req, plan, decode_alloc, asyncio.get_running_loop().create_future(), time.monotonic())
        self.queued_tokens += len(req.token_ids)
        self.active += 1
        self.requests_total += 1
        self.queue.put_nowait(job)
        try:
            return await job.done
        finally:
            self.active -= 1

    async def _batcher(self) -> None:
        while True:
            jobs = [await self.queue.get()]
            while not self.queue.empty() and len(jobs) < self.config.max_batch:
                jobs.append(self.queue.get_nowait())
            self.queued_tokens -= sum(len(j.dispatch.token_ids) for j in jobs)
            started = time.monotonic()
            try:
                outputs = await self.engine.call(self._compute, jobs)
            except Exception as exc:  # noqa: BLE001 - every job gets the error, the batcher goes on
                log.exception("prefill batch failed")
                for job in jobs:
                    if not job.done.done():
                        job.done.set_exception(BatonError(ErrorCode.INTERNAL, f"prefill failed: {exc}"))
                continue
            prefill_ms = (time.monotonic() - started) * 1000
            self.metrics.prefill_seconds.observe(prefill_ms / 1000)
            for job, (first, descriptors) in zip(jobs, outputs):
                if descriptors is None:
                    continue
                task = asyncio.create_task(self._send(job, first, descriptors, prefill_ms))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _compute(self, jobs: list[Job]) -> list[tuple[int, list[Descriptor] | None]]:
        """Engine thread: allocate, prefill the batch, pack aux rows, list the bytes to send."""
        seqs, results = [], []
        for job in jobs:
            d = job.dispatch
            try:
                self.store.allocate(d.request_id, len(d.token_ids))
            except KVError as exc:
                job.done.get_loop().call_soon_threadsafe(_fail, job, BatonError(ErrorCode.BUSY, str(exc)))
                continue
            params = SamplingParams(d.sampling.temperature, d.sampling.top_p, d.sampling.seed)
            seqs.append((job, Sequence(d.request_id, list(d.token_ids), 1, params)))
        outputs = self.runner.prefill([s for _, s in seqs]) if seqs else []
        by_job = {id(job): (seq, out) for (job, seq), out in zip(seqs, outputs)}
        for job in jobs:
            if id(job) not in by_job:
                results.append((0, None))
                continue
            seq, out = by_job[id(job)]
            results.append((out.first_token, self._stage(job, seq, out)))
        return results

    def _stage(self, job: Job, seq: Sequence, out: PrefillOutput) -> list[Descriptor]:
        L = len(seq.prompt)
        if self.send_draft and job.plan.draft_state == "transfer":
            self.runner.fill_draft_window(seq, out.hidden)
        rows = job.plan.aux_hidden_rows(L)
        pack_aux(self.store.aux_row(seq.request_id), self.store.aux_layout, request_tag(seq.request_id),
                 out.first_token, out.hidden[L - rows:] if rows else torch.zeros(0, self.model.cfg.hidden_size))
        src = self.store.allocation(seq.request_id)
        return [Descriptor(d.component_key, d.layer_index, d.src_offset, d.dst_offset, d.nbytes)
                for d in job.plan.descriptors(L, src, job.decode_alloc)]

    async def _send(self, job: Job, first_token: int, descriptors: list[Descriptor], prefill_ms: float) -> None:
        rid = job.dispatch.request_id
        try:
            result = await self.agent.write(job.dispatch.decode_worker_id, descriptors, request_tag(rid),
                                            self.config.transfer_deadline_s)
        finally:
            await self.engine.call(self.store.free, rid)  # nothing of ours is in flight any more
        self.metrics.requests.labels(result.status.value).inc()
        log_request("prefill", rid, outcome=result.status.value, prompt_tokens=len(job.dispatch.token_ids),
                    prefill_ms=round(prefill_ms, 2), transfer_ms=round(result.seconds * 1000, 2),
                    transfer_bytes=result.nbytes, decode=job.dispatch.decode_worker_id, error=result.error or None)
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
        job.done.set_result(PrefillDone(request_id=rid, first_token_id=first_token, transfer_bytes=result.nbytes,
                                        prefill_ms=prefill_ms, transfer_ms=result.seconds * 1000))


def _fail(job: Job, error: BatonError) -> None:
    if not job.done.done():
        job.done.set_exception(error)


async def serve(stop: asyncio.Event, bus: Bus, config: WorkerConfig) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)
    await PrefillWorker(bus, config).run(stop)
