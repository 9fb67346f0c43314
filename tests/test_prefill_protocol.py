"""Prefill's side of the pipelined dispatch, with real processes: the router dispatches a prompt
and reserves decode slots at once, and sends the target (or a release) afterwards. A dispatch that
never gets a target, or gets a release, or a reservation that fails, must never leave prefill
holding slots; a bad target is refused with bad_request."""
import asyncio

import pytest

from baton.proto import subjects
from baton.proto.codec import decode
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (Ack, LookupReply, LookupRequest, PlanReply, PlanRequest, PrefillDispatch,
                                  PrefillDone, PrefillTarget, PrefixEvents, PrefixQuery, ReleaseRequest,
                                  SamplingParams)
from baton.proto.public import GenerateReply, GenerateRequest
from baton.services.router.affinity import PrefixAffinity
from baton.shared.bus import Bus
from baton.shared.kv.prefix_hash import digests
from e2e_cluster import running_cluster, until, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
DEADLINE_S = 8.0  # the workers' transfer deadline: how long prefill holds a state with no target


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_WORKER_TRANSFER_DEADLINE_S", str(DEADLINE_S))
        with running_cluster(worker_args=["--num-pages", "8"]) as c:  # 128 positions per worker
            yield c


async def worker_id(bus: Bus, role: str = "prefill") -> str:
    reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
    return next(w.registration.worker_id for w in reply.workers if w.registration.role == role)


def dispatch(request_id: str, first: int = 1) -> PrefillDispatch:
    """16 prompt tokens from `first`: a test that waits for prefill to compute gives its own, which
    no earlier dispatch left in the prefix cache."""
    return PrefillDispatch(request_id=request_id, token_ids=list(range(first, first + 16)), sampling=SamplingParams())


def computed_tokens(cluster) -> float:
    """Prompt tokens the prefill workers computed so far (their /metrics)."""
    from test_e2e_generate import scrape
    return sum(scrape(m["port"]).get("baton_prefill_computed_tokens_total", 0.0)
               for m in cluster.metrics if m["role"] == "prefill")


async def until_computed(cluster, before: float, timeout_s: float = 30.0) -> None:
    """Until prefill computed more than `before` tokens: the dispatch waits for its target now."""
    async def computed() -> bool:
        return computed_tokens(cluster) > before
    await until(computed, timeout_s, "prefill computing the dispatch", every_s=0.02)


async def outcome(coro):
    try:
        return await coro
    except BatonError as exc:
        return exc


def test_failed_reservation_releases_prefill_at_once(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            # decode needs 16 + 400 + k + 1 positions (27 pages of 16): more than its 8 could ever hold,
            # so the answer is too_large at once (not busy, which would mean "wait in the queue"); prefill needs 1
            got = await outcome(bus.request(subjects.GENERATE, GenerateRequest(token_ids=list(range(1, 17)),
                                                                               max_tokens=400), GenerateReply, timeout=30))
            assert isinstance(got, BatonError) and got.code is ErrorCode.TOO_LARGE, got
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)  # not only after the deadline
    asyncio.run(run())


def test_dispatch_without_target_times_out_and_frees(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await worker_id(bus)
            got = await outcome(bus.request(subjects.prefill_dispatch(worker), dispatch("no-target"), PrefillDone,
                                            timeout=DEADLINE_S + 20))
            assert isinstance(got, BatonError) and got.code is ErrorCode.TIMEOUT, got
            # prefill's own transfer deadline ended it (not this request's timeout, nor anything sooner)
            assert f"no target within {DEADLINE_S:g} s" in got.message, got
        await wait_all_free(cluster.nats_url)
    asyncio.run(run())


def test_release_ends_a_dispatch_and_frees(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker, before = await worker_id(bus), computed_tokens(cluster)
            pending = asyncio.create_task(outcome(bus.request(subjects.prefill_dispatch(worker), dispatch("released", 100),
                                                              PrefillDone, timeout=DEADLINE_S + 20)))
            await until_computed(cluster, before)
            await bus.request(subjects.prefill_release(worker), ReleaseRequest(request_id="released", reason="test"), Ack)
            got = await asyncio.wait_for(pending, DEADLINE_S / 2)
            assert isinstance(got, BatonError) and got.code is ErrorCode.UNAVAILABLE, got
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)
    asyncio.run(run())


def test_bad_target_is_refused(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await worker_id(bus)
            bad = PrefillTarget(request_id="bad", decode_worker_id="decode-x", decode_allocation={"pages": "no"},
                                transfer_plan={"pairs": 3})
            got = await outcome(bus.request(subjects.prefill_target(worker), bad, Ack))
            assert isinstance(got, BatonError) and got.code is ErrorCode.BAD_REQUEST, got
            # the service keeps serving
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[5, 6, 7], max_tokens=4),
                                      GenerateReply, timeout=30)
            assert len(reply.token_ids) == 4
    asyncio.run(run())


@pytest.mark.parametrize("target_first", [True, False], ids=["target-before-compute-ends", "target-after"])
def test_target_that_does_not_fit_fails_only_its_request_and_frees(cluster, target_first):
    from baton.shared.kv.components import Allocation

    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            prefill, decode = await worker_id(bus), await worker_id(bus, "decode")
            plan = (await bus.request(subjects.PLAN, PlanRequest(prefill_worker_id=prefill, decode_worker_id=decode),
                                      PlanReply)).plan
            empty = Allocation(request_id="misfit", num_tokens=0, length=0, floor=0, slot=0, page_ids=())
            target = PrefillTarget(request_id="misfit", decode_worker_id=decode, decode_allocation=empty,
                                   transfer_plan=plan)  # holds none of the prompt's positions
            if target_first:
                await bus.request(subjects.prefill_target(prefill), target, Ack)
            before = computed_tokens(cluster)
            pending = asyncio.create_task(outcome(bus.request(subjects.prefill_dispatch(prefill), dispatch("misfit", 200 if target_first else 300),
                                                              PrefillDone, timeout=DEADLINE_S + 20)))
            if not target_first:
                await until_computed(cluster, before)
                await bus.request(subjects.prefill_target(prefill), target, Ack)
            got = await asyncio.wait_for(pending, DEADLINE_S / 2)
            assert isinstance(got, BatonError) and got.code is ErrorCode.BAD_REQUEST, got
            assert "does not fit" in got.message
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[5, 6, 7], max_tokens=4),
                                      GenerateReply, timeout=30)
            assert len(reply.token_ids) == 4
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)
    asyncio.run(run())


@pytest.mark.parametrize("token_ids", [[], [10**6], [5] * 16_000], ids=["empty", "outside-vocabulary", "over-context"])
def test_bad_prompt_is_refused_before_it_takes_slots(cluster, token_ids):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await worker_id(bus)
            bad = PrefillDispatch(request_id="bad-prompt", token_ids=token_ids, sampling=SamplingParams())
            got = await outcome(bus.request(subjects.prefill_dispatch(worker), bad, PrefillDone, timeout=10))
            assert isinstance(got, BatonError) and got.code is ErrorCode.BAD_REQUEST, got
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)
    asyncio.run(run())


def test_prefill_tells_routers_what_its_prefix_cache_holds(cluster):
    """A computed prompt's end is published as PrefixEvents with the digest a router computes from
    the same tokens; a snapshot lists it too, and a router index fed the snapshot finds the worker."""
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await worker_id(bus)
            before = await bus.request(subjects.prefill_prefixes(worker), PrefixQuery(), PrefixEvents)
            assert before.snapshot and before.worker_id == worker and not before.evicted
            published: asyncio.Queue[PrefixEvents] = asyncio.Queue()

            async def on_events(msg):
                published.put_nowait(decode(msg.data, PrefixEvents))
            await bus.subscribe(subjects.PREFIX_EVENTS, on_events)
            await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)  # the subscription is on the server
            prompt = list(range(3, 43))  # 40 tokens
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=prompt, max_tokens=4),
                                      GenerateReply, timeout=60)
            assert len(reply.token_ids) == 4
            async with asyncio.timeout(10):  # the message of the batch that computed it
                events = await published.get()
                while not any(e.tokens == len(prompt) for e in events.added):
                    events = await published.get()
            assert events.worker_id == worker and events.seq > before.seq and events.block == 16
            held = next(e for e in events.added if e.tokens == len(prompt))
            assert held.digest == digests(prompt, 16, held.blocks)[-1] and held.blocks >= 1
            after = await bus.request(subjects.prefill_prefixes(worker), PrefixQuery(), PrefixEvents)
            assert held in after.added and after.seq >= events.seq
            index = PrefixAffinity()  # a router that starts now
            assert index.apply(after) and index.overlap(prompt + [9] * 20) == {worker: len(prompt)}
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)
    asyncio.run(run())
