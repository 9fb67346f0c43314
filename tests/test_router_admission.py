"""The router's waiting queue (pure logic: no bus, capacity given by hand)."""
import asyncio
import time

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.services.router.admission import AdmissionQueue
from baton.services.router.flow import Flow, RouterTimeouts
from baton.proto.internal import SamplingParams
from baton.shared.metrics import ServiceMetrics
from e2e_cluster import until

pytestmark = pytest.mark.unit


def queue(capacity: int | None = 1, max_queued: int = 2, max_queue_s: float = 30.0) -> AdmissionQueue:
    return AdmissionQueue(lambda: capacity, max_queued, max_queue_s, ServiceMetrics("router"))


def test_requests_beyond_capacity_wait_and_are_admitted_first_in_first_out():
    async def run():
        q, admitted = queue(capacity=1, max_queued=3), []
        assert await q.enter("a")

        async def wait(rid):
            assert await q.enter(rid)
            admitted.append(rid)
        waiters = [asyncio.create_task(wait(r)) for r in "bcd"]
        await until(lambda: len(q.waiting) == 3, 5, "b, c and d waiting", every_s=0)
        for done in "abc":
            q.leave(done)
            await until(lambda: len(admitted) == "abc".index(done) + 1, 5, f"the next admitted after {done} left",
                        every_s=0)
        await asyncio.gather(*waiters)
        assert admitted == ["b", "c", "d"] and q.metrics.queued._value.get() == 0
    asyncio.run(run())


def test_a_full_queue_answers_busy_at_once():
    async def run():
        q = queue(capacity=1, max_queued=1)
        await q.enter("a")
        waiter = asyncio.create_task(q.enter("b"))
        await until(lambda: "b" in q.waiting, 5, "b waiting", every_s=0)
        with pytest.raises(BatonError) as full:
            await q.enter("c")
        assert full.value.code is ErrorCode.BUSY and "queue is full" in full.value.message
        q.leave("a")
        assert await waiter
    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue_at_once():
    async def run():
        q = queue(capacity=1)
        await q.enter("a")
        waiter = asyncio.create_task(q.enter("b"))
        await until(lambda: "b" in q.waiting, 5, "b waiting", every_s=0)
        q.cancel("b")
        assert await waiter is False and not q.waiting
        q.leave("a")
        assert q.admitted == set()
    asyncio.run(run())


def test_waiting_longer_than_max_queue_s_is_a_timeout():
    async def run():
        q = queue(capacity=1, max_queue_s=0.05)
        await q.enter("a")
        with pytest.raises(BatonError) as late:
            await q.enter("b")
        assert late.value.code is ErrorCode.TIMEOUT and not q.waiting
    asyncio.run(run())


def test_a_request_decode_refused_waits_first_in_line():
    async def run():
        q = queue(capacity=2)
        await q.enter("a")
        await q.enter("b")
        later = asyncio.create_task(q.enter("c"))
        await until(lambda: "c" in q.waiting, 5, "c waiting", every_s=0)
        q.refused("b")  # decode had no room after all: b goes before c
        assert list(q.waiting) == ["b", "c"]
        q.leave("a")
        assert await q.enter("b") and await later is True  # a's place went to b, and c fits too
    asyncio.run(run())


def test_unknown_capacity_admits_without_waiting():
    async def run():
        q = queue(capacity=None, max_queued=0)
        assert all([await q.enter(r) for r in "abc"])
    asyncio.run(run())


def test_errors_for_the_client_name_no_worker():
    f = Flow(None, None, None, RouterTimeouts(), "r", [1], 4, SamplingParams(), queue())
    f.workers = {"decode-7f3a": "decode", "prefill-91c2": "prefill"}
    error = f._for_client(BatonError(ErrorCode.TIMEOUT, "no reply from baton.internal.v1.decode.decode-7f3a.reserve "
                                     "within 5 s; prefill prefill-91c2"))
    assert error.code is ErrorCode.TIMEOUT and "7f3a" not in error.message and "91c2" not in error.message


def test_a_refused_request_is_retried_even_when_the_timer_fires_a_tick_early():
    """asyncio may run a call_later handle up to a clock tick before its time; the retry after a
    refusal must admit the request then too (before, it waited until max_queue_s)."""
    async def run():
        q = queue(capacity=1)
        assert await q.enter("a")
        q.refused("a")  # decode had no room yet: "a" waits at the head, paused for RETRY_S
        q._paused_until += 3600  # as if the retry timer ran before the pause's end by the clock
        assert await asyncio.wait_for(q.enter("a"), 5)
    asyncio.run(run())


def test_a_request_refused_again_and_again_times_out_at_max_queue_s_from_when_it_began_waiting():
    """Decode (or a missing prefill) refuses it every time it is admitted: each wait is short, but
    together they are bounded by max_queue_s (before, every refusal started a fresh max_queue_s,
    so such a request could wait, silent, for as long as the refusals went on)."""
    async def run():
        q = queue(capacity=1, max_queue_s=30.0)
        began = time.monotonic() - 30.5  # it has been refused for 30.5 s already
        assert await q.enter("a", began)  # room: admitted, however long it waited
        q.refused("a")  # and refused once more: its next wait is over at once (before RETRY_S)
        with pytest.raises(BatonError) as late:
            await asyncio.wait_for(q.enter("a", began), 5)  # not 30 s more
        assert late.value.code is ErrorCode.TIMEOUT and not q.waiting
    asyncio.run(run())
