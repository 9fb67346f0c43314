"""One request's path through the cluster, as the router drives it:

    pick a prefill and a decode worker -> dispatch the prompt to prefill and, meanwhile, reserve
    decode slots (decode will stream TokenChunks to our token inbox) -> tell prefill the target
    (the reservation and the plan) -> relay tokens as they come.

A short prompt that no worker holds a prefix of (`RouterPolicy.prefill_on_decode_tokens`) first
asks decode to compute it itself: decode does when nothing else runs there, and the attempt skips
prefill and the hand-off (conditional disaggregation); else it reserved as usual and the dispatch
follows. A prompt decode computes is also sent to the picked prefill, if this router has nothing
there, to compute off the request's path and keep in its prefix cache, so that a conversation's
next turn starts from it there as it would have.

Everything the flow waits for (tokens, the prefill reply, a cancel, the deadline) arrives on one
queue, so whichever comes first decides, and every exit releases what was reserved.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable

import msgspec

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode, NotListening
from baton.proto.internal import (Ack, PrefillDispatch, PrefillDone, PrefillTarget, ReleaseRequest,
                                  ReserveReply, ReserveRequest, SamplingParams, TokenChunk)
from baton.proto.public import Logprobs
from baton.shared.bus import Bus
from baton.shared.config import RouterSection
from baton.shared.kv.plan import TransferPlan
from baton.shared.metrics import Stamps

from .admission import AdmissionQueue
from .directory import Directory
from .public import Outcome
from .tokens import TokenInbox

log = logging.getLogger("baton.router.flow")


@dataclass(frozen=True)
class RouterTimeouts:
    """The [router] section's timeouts (`of`), and two that are not configuration."""
    request_s: float = RouterSection.request_timeout_s  # whole request, admission to last token
    first_token_s: float = RouterSection.first_token_timeout_s  # admission to first token (prefill + transfer)
    idle_s: float = RouterSection.idle_timeout_s  # silence between two chunks
    reconnect_s: float = 10.0  # silence allowed once the router's NATS connection came back: what was
    # sent around the reconnect may be lost (decode ends a request whose chunks found no inbox)
    control_s: float = RouterSection.control_timeout_s  # one control round trip (reserve, release)
    prefill_report_s: float = 1.0  # a finished request's wait for prefill's late reply (its usage counts)
    gone_recheck_s: float = 15.0  # a worker a request found not listening is not picked again by it for this
    # long, unless it leaves first: past the registry's lease (10 s), so a dead one has left the view by then,
    # while a live one that a NATS route flap hid (a node restarting) is tried again

    @classmethod
    def of(cls, router: RouterSection) -> RouterTimeouts:
        return cls(request_s=router.request_timeout_s, first_token_s=router.first_token_timeout_s,
                   idle_s=router.idle_timeout_s, control_s=router.control_timeout_s)


@dataclass(frozen=True)
class RouterPolicy:
    """The [router] section's choices for one request's path (`of`)."""
    prefill_on_decode_tokens: int = RouterSection.prefill_on_decode_tokens  # 0: always on a prefill worker

    @classmethod
    def of(cls, router: RouterSection) -> RouterPolicy:
        return cls(prefill_on_decode_tokens=router.prefill_on_decode_tokens)


class AttemptLost(Exception):
    """The current attempt failed before its first token (prefill or its transfer lost, a worker
    gone): nothing reached the client yet, so the request may start over on another pair.
    `gone`: the attempt's worker that nobody listens for any more (NotListening), if that is why."""

    def __init__(self, error: BatonError, gone: str | None = None) -> None:
        super().__init__(error.message)
        self.error, self.gone = error, gone


class NoCapacity(Exception):
    """Every decode worker refused the reservation for want of room: the request waits in the
    queue again (nothing reached the client, and prefill is released)."""


class DecodeLost(AttemptLost):
    """Decode was lost after tokens reached the client (its worker left, or it fell silent past
    the idle timeout): the request may continue on another pair from its prompt plus the tokens
    already sent, which a fresh prefill turns into the same state."""


def continued(sampling: SamplingParams, sent: int) -> SamplingParams:
    """Sampling for a continuation after `sent` tokens: min_tokens counts what is left, penalties
    count the tokens sent as output, the prompt's logprobs (reported with the first tokens) are not
    asked for again, and a seeded request gets a seed of its own for the rest, so the continuation
    does not replay the random draws of its first tokens."""
    sampling = msgspec.structs.replace(sampling, min_tokens=max(0, sampling.min_tokens - sent), prompt_logprobs=None,
                       output_in_prompt=sampling.output_in_prompt + sent)
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed * 0x9E3779B97F4A7C15 + sent) % (1 << 64))


class Flow:
    def __init__(self, bus: Bus, directory: Directory, tokens: TokenInbox, timeouts: RouterTimeouts,
                 request_id: str, token_ids: list[int], max_tokens: int, sampling: SamplingParams,
                 admission: AdmissionQueue, policy: RouterPolicy = RouterPolicy()) -> None:
        self.bus, self.directory, self.token_inbox, self.timeouts = bus, directory, tokens, timeouts
        self.admission, self.policy = admission, policy
        self.request_id, self.token_ids, self.max_tokens, self.sampling = request_id, token_ids, max_tokens, sampling
        self.attempt_id = request_id  # the id decode and prefill see; a retry gets a fresh one
        self.served_by = ""  # "prefill->decode" of the last attempt, for the request log
        self.prefill_done: PrefillDone | None = None  # prefill's own timing, for the request log
        self.prompt_logprobs: Logprobs | None = None  # from prefill, before the first tokens are yielded
        self.at = Stamps()  # stage times of the last attempt, for the request log
        self.events: asyncio.Queue = asyncio.Queue()
        self.stream_subject = ""  # where decode streams this attempt's TokenChunks
        self.decode_id: str | None = None
        self.prefill_id: str | None = None
        self.outcome = Outcome()
        self.cancelled = ""  # why the client cancelled, once it did
        self.migrated_after = 0  # tokens sent before decode was lost and the request moved on
        self._tasks: list[asyncio.Task] = []
        self._prefill_task: asyncio.Task | None = None  # the dispatch, until prefill's reply (PrefillDone)
        self._released = False
        self._targeted = False  # prefill was told where to write (else it must be released)
        self._lost = asyncio.Event()  # set when a worker of this attempt left (its error in self._lost_error)
        self._lost_error: BatonError | None = None
        self._prefilled = False
        self._avoid: set[str] = set()  # workers of a failed attempt, skipped by the retry when possible
        self._gone: dict[str, float] = {}  # workers found not listening -> until when (monotonic) they are skipped
        self._held: dict[str, int] = {}  # load this flow counts against workers in the directory
        self._prefill_work = len(token_ids)  # prompt tokens the picked prefill should compute (its cache has the rest)
        self._chains: tuple[list[int], dict] = (token_ids, {})  # the prompt's block digests, by block size
        self._first_token_by: float | None = None  # time.monotonic() by which the attempt's first token is due
        self._attempts = 0  # attempts after the first (a retry, or a wait after decode had no room)
        self.workers: dict[str, str] = {}  # id -> role of every worker asked, hidden from the client

    def cancel(self, reason: str = "cancelled") -> None:
        self.cancelled = reason  # also seen by an attempt that starts after this one
        self.admission.cancel(self.request_id)
        self.events.put_nowait(("cancel", reason))

    def stop(self) -> None:
        """A stop string matched: decode ends the request at its next step and still reports its
        counts (unlike a cancel, which ends the flow at once)."""
        self.events.put_nowait(("stop", None))

    def reconnected(self) -> None:
        """The router's NATS connection was lost and re-made: this request's messages may be lost."""
        self.events.put_nowait(("reconnected", None))

    def worker_left(self, worker_id: str, reason: str) -> None:
        """A worker this request depends on is gone: end the request (or retry it, if no token
        was sent yet) now instead of at a timeout. Prefill matters only until decode streams."""
        error = BatonError(ErrorCode.UNAVAILABLE, f"request {self.request_id}: worker {worker_id} left ({reason})")
        self._gone.pop(worker_id, None)  # one registering under this id again is a new process
        if worker_id == self.decode_id:
            self.events.put_nowait(("decode_lost", error))
        elif worker_id == self.prefill_id and not self._prefilled:
            self.events.put_nowait(("prefill_error", error))
        else:
            return
        self._lost_error = error  # and a control request still waiting on the attempt gives up now
        self._lost.set()

    async def tokens(self) -> AsyncIterator[tuple[list[int], Logprobs | None]]:
        """Yield (token ids, their logprobs if asked for) as decode produces them; `self.outcome`
        says how it ended. With prompt logprobs asked for, `self.prompt_logprobs` is set before the
        first yield. The request
        first waits its turn in the router's queue (admission.py), and waits again whenever decode
        has no room for it. One attempt that fails is retried, on other workers where there are
        any, with a fresh reservation and a fresh internal id: from the start if it failed before
        its first token, or, if decode was lost mid-stream, as a continuation (prompt + tokens
        sent, the max_tokens left)."""
        sent: list[int] = []
        retried = False
        queued_since = time.monotonic()  # since when it waits for room (decode or prefill refusals included)
        try:
            while True:
                try:
                    if self.cancelled or not await self.admission.enter(self.request_id, queued_since):
                        self.outcome.finish_reason = "abort"
                        return
                    await self._admit()
                    queued_since = None  # it got its room; a retry after a lost attempt waits anew
                    async for ids, logprobs in self._relay():
                        sent += ids
                        yield ids, logprobs
                    return
                except NoCapacity:
                    await self._end_attempt("no decode capacity")
                    self.admission.refused(self.request_id)
                    self._new_attempt_id()
                except AttemptLost as lost:
                    if retried or len(sent) >= self.max_tokens:
                        raise lost.error
                    retried, queued_since = True, time.monotonic()
                    self._avoid = {self.prefill_id, self.decode_id} - {None}
                    if lost.gone:
                        self._mark_gone(lost.gone)
                    await self._end_attempt("attempt lost")
                    self._new_attempt_id()
                    if sent:  # decode lost mid-stream: continue after what the client has
                        log.warning("%s; continuing on other workers after %d tokens", lost.error.message, len(sent))
                        self.token_ids, self.max_tokens = self.token_ids + sent, self.max_tokens - len(sent)
                        self.sampling = continued(self.sampling, len(sent))
                        self.migrated_after = len(sent)
                    else:
                        log.warning("%s; retrying once on other workers", lost.error.message)
        except BatonError as exc:
            self.outcome.error = self._for_client(exc)
        finally:
            self.admission.leave(self.request_id)
            await self._end_attempt(self.outcome.finish_reason or "error")

    def _for_client(self, error: BatonError) -> BatonError:
        """`error` without the internal ids of the workers involved (logged here, with them)."""
        message = error.message
        for worker_id, role in self.workers.items():
            message = message.replace(worker_id, f"<{role}>")
        if message != error.message:
            log.warning("request %s failed: %s", self.request_id, error.message)
        return BatonError(error.code, message)

    def _new_attempt_id(self) -> None:
        """Workers may still hold the ended attempt's id for a moment (prefill until its release)."""
        self._attempts += 1
        self.attempt_id = f"{self.request_id[:52]}-try{self._attempts}"

    async def _end_attempt(self, reason: str) -> None:
        dispatched = self._prefill_task is not None
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._prefill_task = None
        for worker_id in list(self._held):
            self._unhold(worker_id)
        if self.outcome.finish_reason not in ("length", "stop"):
            await self._release(reason)
        if self.prefill_id is not None and dispatched and not self._targeted:
            await self._release_on(subjects.prefill_release(self.prefill_id), self.prefill_id, reason)
        self.token_inbox.close(self.stream_subject)
        self.decode_id = self.prefill_id = None
        self._released = self._targeted = self._prefilled = False
        self.events = asyncio.Queue()
        self._lost, self._lost_error = asyncio.Event(), None

    def _hold(self, worker_id: str, amount: int) -> None:
        self._held[worker_id] = amount
        self.directory.add_outstanding(worker_id, amount)

    def _unhold(self, worker_id: str) -> None:
        self.directory.add_outstanding(worker_id, -self._held.pop(worker_id, 0))

    # --- admission ------------------------------------------------------------------------
    async def _admit(self) -> None:
        self.at.mark("admit")
        self._first_token_by = time.monotonic() + self.timeouts.first_token_s  # for every stage before it
        self.stream_subject = self.token_inbox.open(self.events)
        self.prefill_id = self._pick_prefill(await self.directory.known("prefill"))
        self.workers[self.prefill_id] = "prefill"
        if self._may_prefill_on_decode():
            reservation, plan = await self._reserve(self.prefill_id, ask_to_prefill=True)
            if reservation.prefilled_here:
                self._keep_in_prefix_cache(self.prefill_id)
                self.prefill_id, self._prefilled = None, True  # nothing to dispatch, target or release there
                self.served_by = f"{self.decode_id} (prefilled there)"
                return
            self._dispatch()
        else:
            self._dispatch()
            await Bus.let_out()  # the dispatch (the critical path) goes out before the reservation
            reservation, plan = await self._reserve(self.prefill_id)
        await self._target(reservation, plan)

    def _dispatch(self) -> None:
        self._hold(self.prefill_id, self._prefill_work)  # counted now, so concurrent picks spread out
        self._prefill_task = asyncio.create_task(self._prefill(self.prefill_id), name=f"prefill {self.request_id}")
        self._tasks.append(self._prefill_task)

    def _keep_in_prefix_cache(self, prefill_id: str) -> None:
        """Decode computes the prompt; an idle prefill computes it too, only for its prefix cache
        (the next turn of a conversation extends this prompt). Nothing waits for it."""
        if self.directory.outstanding(prefill_id):
            return  # busy with this router's prompts: the cache would cost them time

        async def keep() -> None:
            try:
                await self.bus.request(subjects.prefill_dispatch(prefill_id), PrefillDispatch(
                    request_id=f"{self.request_id[:52]}-cache{self._attempts}", token_ids=self.token_ids,
                    sampling=self.sampling, cache_only=True), PrefillDone, timeout=self.timeouts.first_token_s,
                    joined_at=self.directory.joined_at(prefill_id))
            except BatonError as exc:  # the request does not depend on it
                log.info("request %s: prefill did not keep the prompt in its cache: %s", self.request_id, exc)
        self._tasks.append(asyncio.create_task(keep(), name=f"cache {self.request_id}"))

    def _may_prefill_on_decode(self) -> bool:
        """A short prompt that the picked prefill holds no prefix of (a cached one is cheaper
        there), without prompt logprobs (prefill's reply carries those): decode may compute it."""
        n = len(self.token_ids)
        return (0 < n <= self.policy.prefill_on_decode_tokens and self._prefill_work == n
                and self.sampling.prompt_logprobs is None)

    def _mark_gone(self, worker_id: str) -> None:
        """`worker_id` did not answer: no one listens on its subjects (NotListening)."""
        self._gone[worker_id] = time.monotonic() + self.timeouts.gone_recheck_s

    def _prefer_others(self, workers: list) -> list:
        """`workers` but those found gone (for `gone_recheck_s`); those of a failed attempt only if
        there is no other. Without one, the request waits in the queue (a gone worker's successor
        registers, or the recheck time passes)."""
        now = time.monotonic()
        workers = [w for w in workers if self._gone.get(w.registration.worker_id, 0.0) <= now]
        others = [w for w in workers if w.registration.worker_id not in self._avoid]
        return others or workers

    def _pick_prefill(self, registered: list) -> str:
        workers = self._prefer_others([w for w in registered if not w.load.draining])
        if not workers:  # one may register (a restart): wait in the queue, bounded by its timeout
            log.info("request %s waits: %s", self.request_id, "no prefill worker is registered" if not registered
                     else f"all {len(registered)} prefill workers are stopping or gone")
            raise NoCapacity()
        affinity = self.directory.affinity
        overlap = affinity.overlap(self.token_ids, self._digests())
        best = min(workers, key=lambda w: affinity.cost(
            w.load.queued_prompt_tokens + self.directory.outstanding(w.registration.worker_id), len(self.token_ids),
            overlap.get(w.registration.worker_id, 0)))
        chosen = best.registration.worker_id
        self._prefill_work = len(self.token_ids) - overlap.get(chosen, 0)  # tokens it should compute
        return chosen

    def _digests(self) -> dict[int, list[int]]:
        """The prompt's block digests by block size, for both caches' indexes (a continuation's
        prompt is a new list: its digests are computed anew)."""
        if self._chains[0] is not self.token_ids:
            self._chains = (self.token_ids, {})
        return self._chains[1]

    async def _reserve(self, prefill_id: str, ask_to_prefill: bool = False) -> tuple[ReserveReply, TransferPlan]:
        """A reservation on the first decode that has room. With `ask_to_prefill`, one that this
        router has nothing in flight on and whose turn cache holds no prefix of the prompt is asked
        to compute the prompt itself (its reply says whether it does)."""
        turns = self.directory.turns.overlap(self.token_ids, self._digests())  # decodes holding its last turn
        decodes = sorted(self._prefer_others(await self.directory.known("decode")),  # free slots first, then least loaded
                         key=lambda w: (w.load.free_slots == 0, self.directory.outstanding(w.registration.worker_id)
                                        - self.directory.turns.bonus(turns.get(w.registration.worker_id, 0)),
                                        -w.load.free_pages))
        if not decodes:  # one may register (a restart): wait in the queue, bounded by its timeout
            log.info("request %s waits: no decode worker is registered (or every one is gone)", self.request_id)
            raise NoCapacity()
        last, room_may_come = None, False
        for worker in decodes:
            decode_id = worker.registration.worker_id
            self.workers[decode_id] = "decode"
            here = ask_to_prefill and self.directory.outstanding(decode_id) == 0 and not turns.get(decode_id)
            self._hold(decode_id, 1)
            try:
                plan = await self.directory.plan(prefill_id, decode_id)
                self.at.mark("reserve")
                reply = await self.bus.request(subjects.decode_reserve(decode_id), ReserveRequest(
                    request_id=self.attempt_id, token_ids=self.token_ids, max_tokens=self.max_tokens,
                    sampling=self.sampling, stream_subject=self.stream_subject, prefill_worker_id=prefill_id,
                    components=plan.components,
                    draft_state=plan.draft_state, prefill_here=here), ReserveReply, timeout=self.timeouts.control_s,
                    joined_at=self.directory.joined_at(decode_id))
            except BatonError as exc:
                self._unhold(decode_id)
                last = exc
                if isinstance(exc, NotListening):
                    self._mark_gone(decode_id)
                room_may_come |= exc.code in (ErrorCode.BUSY, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT)
                if exc.code is ErrorCode.TIMEOUT:  # a stalled decode may still reserve it once it wakes up
                    await self._forget_reservation(decode_id)
                if exc.code in (ErrorCode.BUSY, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.TOO_LARGE):
                    continue  # too_large: this decode could never hold it, another may
                if exc.code is ErrorCode.INTERNAL:  # e.g. decode could not load this prefill's metadata:
                    raise AttemptLost(exc) from None  # the pair failed, not the request; retried on others
                raise
            self.at.mark("reserved")
            self.decode_id = decode_id
            self.served_by = f"{prefill_id}->{decode_id}"
            return reply, plan
        if room_may_come:
            log.info("request %s waits again: no decode worker has room (%s)", self.request_id, last.message)
            raise NoCapacity()
        raise last

    async def _forget_reservation(self, decode_id: str) -> None:
        """Ask decode to release this attempt, without waiting for an answer it may not give."""
        try:
            await self.bus.publish(subjects.decode_release(decode_id), ReleaseRequest(
                request_id=self.attempt_id, reason="reservation timed out", finish_reason="abort"))
        except BatonError as exc:
            log.warning("release of %s on %s failed: %s", self.request_id, decode_id, exc)

    async def _prefill(self, prefill_id: str) -> None:
        try:
            done = await self.bus.request(subjects.prefill_dispatch(prefill_id), PrefillDispatch(
                request_id=self.attempt_id, token_ids=self.token_ids, sampling=self.sampling,
                first_token_to=self.stream_subject if self._first_token_ahead() else None), PrefillDone,
                timeout=self.timeouts.first_token_s, joined_at=self.directory.joined_at(prefill_id))
            self._prefilled = True
            self.at.mark("prefill_reply")
            self.prefill_done = done
            self.events.put_nowait(("prefilled", done))
        except BatonError as exc:
            self.events.put_nowait(("prefill_error", exc))
        finally:
            self._unhold(prefill_id)

    def _first_token_ahead(self) -> bool:
        """Prefill streams the first token as soon as it is sampled, ahead of the transfer, unless
        its logprobs are asked for (decode computes them from the state it receives) or it is the
        only token (a transfer that failed after it would leave nothing to continue)."""
        return self.max_tokens > 1 and self.sampling.logprobs is None and self.sampling.prompt_logprobs is None

    async def _target(self, reservation: ReserveReply, plan: TransferPlan) -> None:
        """Tell prefill where to WRITE the state it is computing; a failure, or a worker of the
        attempt leaving meanwhile, loses the attempt."""
        try:
            await self._unless_lost(self.bus.request(subjects.prefill_target(self.prefill_id), PrefillTarget(
                request_id=self.attempt_id, decode_worker_id=reservation.decode_worker_id,
                decode_allocation=reservation.allocation, transfer_plan=plan), Ack,
                timeout=self._until_first_token()))  # as long as the dispatch may take: prefill may be stalled
        except BatonError as exc:
            raise AttemptLost(exc, self.prefill_id if isinstance(exc, NotListening) else None) from None
        self._targeted = True
        self.at.mark("targeted")

    def _until_first_token(self) -> float:
        """Seconds left before the attempt's first token is due: first_token_s bounds the attempt's
        dispatch, target and first chunk together, not each of them (all of it before `_admit` set it)."""
        if self._first_token_by is None:
            return self.timeouts.first_token_s
        return max(self._first_token_by - time.monotonic(), 0.0)

    async def _unless_lost(self, request: Awaitable):
        """`request`'s answer, or its BatonError; the error of a worker of this attempt that left
        first (its "left" event ends the wait, not the request's own timeout)."""
        pending = asyncio.ensure_future(request)
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({pending, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not pending.done():
                pending.cancel()
        if pending.done() and not pending.cancelled():
            return pending.result()
        raise self._lost_error

    # --- relay ----------------------------------------------------------------------------
    def _awaits_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None

    async def _relay(self) -> AsyncIterator[tuple[list[int], Logprobs | None]]:
        """Chunks arrive in order (`seq` checked); those that come before prefill's reply when the
        prompt's logprobs (in that reply) are asked for are held until it arrives: nothing reaches
        the client before them. The first token may come twice, from prefill ahead of the transfer
        and from decode once the state landed: the first to come is relayed. Until decode's own
        chunks come, the state may still be lost with only that token sent: the request then
        continues after it elsewhere (DecodeLost)."""
        started, got_first, expected_seq, stopping = time.monotonic(), False, 0, False
        decoding = False  # decode's chunks have come: it holds the whole state
        ahead: list[int] | None = None  # the first token as prefill sent it, before decode's chunks
        held: list[TokenChunk] = []
        suspect = False  # since the last reconnect nothing came: what we wait for may have been lost
        while True:
            limit = self.timeouts.idle_s if got_first else self._until_first_token()
            limit = min(limit, self.timeouts.reconnect_s) if suspect else limit
            remaining = min(limit, self.timeouts.request_s - (time.monotonic() - started))
            try:
                async with asyncio.timeout(max(remaining, 0.0)):  # unlike wait_for, no task per event
                    kind, value = await self.events.get()
            except TimeoutError:
                whole, first = remaining < limit, not (got_first or suspect)
                within = (f"{self.timeouts.request_s:g} s" if whole else
                          f"{self.timeouts.first_token_s:g} s of its admission" if first else f"{limit:g} s")
                error = BatonError(ErrorCode.TIMEOUT, f"request {self.request_id}: no token within {within}")
                if suspect:
                    raise (DecodeLost(error) if got_first else AttemptLost(error)) from None
                raise DecodeLost(error) if got_first and remaining >= limit else error from None
            suspect = kind == "reconnected"
            if suspect:
                continue
            if kind == "cancel":
                self.outcome.finish_reason = "abort"
                return
            if kind == "stop" and not decoding:  # prefill's first token matched: decode has nothing to count
                await self._release("stop string")
                self.outcome.finish_reason = "stop"
                await self._prefill_reply()
                return
            if kind == "stop":  # wait for decode's last chunk, with the counts; tokens after it are dropped
                stopping = True
                await self._release("stop string", "stop")
                continue
            if kind == "prefill_error" and decoding:
                # Decode streams only once every WRITE notified and the aux tag matched: it holds
                # the whole state, so a late sender-side failure (e.g. a completion it never saw)
                # does not concern this request.
                log.warning("request %s: prefill reported %s after decode started; continuing",
                            self.request_id, value.code.value)
                continue
            if kind == "decode_lost" and got_first:
                raise DecodeLost(value)
            if kind in ("error", "prefill_error", "decode_lost"):
                gone = self.prefill_id if kind == "prefill_error" and isinstance(value, NotListening) else None
                if got_first and not decoding:  # only prefill's first token reached the client
                    raise DecodeLost(value, gone)
                raise value if got_first else AttemptLost(value, gone)
            ready: list[TokenChunk] = []
            if kind == "prefilled" and self._awaits_prompt_logprobs():
                self.prompt_logprobs = value.prompt_logprobs or Logprobs()
                ready, held = held, []
            elif kind == "chunk" and self._awaits_prompt_logprobs():
                held.append(value)
            elif kind == "chunk":
                ready = [value]
            for chunk in ready:
                if chunk.source == "prefill" and expected_seq:  # decode's copy came first
                    continue
                if chunk.source == "decode" and not decoding:
                    decoding = True
                    if ahead is not None and chunk.seq == 0:  # prefill's copy came first
                        if chunk.token_ids != ahead:
                            raise BatonError(ErrorCode.INTERNAL, f"request {self.request_id}: decode's first "
                                             f"token {chunk.token_ids} is not prefill's {ahead}")
                        continue
                if chunk.seq != expected_seq:  # e.g. NATS restarted: continue after what the client has
                    lost = BatonError(ErrorCode.UNAVAILABLE, f"request {self.request_id}: token chunk "
                                      f"{expected_seq} lost (got {chunk.seq})")
                    raise DecodeLost(lost) if got_first else AttemptLost(lost)
                expected_seq += 1
                if chunk.source == "prefill":
                    ahead = chunk.token_ids
                if chunk.token_ids and not got_first:
                    self.at.mark("first_chunk")
                got_first = got_first or bool(chunk.token_ids)
                if chunk.token_ids and not stopping:
                    yield chunk.token_ids, chunk.logprobs
                if chunk.finished:
                    self.outcome.finish_reason = chunk.finish_reason
                    self.outcome.spec = {"verify_steps": chunk.spec.verify_steps, "drafted": chunk.spec.drafted,
                                         "accepted": chunk.spec.accepted}
                    self._released = chunk.finish_reason != "error"
                    await self._prefill_reply()
                    return

    async def _prefill_reply(self) -> None:
        """Wait a little for prefill's reply if decode finished first: prefill answers once it sees
        its WRITE complete, which decode may see sooner, and a short request can be done by then.
        Its counts (the cached prompt tokens in the client's usage, the request log's timing)
        would be lost when the attempt ends."""
        task = self._prefill_task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=self.timeouts.prefill_report_s)
            if not task.done():
                log.warning("request %s: prefill's reply did not come within %g s of the last token; "
                            "answered without its counts", self.request_id, self.timeouts.prefill_report_s)

    async def _release(self, reason: str, finish_reason: str = "abort") -> None:
        if self._released or self.decode_id is None:
            return
        self._released = True
        await self._release_on(subjects.decode_release(self.decode_id), self.decode_id, reason, finish_reason)

    async def _release_on(self, subject: str, worker_id: str, reason: str, finish_reason: str = "abort") -> None:
        try:
            await self.bus.request(subject, ReleaseRequest(request_id=self.attempt_id, reason=reason,
                                                           finish_reason=finish_reason), Ack,
                                   timeout=self.timeouts.control_s)
        except BatonError as exc:
            log.warning("release of %s on %s failed: %s", self.request_id, worker_id, exc)
