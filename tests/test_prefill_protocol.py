"""Prefill's side of the pipelined dispatch, with real processes: the router dispatches a prompt
and reserves decode slots at once, and sends the target (or a release) afterwards. A dispatch that
never gets a target, or gets a release, or a reservation that fails, must never leave prefill
holding slots; a bad target is refused with bad_request."""
import asyncio
import time

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (Ack, LookupReply, LookupRequest, PrefillDispatch, PrefillDone, PrefillTarget,
                                  ReleaseRequest, SamplingParams)
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from e2e_cluster import running_cluster, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
DEADLINE_S = 8.0  # the workers' transfer deadline: how long prefill holds a state with no target


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_WORKER_TRANSFER_DEADLINE_S", str(DEADLINE_S))
        with running_cluster(worker_args=["--num-pages", "8"]) as c:  # 128 positions per worker
            yield c


async def prefill_id(bus: Bus) -> str:
    reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
    return next(w.registration.worker_id for w in reply.workers if w.registration.role == "prefill")


def dispatch(request_id: str) -> PrefillDispatch:
    return PrefillDispatch(request_id=request_id, token_ids=list(range(1, 17)), sampling=SamplingParams())


async def outcome(coro):
    try:
        return await coro
    except BatonError as exc:
        return exc


def test_failed_reservation_releases_prefill_at_once(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            # decode needs 16 + 400 + k + 1 positions (27 pages of 16): more than its 8; prefill needs 1
            got = await outcome(bus.request(subjects.GENERATE, GenerateRequest(token_ids=list(range(1, 17)),
                                                                               max_tokens=400), GenerateReply, timeout=30))
            assert isinstance(got, BatonError) and got.code is ErrorCode.BUSY, got
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)  # not only after the deadline
    asyncio.run(run())


def test_dispatch_without_target_times_out_and_frees(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await prefill_id(bus)
            started = time.monotonic()
            got = await outcome(bus.request(subjects.prefill_dispatch(worker), dispatch("no-target"), PrefillDone,
                                            timeout=DEADLINE_S + 20))
            assert isinstance(got, BatonError) and got.code is ErrorCode.TIMEOUT, got
            assert time.monotonic() - started >= DEADLINE_S - 0.5
        await wait_all_free(cluster.nats_url)
    asyncio.run(run())


def test_release_ends_a_dispatch_and_frees(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await prefill_id(bus)
            pending = asyncio.create_task(outcome(bus.request(subjects.prefill_dispatch(worker), dispatch("released"),
                                                              PrefillDone, timeout=DEADLINE_S + 20)))
            await asyncio.sleep(0.5)  # computed by now, waiting for its target
            await bus.request(subjects.prefill_release(worker), ReleaseRequest(request_id="released", reason="test"), Ack)
            got = await asyncio.wait_for(pending, DEADLINE_S / 2)
            assert isinstance(got, BatonError) and got.code is ErrorCode.UNAVAILABLE, got
        await wait_all_free(cluster.nats_url, timeout_s=DEADLINE_S / 2)
    asyncio.run(run())


def test_bad_target_is_refused(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            worker = await prefill_id(bus)
            bad = PrefillTarget(request_id="bad", decode_worker_id="decode-x", decode_allocation={"pages": "no"},
                                transfer_plan={"pairs": 3})
            got = await outcome(bus.request(subjects.prefill_target(worker), bad, Ack))
            assert isinstance(got, BatonError) and got.code is ErrorCode.BAD_REQUEST, got
            # the service keeps serving
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[5, 6, 7], max_tokens=4),
                                      GenerateReply, timeout=30)
            assert len(reply.token_ids) == 4
    asyncio.run(run())
