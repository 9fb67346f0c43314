"""TransferAgent with real NIXL agents inside one process: bad input gives clear errors (never a
crash), lazy peers, cancellation. Cross-process behaviour is in test_transfer_integration.py."""
from __future__ import annotations

import asyncio
import threading
import time
import weakref

import numpy as np
import pytest

from baton.shared.transfer import (AUX_KEY, Descriptor, EventKind, Faults, PeerInfo, Region,
                                   TransferAgent, TransferStatus)
from baton.shared.transfer.nixl_thread import NixlThread
from e2e_cluster import until

pytestmark = pytest.mark.integration

ITEM = 1024


class Pools:
    def __init__(self):
        self.full = np.arange(8 * ITEM, dtype=np.int64).astype(np.uint8)
        self.aux = np.zeros(4 * 64, np.uint8)
        self.regions = [Region("full", 0, self.full.ctypes.data, self.full.nbytes, ITEM),
                        Region(AUX_KEY, 0, self.aux.ctypes.data, self.aux.nbytes, 64)]


PLAN = [Descriptor("full", 0, 0, 2 * ITEM, 2 * ITEM), Descriptor(AUX_KEY, 0, 0, 64, 64)]


async def pair(lazy: bool = False):
    """Sender "a" and receiver "b"; `lazy`: each finds the other through a registry lookup."""
    a_pools, b_pools = Pools(), Pools()
    registry: dict[str, PeerInfo] = {}

    async def lookup(name):
        return registry.get(name)

    a = TransferAgent("a", a_pools.regions, lookup=lookup if lazy else None)
    b = TransferAgent("b", b_pools.regions, lookup=lookup if lazy else None)
    registry.update(a=PeerInfo("a", a.metadata(), a_pools.regions), b=PeerInfo("b", b.metadata(), b_pools.regions))
    if not lazy:
        await b.add_peer("a", a.metadata(), a_pools.regions)
        await a.add_peer("b", b.metadata(), b_pools.regions)
    return a, b, a_pools, b_pools


def test_region_registered_twice_is_refused_before_nixl():
    p = Pools()
    with pytest.raises(ValueError, match="registered twice"):
        TransferAgent("dup", p.regions + [p.regions[0]])


def test_a_negative_number_of_copy_threads_is_refused():
    with pytest.raises(ValueError, match="copy_threads must be >= 0, got -1"):
        TransferAgent("negative", Pools().regions, copy_threads=-1)


def test_closing_tears_the_nixl_agent_down_on_its_own_thread():
    """NIXL is not thread safe: an agent destroyed later, by a garbage collection on another
    thread, could tear UCX down while other agents in the process work. After WRITEs and an
    error that crossed from the NIXL thread, closing leaves no reference to it elsewhere."""
    died = []

    async def run():
        a, b, _, _ = await pair()
        watched = [weakref.ref(agent._sender.items["DRAM"]._agent, lambda _: died.append(threading.current_thread().name))
                   for agent in (a, b)]
        assert (await a.write("b", PLAN, 1, 5.0)).ok
        with pytest.raises(ValueError, match="cannot add peer") as refused:  # kept past close
            await a.add_peer("c", b"not metadata", [])
        for agent in (a, b):
            await agent.close()
        return watched, refused

    watched, refused = asyncio.run(run())
    assert sorted(died) == ["nixl-a", "nixl-b"] and all(w() is None for w in watched)
    assert "NIXL_ERR" in str(refused.value.__cause__)  # the error itself still says what happened


def test_calls_on_a_closed_nixl_thread_fail_at_once_instead_of_waiting_forever():
    thread = NixlThread("closing")
    assert thread.call(lambda agent: "ran") == "ran"
    thread.close()
    with pytest.raises(RuntimeError, match="closed"):
        thread.call(lambda agent: "never runs")


def test_unknown_peer_and_bad_descriptors_fail_the_request_only():
    async def main():
        a, b, _, _ = await pair()
        async with a, b:
            r = await a.write("nobody", PLAN, 1, 1.0)
            assert r.status is TransferStatus.FAILED and "unknown peer 'nobody'" in r.error
            b.arrivals.expect(2, "a", ["full"], 64, 5.0)
            r = await a.write("b", [Descriptor("full", 0, 0, 7 * ITEM, 2 * ITEM), PLAN[1]], 2, 1.0)
            assert r.status is TransferStatus.FAILED and "past the remote region" in r.error
            events = [await asyncio.wait_for(b.arrivals.events.get(), 2) for _ in range(2)]
            assert [e.kind for e in events] == [EventKind.FAILED, EventKind.RELEASE]
            assert a.metrics.peer("b").write_failures == 1
            r = await a.write("b", PLAN, 2**64, 1.0)
            assert r.status is TransferStatus.FAILED and "u64" in r.error
            r = await a.write("b", PLAN, 3, 1.0)  # the agent still works
            assert r.ok and r.nbytes == 2 * ITEM + 64

    asyncio.run(main())


def test_an_abort_that_overtook_its_write_refuses_that_write_and_not_the_next_with_its_tag():
    """Decode gave up on a request before prefill's WRITE started (e.g. its client cancelled right
    after prefill streamed the first token): that write is refused. A later request under the same
    id, so the same tag, is written: the refusal is not remembered past the write it was for."""
    async def main():
        a, b, _, _ = await pair()
        async with a, b:
            b.arrivals.expect(5, "a", ["full"], 64, 5.0)
            b.arrivals.abort(5, "client cancelled")
            events = [await asyncio.wait_for(b.arrivals.events.get(), 5) for _ in range(2)]
            assert [e.kind for e in events] == [EventKind.FAILED, EventKind.RELEASE]  # a acknowledged it
            refused = await a.write("b", PLAN, 5, 1.0)
            assert refused.status is TransferStatus.ABORTED and refused.nbytes == 0
            b.arrivals.expect(5, "a", ["full"], 64, 5.0)  # the request id used again
            again = await a.write("b", PLAN, 5, 1.0)
            assert again.ok and again.nbytes == 2 * ITEM + 64
            arrived = await asyncio.wait_for(b.arrivals.events.get(), 5)
            assert (arrived.tag, arrived.kind) == (5, EventKind.ARRIVED)

    asyncio.run(main())


def test_bad_peer_metadata_is_a_clear_error():
    async def main():
        a, b, _, b_pools = await pair()
        async with a, b:
            with pytest.raises(ValueError, match="cannot add peer 'c'"):
                await a.add_peer("c", b"not nixl metadata", [])
            with pytest.raises(ValueError, match="belongs to agent 'b'"):
                await a.add_peer("c", b.metadata(), b_pools.regions)
            await a.add_peer("b", b.metadata(), b_pools.regions)  # known: cached, no-op
            assert (await a.write("b", PLAN, 4, 1.0)).ok

    asyncio.run(main())


def test_peers_are_added_lazily_from_the_registry_lookup():
    async def main():
        a, b, a_pools, b_pools = await pair(lazy=True)
        async with a, b:
            b.arrivals.expect(4, "a", ["full"], 64, 5.0)
            b.arrivals.abort(4)  # b has never seen a: looks it up to send ABORT; a does the same to ack
            events = [await asyncio.wait_for(b.arrivals.events.get(), 5) for _ in range(2)]
            assert [e.kind for e in events] == [EventKind.FAILED, EventKind.RELEASE]
            assert (await a.write("b", PLAN, 4, 1.0)).status is TransferStatus.ABORTED
            b.arrivals.expect(5, "a", ["full"], 64, 5.0)
            assert (await a.write("b", PLAN, 5, 1.0)).ok
            assert (await asyncio.wait_for(b.arrivals.events.get(), 2)).kind is EventKind.ARRIVED
            assert (b_pools.full[2 * ITEM:4 * ITEM] == a_pools.full[:2 * ITEM]).all()
            assert (await a.write("c", PLAN, 6, 1.0)).error == "unknown peer 'c'"

    asyncio.run(main())


def test_cancelled_write_returns_only_when_nothing_is_in_flight():
    async def main():
        a, b, a_pools, b_pools = await pair()
        async with a, b:
            a.faults = Faults(delay_s=0.5)
            stats = a.metrics.peer("b")
            ended_before = stats.writes + stats.write_failures
            task = asyncio.create_task(a.write("b", PLAN, 7, 5.0))
            await until(lambda: 7 in a._sender._writes, 5, "the WRITE in flight (in its delay)", every_s=0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # it waited for the (uncancellable) delayed WRITE: that WRITE had ended (counted, done or
            # failed) and nothing was in flight any more when the cancel returned
            assert stats.writes + stats.write_failures == ended_before + 1 and not a._sender._writes
            assert (b_pools.full[2 * ITEM:4 * ITEM] == a_pools.full[:2 * ITEM]).all()

    asyncio.run(main())


def test_write_in_flight_at_its_deadline_is_cancelled_and_reported(monkeypatch):
    # TCP, and a receiver that makes no UCX progress for 1 s (its NIXL thread is kept busy, as a
    # stalled peer's would be): the 256 MiB WRITE fills the socket and stays in flight past its
    # 5 ms deadline, whatever the machine's load
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    size = 256 << 20

    async def main():
        bufs = {side: (np.ones(size, np.uint8), np.zeros(256, np.uint8)) for side in "ab"}
        regions = {side: [Region("full", 0, kv.ctypes.data, size, 1 << 20),
                          Region(AUX_KEY, 0, aux.ctypes.data, aux.nbytes, 64)] for side, (kv, aux) in bufs.items()}
        async with TransferAgent("a", regions["a"]) as a, TransferAgent("b", regions["b"]) as b:
            await a.add_peer("b", b.metadata(), regions["b"])
            await b.add_peer("a", a.metadata(), regions["a"])
            b.arrivals.expect(8, "a", ["full"], 64, 10.0)
            b._nixl.submit(lambda agent: time.sleep(1.0))  # the stall itself (b's NIXL thread busy 1 s)
            plan = [Descriptor("full", 0, 0, 0, size), Descriptor(AUX_KEY, 0, 0, 64, 64)]
            r = await a.write("b", plan, 8, 0.005)
            assert r.status is TransferStatus.FAILED and "deadline" in r.error and "CANCELLED" in r.error
            events = [await asyncio.wait_for(b.arrivals.events.get(), 5) for _ in range(2)]
            assert [e.kind for e in events] == [EventKind.FAILED, EventKind.RELEASE]

    asyncio.run(main())


def test_a_write_announced_as_starting_is_watched_closely_until_it_lands():
    async def main():
        a, b, a_pools, b_pools = await pair()
        async with a, b:
            b.arrivals.expect(5, "a", ["full"], 64, 5.0)
            b.incoming(99)  # not expected here: ignored
            assert b.arrivals.due == 0
            b.incoming(5)
            assert b.arrivals.due == 1
            assert (await a.write("b", PLAN, 5, 1.0)).ok
            assert (await asyncio.wait_for(b.arrivals.events.get(), 2)).kind is EventKind.ARRIVED
            assert b.arrivals.due == 0 and b.arrivals.pending == 0
            assert (b_pools.full[2 * ITEM:4 * ITEM] == a_pools.full[:2 * ITEM]).all()

    asyncio.run(main())
