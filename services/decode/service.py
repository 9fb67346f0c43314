"""decode: reserve slots for a request, wait until prefill's WRITEs have landed (NIXL
notifications + the tag in the aux row), then generate with continuous batching: every step
advances all active requests in one batched forward (draft -> verify -> accept with speculation)
and streams each request's new tokens to the router.

A reservation that asks decode to prefill the prompt itself (`prefill_here`) gets it when nothing
else runs here: the engine thread then computes the prompt as prefill would have, with no transfer
to wait for, and no other stream waits behind it.

Slot lifetime: reserved at `reserve`; freed when a request finishes, or, for a request that never
started, only when its transfer is known to be over (arrivals RELEASE event), so a late WRITE can
never land in a reused slot.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from nats.aio.msg import Msg

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (Ack, PrefixEvents, PrefixQuery, ReleaseRequest, ReserveReply, ReserveRequest,
                                  TokenChunk, WorkerLoad, WriteStarting)
from baton.proto.public import SpecStats, Timing
from baton.shared.bus import Bus
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import DECODE_SEED_SALT, Sequence
from baton.shared.kv.allocator import KVError, OutOfCapacity
from baton.shared.kv.aux import first_token_at, unpack_aux
from baton.shared.kv.budget import reservation
from baton.shared.kv.turn_cache import TurnCache
from baton.shared.transfer.arrivals import EventKind

from baton.shared.metrics import Stamps, log_request

from baton.shared.transfer.notices import request_tag
from ..worker import FIRST_TOKENS_WAIT_S, Worker, WorkerConfig, publish_changes, snapshot_message, speculation

log = logging.getLogger("baton.decode")
PARK_S = 0.5  # how long an engine thread with nothing to step waits for an arrival before returning


@dataclass
class Request:
    seq: Sequence
    stream: str  # subject for TokenChunks
    draft_state: str  # how this request's draft window starts: transfer | rebuild | cold | none
    reserved_at: float
    aux_address: int  # where prefill writes this request's aux row (our memory)
    chunks: int = 0
    sent: int = 0  # tokens streamed so far
    first_token_at: float | None = None
    abort: str = ""  # set by release: leave the batch at the next step boundary
    released_as: str = "abort"  # the finish reason a release gives ("stop": the router matched a stop string)
    arrived: bool = False  # its state landed: queued for the engine thread (`DecodeWorker._joining`)
    started: bool = False  # the engine thread took it into the batch
    failed: bool = field(default=False)
    at: Stamps = field(default_factory=Stamps)
    prefill: Sequence | None = None  # decode computes the prompt itself: the sequence prefill would sample from


class DecodeWorker(Worker):
    def __init__(self, bus: Bus, config: WorkerConfig) -> None:
        super().__init__(bus, config, draft_windows=speculation(config.worker).enabled)
        self.turns = TurnCache(self.store, config.worker.turn_cache) if config.worker.turn_cache else None
        self._evictions_counted = 0  # of turns.evictions, those in the metrics already
        self.peers: set[str] = set()
        self.requests_total = 0
        self.requests: dict[int, Request] = {}  # by tag
        self.wake = asyncio.Event()
        self._joining: deque[Request] = deque()  # arrived, for the engine thread to start (loop appends)
        self._engine_wake = threading.Event()  # an arrival, a release, closing: wakes a parked engine thread
        self._members: list[Request] = []  # the batch: the engine thread's alone while a run is in flight
        self._closing = False  # the step loop stopped: a run in flight returns after its step
        self._stepping = False  # the engine thread is stepping (read by the NIXL thread; parked: False)
        self.agent.engine_busy = lambda: self._stepping
        self.probe_prefix = bus.connection.new_inbox()  # <prefix>.<tag>: the reply subject of a request's chunks
        self._loops: list[asyncio.Task] = []

    def load(self) -> WorkerLoad:
        free = self.store.free_capacity()
        self.metrics.free_pages.set(free.pages)
        self.metrics.free_slots.set(free.slots)
        self.metrics.queue.set(sum(1 for r in self.requests.values() if not r.started))
        self.metrics.active.set(sum(1 for r in self.requests.values() if r.started))
        return WorkerLoad(free_pages=free.pages, free_slots=free.slots, active_requests=len(self.requests),
                          queued_prompt_tokens=0, requests_total=self.requests_total)

    async def _serve(self) -> None:
        worker_id = self.config.worker.id
        self._loops = [asyncio.create_task(self._arrivals(), name="arrivals"),
                       asyncio.create_task(self._step_loop(), name="decode-steps")]
        await self.bus.subscribe(f"{self.probe_prefix}.*", self._on_probe)
        await self.bus.serve(subjects.decode_reserve(worker_id), ReserveRequest, self.reserve)
        await self.bus.serve(subjects.decode_release(worker_id), ReleaseRequest, self.release)
        await self.bus.serve(subjects.decode_incoming(worker_id), WriteStarting, self.incoming)
        await self.bus.serve(subjects.decode_prefixes(worker_id), PrefixQuery, self.prefixes)

    async def _leave(self) -> None:
        log.info("stopping: no new reservations; %d requests in flight", len(self.requests))
        await self.membership.stop()
        for endpoint in self.bus.endpoints:
            if endpoint.subject.endswith(".reserve"):
                await endpoint.stop(0)
        await self._drain(self.config.worker.transfer_deadline_s)
        for task in self._loops:
            task.cancel()
        await self.bus.close()

    async def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in list(self.requests.values()):
            req.abort = req.abort or "decode worker shutting down"
        self._wake()

    def _wake(self) -> None:
        """Loop: something changed for the batch (an arrival, a release, closing): the step loop and
        a parked engine thread look again."""
        self._engine_wake.set()
        self.wake.set()

    async def _peer_left(self, worker_id: str) -> None:
        self.peers.discard(worker_id)
        await self.agent.remove_peer(worker_id)  # requests it was writing are released

    # --- control --------------------------------------------------------------------------
    async def reserve(self, msg: ReserveRequest) -> ReserveReply:
        at = Stamps()
        at.mark("reserve")
        s = msg.sampling
        seed = None if s.seed is None else (s.seed ^ DECODE_SEED_SALT) % 2**64
        seq = Sequence(msg.request_id, list(msg.token_ids), msg.max_tokens,
                       SamplingParams.of(s, seed), frozenset(s.stop_token_ids),
                       draft_tokens=s.draft_tokens, min_tokens=s.min_tokens, logprobs=s.logprobs,
                       output_in_prompt=s.output_in_prompt, device=self.store.device)
        tag = request_tag(msg.request_id)
        if tag in self.requests:
            raise BatonError(ErrorCode.BAD_REQUEST, f"request {msg.request_id} is already reserved here")
        positions = reservation(len(seq.prompt), seq.max_tokens, self.config.worker.draft_tokens)
        here = msg.prefill_here and s.prompt_logprobs is None and self._all_ending()
        if not here:
            await self._ensure_peer(msg.prefill_worker_id)
        try:  # bookkeeping, on the loop: it never waits behind a decode step on the engine thread
            alloc = self._allocate(msg.request_id, positions, seq.prompt, here)
        except OutOfCapacity as exc:  # room may come back: the router's queue waits for it
            raise BatonError(ErrorCode.BUSY, f"decode {self.config.worker.id}: {exc}") from None
        except KVError as exc:  # more than this worker could ever hold: waiting would not help
            raise BatonError(ErrorCode.TOO_LARGE, f"decode {self.config.worker.id}: {exc}") from None
        self.requests_total += 1
        draft_state = self._draft_state(msg.draft_state)
        req = self.requests[tag] = Request(seq, msg.stream_subject, draft_state, time.monotonic(),
                                           self.store.aux[0, alloc.slot].data_ptr(), at=at)
        at.mark("reserved")
        if here:
            self.metrics.prefilled_here.inc()
            req.prefill = Sequence(msg.request_id, list(msg.token_ids), 1, SamplingParams.of(s, s.seed),
                                   output_in_prompt=s.output_in_prompt, device=self.store.device)  # as prefill's
            req.arrived = True  # nothing to wait for: the engine thread computes it before its next step
            self._joining.append(req)
            self._wake()
        else:
            self.agent.arrivals.expect(tag, msg.prefill_worker_id, [c for c in msg.components if c != "aux/AUX"],
                                       alloc.slot * self.store.aux_layout.item_bytes,
                                       self.config.worker.transfer_deadline_s)
        await self._publish_turns()  # turns evicted for its room
        return ReserveReply(request_id=msg.request_id, decode_worker_id=self.config.worker.id,
                            allocation=alloc, prefilled_here=here)

    def _all_ending(self) -> bool:
        """Nothing runs or waits to run here: every request held is ending."""
        return all(r.seq.finish_reason or r.abort for r in self.requests.values())

    def _allocate(self, request_id: str, positions: int, prompt: list[int], here: bool):
        """Reserve every position the request may write, its first pages from the turn cache when
        the prompt repeats a finished one (`allocation.reused`: prefill sends FULL from there); the
        prompt's positions are the ones prefill will fill, so they count as written (the plan
        checks this). A prompt computed `here` reuses nothing and its positions are written by
        that prefill. Runs on the event loop while the engine thread may be stepping other
        requests: see KVStore on the two owners."""
        if self.turns is None:
            self.store.allocate(request_id, positions)
        else:
            self.metrics.turn_reused.inc(self.turns.allocate(request_id, [] if here else prompt, positions))
        if not here:
            self.store.extend(request_id, len(prompt))
        return self.store.allocation(request_id)

    async def prefixes(self, _query: PrefixQuery) -> PrefixEvents:
        """The prompts the turn cache holds, for a router that starts or missed a change."""
        seq, held = self.turns.snapshot() if self.turns else (0, [])
        return snapshot_message(self.membership.registration, self.store.page_size, seq, held)

    async def _publish_turns(self) -> None:
        """The turn cache's changes, if any, to every router (PrefixEvents, as prefill's cache)."""
        if self.turns is None:
            return
        self.metrics.turn_entries.set(len(self.turns))
        self.metrics.turn_evictions.inc(self.turns.evictions - self._evictions_counted)
        self._evictions_counted = self.turns.evictions
        await publish_changes(self.bus, self.membership.registration, self.store.page_size, self.turns.take_changes())

    async def _ensure_peer(self, worker_id: str) -> None:
        """Load the prefill peer's validated registry entry, so aborts can reach it."""
        if worker_id in self.peers:
            return
        info = await self.lookup(worker_id)
        if info is None:
            raise BatonError(ErrorCode.UNAVAILABLE, f"prefill worker {worker_id} is not registered")
        await self.agent.add_peer(info.name, info.metadata, info.regions)
        self.peers.add(worker_id)

    def _draft_state(self, from_plan: str) -> str:
        if not self.spec.enabled:
            return "none"
        return "cold" if self.spec.draft_state == "cold" or from_plan == "cold" else from_plan

    async def release(self, msg: ReleaseRequest) -> Ack:
        self._end(request_tag(msg.request_id), msg.reason or "released", msg.finish_reason)
        return Ack()

    async def incoming(self, msg: WriteStarting) -> None:
        """Prefill starts writing a request's state (a hint, published: no reply)."""
        self.agent.incoming(request_tag(msg.request_id))

    async def _on_probe(self, msg: Msg) -> None:
        """A 503 "no responders" for a chunk's probe: the router's token inbox is gone (the router
        died), so nobody will read this request's tokens; end it as a release would."""
        tag = int(msg.subject.rsplit(".", 1)[1])
        req = self.requests.get(tag)
        if msg.headers and msg.headers.get("Status") == "503" and req is not None and not req.abort:
            log.info("request %s: its router's token inbox is gone; aborted", req.seq.request_id)
            self._end(tag, "the router's token inbox is gone", "abort")

    def _end(self, tag: int, reason: str, finish_reason: str) -> None:
        """Leave the batch at the next step boundary and free the slots (a request whose state
        has not landed frees them at its transfer's RELEASE event)."""
        req = self.requests.get(tag)
        if req is None:
            return
        req.abort, req.released_as = reason, finish_reason
        if not req.arrived:
            self.agent.arrivals.abort(tag, req.abort)
        self._wake()

    # --- arrivals -------------------------------------------------------------------------
    async def _arrivals(self) -> None:
        while True:
            event = await self.agent.arrivals.events.get()
            req = self.requests.get(event.tag)
            if req is None:
                continue
            if event.kind is EventKind.ARRIVED:
                req.at.mark("arrived")
                if req.abort:
                    await self._finish(event.tag, req, "abort")
                    continue
                if req.seq.logprobs is None:  # else from the aux row's hidden state: after _start
                    await self._publish_first(req, first_token_at(req.aux_address))
                req.arrived = True
                self._joining.append(req)  # the engine thread starts it before its next step
                self._wake()
            elif event.kind is EventKind.FAILED:
                req.failed = True
                await self._publish_error(req, BatonError(ErrorCode.INTERNAL, f"state transfer for "
                                                          f"{req.seq.request_id} failed: {event.reason}"))
            elif event.kind is EventKind.RELEASE:
                self.store.free(req.seq.request_id)  # never started: no step holds it
                self.requests.pop(event.tag, None)

    async def _publish_first(self, req: Request, token: int) -> None:
        """The first token is streamed before the engine takes the request (unless its logprobs
        are asked for): the row is complete (every WRITE landed) and only this request's, so
        reading it on the loop is safe."""
        req.first_token_at = time.monotonic()
        await self._publish(req, [token])
        req.at.mark("first_chunk")

    def _start(self, req: Request, post: Callable[[tuple], None]) -> None:
        """Engine thread: read the aux row prefill wrote (or prefill here) and hand the request to
        the step loop."""
        seq = req.seq
        if req.prefill is not None:
            self._prefill_here(req, post)
            return
        L = len(seq.prompt)
        rows = min(L, self.store.aux_layout.hidden_rows) if req.draft_state == "rebuild" else 1
        record = unpack_aux(self.store.aux_row(seq.request_id), self.store.aux_layout, max_rows=rows)
        if self.spec.enabled:
            self.runner.start_decode(seq, record.first_token, record.hidden, req.draft_state)
        else:
            self.runner.start_decode(seq, record.first_token, record.hidden[-1:], "cold")

    def _prefill_here(self, req: Request, post: Callable[[tuple], None]) -> None:
        """Engine thread: compute the prompt as prefill does (its first token drawn with the
        request's own seed, its draft window when that travels) and start decoding it. The first
        token is streamed as soon as it is drawn, ahead of the draft window, as prefill streams it;
        with logprobs asked for, once the request starts (`start_decode` computes them)."""
        state = req.draft_state if self.spec.enabled else "cold"
        ahead = None if req.seq.logprobs is not None else (
            lambda outputs: self._stream_first_token(req, outputs[0].first_token, post))
        self.runner.prefill_and_start([req.seq], state, sampled_by=[req.prefill], on_sampled=ahead)

    @staticmethod
    def _stream_first_token(req: Request, token: int, post: Callable[[tuple], None]) -> None:
        """Engine thread: hand the first token to the loop and wait (at most FIRST_TOKENS_WAIT_S)
        until it is written: computing on meanwhile would hold the core and the GIL the loop needs
        to send it (prefill's `_stream_first_tokens`)."""
        written = threading.Event()
        post(("first", req, token, written))
        written.wait(FIRST_TOKENS_WAIT_S)

    # --- decode loop ----------------------------------------------------------------------
    async def _step_loop(self) -> None:
        """Runs of the engine thread (`_run`), each as long as the batch has members: requests join
        and leave it between steps on the engine thread, without a round trip through the loop."""
        try:
            while True:
                if self._joining or self._members:
                    await self._run_batch()
                else:
                    await self._idle()
        finally:
            self._closing = True  # a run still in flight returns after its step (or parking)
            self._engine_wake.set()

    async def _run_batch(self) -> None:
        """One run of the engine thread; streams each step's tokens, finishes the requests that
        left and publishes the first token of those that joined, in the order the engine did it."""
        loop, posted = asyncio.get_running_loop(), asyncio.Queue()

        def post(item: tuple) -> None:  # engine thread -> loop, in order
            loop.call_soon_threadsafe(posted.put_nowait, item)
        run = asyncio.ensure_future(self.engine.call(self._run, post))
        run.add_done_callback(lambda _: posted.put_nowait(None))  # after everything it posted
        while (item := await posted.get()) is not None:
            await self._after(*item)
        if (failure := run.exception()) is not None:
            await self._fail_batch(failure)

    async def _fail_batch(self, exc: BaseException) -> None:
        """Loop, after a run whose step raised: every request of its batch gets an error reply and
        its slots back (no step holds them any more); the service goes on with the next arrivals."""
        members, self._members, self._stepping = self._members, [], False
        log.error("a decode step failed; its %d requests fail", len(members), exc_info=exc)
        for req in members:
            req.failed, req.abort = True, f"a decode step failed: {type(exc).__name__}: {exc}"
        await self._after("rebatch", members, [])

    def _run(self, post: Callable[[tuple], None]) -> None:
        """Engine thread: step the batch; before each step, requests that ended leave it and
        arrived ones join it (`_rebatch`). With the batch empty it parks up to PARK_S for the next
        arrival or release (woken by `_engine_wake`, not by a round trip through the loop), then returns."""
        while True:
            self._engine_wake.clear()
            members = self._rebatch(post)
            if not members:
                self._stepping = False
                if self._closing or not self._engine_wake.wait(PARK_S):
                    return
                continue
            self._stepping = True
            start = time.perf_counter()
            emitted = self.runner.step([r.seq for r in members])
            self.metrics.step_seconds.observe(time.perf_counter() - start)
            self.metrics.tokens.inc(sum(len(t) for t in emitted))
            post(("step", members, emitted))

    def _rebatch(self, post: Callable[[tuple], None]) -> list[Request]:
        """Engine thread, between steps: the batch of the next step."""
        if self._closing:
            return []
        left = [r for r in self._members if r.abort or r.seq.finish_reason]
        members = [r for r in self._members if r not in left]
        joined = []
        while self._joining and len(members) < self.config.worker.max_batch:
            req = self._joining.popleft()
            if not req.abort:
                try:
                    self._start(req, post)
                except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("request %s could not start", req.seq.request_id)
                    req.failed, req.abort = True, f"could not start: {type(exc).__name__}: {exc}"
            if req.abort:
                left.append(req)
                continue
            req.started = True
            req.at.mark("started")
            members.append(req)
            joined.append(req)
        self._members = members
        if left or joined:
            post(("rebatch", left, joined))
        return members  # a new list each time: the loop may hold the last one

    async def _after(self, kind: str, *posted) -> None:
        """Loop: what the engine thread posted, in its order: ("step", members, their tokens),
        ("rebatch", left, joined) or ("first", a request computed here, its first token, the engine
        thread's event)."""
        if kind == "first":
            return await self._first_ahead(*posted)
        first, second = posted
        if kind == "step":
            for req, tokens in zip(first, second):
                if tokens and not req.abort:
                    await self._publish(req, tokens)
            return
        for req in first:  # left the batch: no step holds it any more
            tag = request_tag(req.seq.request_id)
            if req.failed:
                error = BatonError(ErrorCode.INTERNAL, f"request {req.seq.request_id}: {req.abort}")
                await self._publish_error(req, error)
                self.store.free(req.seq.request_id)
                self.requests.pop(tag, None)
            else:
                await self._finish(tag, req, req.seq.finish_reason or req.released_as)
        for req in second:  # the first token of those it has not gone out for (`_arrivals`, `_prefill_here`)
            if req.seq.logprobs is not None:
                await self._publish_first(req, req.seq.output[0])

    async def _first_ahead(self, req: Request, token: int, written: threading.Event) -> None:
        """Loop: the first token of a prompt computed here (`_stream_first_token`), written at once,
        not on nats-py's flusher's turn: the engine thread waits for it."""
        try:
            await self._publish_first(req, token)
            self.bus.write_pending()
        finally:
            written.set()

    async def _idle(self) -> None:
        self.wake.clear()
        if self._joining:
            return
        try:
            await asyncio.wait_for(self.wake.wait(), 0.5)
        except asyncio.TimeoutError:
            pass

    async def _finish(self, tag: int, req: Request, reason: str) -> None:
        if self.turns is not None and req.started and reason in ("length", "stop"):
            try:
                self.turns.keep(req.seq.request_id, req.seq.prompt)  # its prompt's pages, for the next turn
            except KVError as exc:  # a reply never fails for the cache's sake
                log.error("request %s: its prompt was not kept in the turn cache: %s", req.seq.request_id, exc)
            await self._publish_turns()  # routers know before the client has the reply (and sends the next turn)
        await self._publish(req, [], finish_reason=reason)
        stats = req.seq.stats
        self.metrics.requests.labels(reason).inc()
        self.metrics.verify_steps.inc(stats.verify_steps)
        self.metrics.drafted.inc(stats.drafted)
        self.metrics.accepted.inc(stats.accepted)
        if stats.verify_steps:
            self.metrics.acceptance_length.observe(stats.acceptance_length())
        log_request("decode", req.seq.request_id, outcome=reason, completion_tokens=len(req.seq.output),
                    draft_state=req.draft_state, prefilled_here=req.prefill is not None, at=req.at,
                    **stats.as_dict())
        self.store.free(req.seq.request_id)  # between steps: no step holds it
        self.requests.pop(tag, None)

    async def _publish(self, req: Request, tokens: list[int], finish_reason: str | None = None) -> None:
        summary = {}
        if finish_reason is not None:
            now = time.monotonic()
            first = req.first_token_at or now
            summary = dict(finish_reason=finish_reason, spec=SpecStats(**req.seq.stats.as_dict()),
                           timing=Timing(ttft_ms=(first - req.reserved_at) * 1000, total_ms=(now - req.reserved_at) * 1000))
        reported = req.seq.output_logprobs
        if reported is not None and tokens:
            summary["logprobs"] = reported[req.sent:req.sent + len(tokens)]
        chunk = TokenChunk(request_id=req.seq.request_id, seq=req.chunks, token_ids=tokens,
                           finished=finish_reason is not None, **summary)
        req.chunks += 1
        req.sent += len(tokens)
        try:
            probe = f"{self.probe_prefix}.{request_tag(req.seq.request_id)}"
            await self.bus.publish(req.stream, chunk, reply=probe)
        except BatonError as exc:
            log.warning("cannot stream %s: %s", req.seq.request_id, exc)

    async def _publish_error(self, req: Request, error: BatonError) -> None:
        try:
            await self.bus.publish(req.stream, error.to_reply())
        except BatonError as exc:
            log.warning("cannot send error for %s: %s", req.seq.request_id, exc)
