"""Two real processes, real NIXL agents (UCX over loopback): prefill in a spawned child, decode
in the test process. Control between them goes over a multiprocessing pipe; bytes go over NIXL.

Each side keeps a free list of slot ids per component; a test ends with both lists full."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from itertools import count

import numpy as np
import pytest

from baton.shared.transfer import (AUX_KEY, Descriptor, EventKind, Faults, Region, TransferAgent,
                                   TransferStatus)
from baton.shared.transfer.nixl_thread import SPLIT_DESCRIPTORS
from baton.shared.transfer.notices import Kind, Notice

pytestmark = pytest.mark.integration

FULL, RING = "target/FULL", "target/SWA_RING"  # component names as baton.shared.kv makes them
ROW = 512  # bytes of one position's K and V in one layer
PAGE_ROWS = 8
RING_ROWS = 8
# component -> (layers, items, item_bytes): FULL pages of 8 rows, SWA ring slots, aux rows
GEOMETRY = {FULL: (2, 16, PAGE_ROWS * ROW), RING: (2, 4, RING_ROWS * ROW), AUX_KEY: (1, 4, 64)}
TAGS = count(1000)


def make_pools(rng: np.random.Generator | None) -> dict[tuple[str, int], np.ndarray]:
    """One byte array per (component, layer): random on the sender, zeros on the receiver."""
    pools = {}
    for key, (layers, items, item_bytes) in GEOMETRY.items():
        for layer in range(layers):
            n = items * item_bytes
            pools[key, layer] = rng.integers(0, 256, n, dtype=np.uint8) if rng else np.zeros(n, np.uint8)
    return pools


def regions_of(pools) -> list[Region]:
    return [Region(key, layer, a.ctypes.data, a.nbytes, GEOMETRY[key][2]) for (key, layer), a in pools.items()]


def full_free_lists() -> dict[str, set[int]]:
    return {key: set(range(items)) for key, (_, items, _) in GEOMETRY.items()}


def take(free: dict[str, set[int]], key: str, n: int, rng: np.random.Generator) -> list[int]:
    ids = [int(i) for i in rng.choice(sorted(free[key]), n, replace=False)]
    free[key] -= set(ids)
    return ids


# --- the prefill process ----------------------------------------------------------------------
def prefill_main(conn, name: str, copy_threads: int) -> None:
    asyncio.run(_prefill(conn, name, copy_threads))


async def _prefill(conn, name: str, copy_threads: int) -> None:
    rng = np.random.default_rng(os.getpid())
    pools = make_pools(rng)
    free = full_free_lists()
    held: dict[int, dict[str, list[int]]] = {}  # tag -> slots this prefill holds for the request
    tasks = set()

    async def write(rid, peer, descriptors, tag, deadline_s):
        result = await agent.write(peer, descriptors, tag, deadline_s)
        for key, ids in held.pop(tag, {}).items():  # freed only now: nothing is in flight
            free[key] |= set(ids)
        conn.send((rid, result))

    async def remove_peer(rid, peer):  # may wait for a WRITE to it: not inline, like write
        await agent.remove_peer(peer)
        conn.send((rid, None))

    async with TransferAgent(name, regions_of(pools), copy_threads=copy_threads) as agent:
        conn.send(("ready", (agent.metadata(), regions_of(pools))))
        while True:
            while not conn.poll():
                await asyncio.sleep(0.002)
            op, rid, args = conn.recv()
            if op == "stop":
                break
            if op in ("write", "remove_peer"):
                tasks.add(asyncio.create_task((write if op == "write" else remove_peer)(rid, *args)))
                continue
            if op == "add_peer":
                reply = await agent.add_peer(*args)
            elif op == "alloc":  # (tag, {component: n}) -> {component: slot ids}
                tag, wanted = args
                reply = held[tag] = {key: take(free, key, n, rng) for key, n in wanted.items()}
            elif op == "faults":
                agent.faults = Faults(**args[0])
                reply = None
            elif op == "read":  # source bytes of descriptors
                reply = [pools[d.component_key, d.layer_index][d.src_offset:d.src_offset + d.nbytes].tobytes()
                         for d in args[0]]
            elif op == "free_counts":
                reply = {key: len(ids) for key, ids in free.items()}
            conn.send((rid, reply))


class Prefill:
    """The test's handle on a prefill child process."""

    def __init__(self, name: str, copy_threads: int = 0):
        ctx = mp.get_context("spawn")
        self.name = name
        self.copy_threads = copy_threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, name, copy_threads), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "prefill child did not start"
        _, (self.metadata, self.regions) = self.conn.recv()
        self._ids = count()
        self._replies: dict[int, object] = {}

    def send(self, op: str, *args) -> int:
        rid = next(self._ids)
        self.conn.send((op, rid, args))
        return rid

    async def reply(self, rid: int, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while rid not in self._replies:
            assert time.monotonic() < deadline, f"no reply {rid} from {self.name}"
            if self.conn.poll():
                got, value = self.conn.recv()
                self._replies[got] = value
            else:
                await asyncio.sleep(0.002)
        return self._replies.pop(rid)

    async def call(self, op: str, *args):
        return await self.reply(self.send(op, *args))

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", -1, ()))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module", params=[0, 2], ids=["one-copy-thread", "two-copy-threads"])
def prefill(request):
    """Every test runs against a sender copying on its NIXL thread, and against one whose large
    WRITEs are split over two copy threads (NIXL's UCX thread pool)."""
    p = Prefill(f"prefill-{request.param}", copy_threads=request.param)
    yield p
    p.stop()


# --- the decode side (this process) -----------------------------------------------------------
class Decode:
    def __init__(self, agent: TransferAgent, pools):
        self.agent = agent
        self.pools = pools
        self.free = full_free_lists()
        self.held: dict[int, dict[str, list[int]]] = {}
        self.rng = np.random.default_rng(7)

    def reserve(self, tag: int, wanted: dict[str, int]) -> dict[str, list[int]]:
        self.held[tag] = {key: take(self.free, key, n, self.rng) for key, n in wanted.items()}
        return self.held[tag]

    def release(self, tag: int) -> None:
        for key, ids in self.held.pop(tag).items():
            self.free[key] |= set(ids)

    async def event(self, timeout: float = 5.0):
        return await asyncio.wait_for(self.agent.arrivals.events.get(), timeout)

    def dst_bytes(self, d: Descriptor) -> bytes:
        return self.pools[d.component_key, d.layer_index][d.dst_offset:d.dst_offset + d.nbytes].tobytes()

    def untouched_is_zero(self, descriptors: list[Descriptor]) -> bool:
        for (key, layer), pool in self.pools.items():
            mask = np.ones(pool.nbytes, bool)
            for d in descriptors:
                if (d.component_key, d.layer_index) == (key, layer):
                    mask[d.dst_offset:d.dst_offset + d.nbytes] = False
            if pool[mask].any():
                return False
        return True


async def decode_session(prefill: Prefill, scenario) -> None:
    pools = make_pools(None)
    name = f"decode-{next(TAGS)}"
    async with TransferAgent(name, regions_of(pools)) as agent:
        await agent.add_peer(prefill.name, prefill.metadata, prefill.regions)
        await prefill.call("add_peer", name, agent.metadata(), regions_of(pools))
        decode = Decode(agent, pools)
        await scenario(decode, name)
        assert decode.free == full_free_lists()
        assert agent.arrivals.pending == 0
    assert await prefill.call("free_counts") == {k: len(v) for k, v in full_free_lists().items()}


def stall(agent: TransferAgent, seconds: float = 2.0) -> threading.Event:
    """Stop `agent`'s NIXL thread, so it makes no UCX progress, for `seconds` from when this
    returns: a process that hangs but keeps its connections open. Returns an event set once the
    thread runs again."""
    started, resumed = threading.Event(), threading.Event()

    def hang(nixl_agent) -> None:
        started.set()
        time.sleep(seconds)  # the stall itself
        resumed.set()

    agent._nixl.submit(hang)
    assert started.wait(5.0)
    return resumed


WANT = {FULL: 3, RING: 1, AUX_KEY: 1}


def plan(src: dict[str, list[int]], dst: dict[str, list[int]], first: int, last: int) -> list[Descriptor]:
    """For a prompt of last+1 tokens: FULL positions 0..last by page (page tables as given, not
    contiguous; the last page partly filled), the ring window first..last (one or two row runs
    when it wraps), and the aux row."""
    full_bytes, ring_bytes, aux_bytes = (GEOMETRY[k][2] for k in (FULL, RING, AUX_KEY))
    out = []
    for layer in range(GEOMETRY[FULL][0]):
        for page, (s, d) in enumerate(zip(src[FULL], dst[FULL])):
            rows = min(PAGE_ROWS, last + 1 - page * PAGE_ROWS)
            if rows > 0:
                out.append(Descriptor(FULL, layer, s * full_bytes, d * full_bytes, rows * ROW))
    runs, row = [], first % RING_ROWS
    n = last - first + 1
    while n:
        length = min(n, RING_ROWS - row)
        runs.append((row, length))
        n, row = n - length, 0
    (s_slot,), (d_slot,) = src[RING], dst[RING]
    for layer in range(GEOMETRY[RING][0]):
        out += [Descriptor(RING, layer, s_slot * ring_bytes + r * ROW, d_slot * ring_bytes + r * ROW,
                           length * ROW) for r, length in runs]
    (s_aux,), (d_aux,) = src[AUX_KEY], dst[AUX_KEY]
    return out + [Descriptor(AUX_KEY, 0, s_aux * aux_bytes, d_aux * aux_bytes, aux_bytes)]


async def start_request(prefill: Prefill, decode: Decode, name: str, first: int, last: int,
                        deadline_s: float = 5.0, write: bool = True):
    """Reserve decode slots, expect the request, and (optionally) ask prefill to write it."""
    tag = next(TAGS)
    dst = decode.reserve(tag, WANT)
    src = await prefill.call("alloc", tag, WANT)
    descriptors = plan(src, dst, first, last)
    aux_offset = dst[AUX_KEY][0] * GEOMETRY[AUX_KEY][2]
    decode.agent.arrivals.expect(tag, prefill.name, [FULL, RING], aux_offset, deadline_s)
    rid = prefill.send("write", name, descriptors, tag, 5.0) if write else None
    return tag, descriptors, rid


def test_plan_regions_arrive_byte_exact(prefill):
    """Three requests in flight at once: ring window without wrap (rows 3..7), wrapped (6..7,
    0..2), and prompt 0..23, which fills 3 pages and the ring slot in both layers: 6 + 2 whole
    items and the aux row in one WRITE, enough for a sender with copy threads to cut it into
    chunks copied by different threads."""
    async def scenario(decode: Decode, name: str):
        # all three allocated before any WRITE: prefill frees a request's slots when its WRITE is
        # done, and a later allocation could take them and overwrite the source bytes read below
        a, b, c = [await start_request(prefill, decode, name, first, last, write=False)
                   for first, last in ((3, 7), (14, 18), (16, 23))]
        a, b, c = [(tag, descriptors, prefill.send("write", name, descriptors, tag, 5.0))
                   for tag, descriptors, _ in (a, b, c)]
        assert len([d for d in b[1] if d.component_key == RING]) == 4  # two runs per layer
        item_bytes = {key: g[2] for key, g in GEOMETRY.items()}
        assert len([d for d in c[1] if d.nbytes == item_bytes[d.component_key]]) >= SPLIT_DESCRIPTORS
        events = {(await decode.event()).tag: None for _ in range(3)}
        assert set(events) == {a[0], b[0], c[0]}
        for tag, descriptors, rid in (a, b, c):
            result = await prefill.reply(rid)
            assert result.ok and result.nbytes == sum(d.nbytes for d in descriptors)
            sent = await prefill.call("read", descriptors)
            assert [decode.dst_bytes(d) for d in descriptors] == sent
            aux = decode.dst_bytes(descriptors[-1])
            assert int.from_bytes(aux[:8], "little") == tag
        assert decode.untouched_is_zero(a[1] + b[1] + c[1])
        assert decode.agent.metrics.peer(prefill.name).arrivals == 3
        assert decode.agent.arrivals.events.empty()
        for tag, _, _ in (a, b, c):
            decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_failed_write_is_an_error_on_both_sides_and_frees_after_it_ends(prefill):
    async def scenario(decode: Decode, name: str):
        await prefill.call("faults", {"fail": FULL})
        tag, _, rid = await start_request(prefill, decode, name, 0, 4)
        failed, release = await decode.event(), await decode.event()
        result = await prefill.reply(rid)
        await prefill.call("faults", {})
        assert (failed.tag, failed.kind) == (tag, EventKind.FAILED)
        assert (release.tag, release.kind) == (tag, EventKind.RELEASE)
        assert result.status is TransferStatus.FAILED and "injected failure" in result.error
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_delayed_write_keeps_slots_held_past_the_deadline_until_it_lands(prefill):
    async def scenario(decode: Decode, name: str):
        await prefill.call("faults", {"delay_s": 1.0})  # the WRITE lands 1 s after it was asked for
        tag, descriptors, rid = await start_request(prefill, decode, name, 0, 4, deadline_s=0.2)
        failed = await decode.event()
        assert failed.kind is EventKind.FAILED and "deadline" in failed.reason
        assert decode.untouched_is_zero([]), "FAILED came only once the WRITE had landed, not at the deadline"
        release = await decode.event()  # only once the WRITE has landed and prefill acknowledged
        at_release = [decode.dst_bytes(d) for d in descriptors]  # what a reuser would find
        assert release.kind is EventKind.RELEASE
        result = await prefill.reply(rid)
        await prefill.call("faults", {})
        assert result.status is TransferStatus.ABORTED
        assert at_release == await prefill.call("read", descriptors)  # landed before the release
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_a_receiver_that_stops_progressing_gets_its_slots_back_only_after_the_write_ended(prefill):
    """Decode's NIXL thread stalls (a process that hangs but keeps its connections): a WRITE to it
    cannot complete, because NIXL ends every WRITE with an endpoint flush that waits for the
    receiver's UCX progress (docs/benchmarks.md, stop 18). A sender copying on its NIXL thread
    cancels the WRITE at its deadline and fails the request then. With copy threads a WRITE is
    never released in flight, so it is waited for and lands once decode progresses again. Either
    way decode returns its slots only after prefill reported the WRITE ended, and the bytes it
    holds then are the sender's."""
    async def scenario(decode: Decode, name: str):
        tag, descriptors, _ = await start_request(prefill, decode, name, 16, 23, deadline_s=0.3, write=False)
        resumed = stall(decode.agent)  # no UCX progress on decode for 2 s
        rid = prefill.send("write", name, descriptors, tag, 0.5)
        failed = await decode.event()
        assert failed.kind is EventKind.FAILED and "deadline" in failed.reason and not resumed.is_set()
        result = await prefill.reply(rid)
        if prefill.copy_threads:
            assert resumed.is_set() and result.status in (TransferStatus.DONE, TransferStatus.ABORTED)
        else:
            assert not resumed.is_set() and result.status is TransferStatus.FAILED and "deadline" in result.error
        release = await decode.event()
        assert (release.tag, release.kind) == (tag, EventKind.RELEASE) and resumed.is_set()
        if prefill.copy_threads:  # the WRITE was not cut short: everything landed
            assert [decode.dst_bytes(d) for d in descriptors] == await prefill.call("read", descriptors)
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_removing_a_hung_peer_waits_for_its_write_and_holds_up_no_other_peer(prefill):
    """Prefill removes a decode (its lease expired) that hangs with a WRITE to it in flight:
    decode's NIXL thread is stalled, so the WRITE cannot complete. The removal stops the WRITE
    before it disconnects: cancelled at once, or, with copy threads, waited for until decode
    progresses again and it lands. From the removal's start no new WRITE to it begins, and
    meanwhile another decode is added and served."""
    async def scenario(decode: Decode, name: str):
        tag, descriptors, _ = await start_request(prefill, decode, name, 16, 23, write=False)
        resumed = stall(decode.agent)  # no UCX progress on decode for 2 s
        rid = prefill.send("write", name, descriptors, tag, 5.0)
        removal = prefill.send("remove_peer", name)
        late = await prefill.call("write", name, descriptors, next(TAGS), 5.0)  # no WRITE starts any more
        assert late.status is TransferStatus.FAILED and "unknown peer" in late.error and not resumed.is_set()
        other_pools, other_name = make_pools(None), f"decode-{next(TAGS)}"
        async with TransferAgent(other_name, regions_of(other_pools)) as agent:
            await agent.add_peer(prefill.name, prefill.metadata, prefill.regions)
            await prefill.call("add_peer", other_name, agent.metadata(), regions_of(other_pools))
            other = Decode(agent, other_pools)
            other_tag, _, other_rid = await start_request(prefill, other, other_name, 0, 4)
            assert (await other.event()).kind is EventKind.ARRIVED and (await prefill.reply(other_rid)).ok
            other.release(other_tag)
        assert not resumed.is_set()  # all of that while the hung peer's removal may still wait
        result = await prefill.reply(rid)
        await prefill.reply(removal)
        if prefill.copy_threads:
            assert resumed.is_set() and result.ok  # not cut short: it landed, and decode sees it
            assert (await decode.event()).kind is EventKind.ARRIVED
            assert [decode.dst_bytes(d) for d in descriptors] == await prefill.call("read", descriptors)
        else:
            assert not resumed.is_set() and result.status is TransferStatus.FAILED and "left" in result.error
            await decode.agent.remove_peer(prefill.name)  # decode lets go of the request only now
            while (event := await decode.event()).kind is not EventKind.RELEASE:
                assert event.kind is EventKind.FAILED
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_dropped_notification_times_out_and_frees_on_acknowledgement(prefill):
    async def scenario(decode: Decode, name: str):
        await prefill.call("faults", {"drop": RING})
        tag, _, rid = await start_request(prefill, decode, name, 0, 4, deadline_s=0.3)
        result = await prefill.reply(rid)
        await prefill.call("faults", {})
        assert result.ok  # the sender cannot tell; the receiver's deadline catches it
        failed, release = await decode.event(), await decode.event()
        assert failed.kind is EventKind.FAILED and RING in failed.reason
        assert release.kind is EventKind.RELEASE
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_abort_before_the_write_is_acknowledged_and_the_write_refused(prefill):
    async def scenario(decode: Decode, name: str):
        tag, descriptors, _ = await start_request(prefill, decode, name, 0, 4, write=False)
        decode.agent.arrivals.abort(tag, "client cancelled")
        failed, release = await decode.event(), await decode.event()
        assert (failed.kind, failed.reason) == (EventKind.FAILED, "client cancelled")
        assert release.kind is EventKind.RELEASE
        result = await prefill.reply(prefill.send("write", name, descriptors, tag, 5.0))
        assert result.status is TransferStatus.ABORTED
        assert decode.untouched_is_zero([])  # nothing was written
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))


def test_killed_peer_frees_slots_only_when_declared_gone(prefill, caplog):
    doomed = Prefill("prefill-doomed")

    async def scenario(decode: Decode, name: str):
        await decode.agent.add_peer(doomed.name, doomed.metadata, doomed.regions)
        await doomed.call("add_peer", name, decode.agent.metadata(), regions_of(decode.pools))
        tag = next(TAGS)
        dst = decode.reserve(tag, WANT)
        decode.agent.arrivals.expect(tag, doomed.name, [FULL, RING],
                                     dst[AUX_KEY][0] * GEOMETRY[AUX_KEY][2], 0.2)
        os.kill(doomed.proc.pid, signal.SIGKILL)
        failed = await decode.event()
        assert failed.kind is EventKind.FAILED
        # an observation window, the thing tested: a RELEASE before the peer is declared gone (a
        # wrong one) would come in it; nothing to wait for, as the right outcome is that nothing comes
        await asyncio.sleep(0.3)
        assert decode.agent.arrivals.events.empty() and decode.agent.arrivals.pending == 1
        await decode.agent.remove_peer(doomed.name)  # the registry dropped its lease
        release = await decode.event()
        assert (release.tag, release.kind) == (tag, EventKind.RELEASE)
        decode.release(tag)
        # the survivor still works
        tag, _, rid = await start_request(prefill, decode, name, 0, 4)
        assert (await decode.event()).kind is EventKind.ARRIVED
        assert (await prefill.reply(rid)).ok
        decode.release(tag)

    try:
        asyncio.run(decode_session(prefill, scenario))
    finally:
        doomed.stop()


def test_junk_notifications_are_logged_and_ignored(prefill, caplog):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    caplog.set_level(logging.INFO, logger="baton.shared.transfer")
    expected = ("malformed notification", "unknown request 12345", "unknown request 777")

    async def scenario(decode: Decode, name: str):
        rogue = nixl_agent("rogue", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        rogue.add_remote_agent(decode.agent.metadata())
        for message in (b"hello", b"BTNZ" + bytes(10), Notice(Kind.WRITTEN, 12345, FULL).encode(),
                        Notice(Kind.ABORTED, 777).encode()):
            rogue.send_notif(name, message)
        deadline = time.monotonic() + 5
        while not all(e in caplog.text for e in expected) and time.monotonic() < deadline:
            rogue.get_new_notifs()  # progresses the rogue's UCX worker
            await asyncio.sleep(0.01)
        assert all(e in caplog.text for e in expected), caplog.text
        rogue.remove_remote_agent(name)
        tag, _, rid = await start_request(prefill, decode, name, 0, 4)  # still works
        assert (await decode.event()).kind is EventKind.ARRIVED
        assert (await prefill.reply(rid)).ok
        decode.release(tag)

    asyncio.run(decode_session(prefill, scenario))
