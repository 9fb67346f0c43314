"""Pure logic of the transfer engine: region tables, descriptor resolution, notices, faults, and
the receiver's arrival/release rules (no NIXL, no processes)."""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from baton.shared.kv.aux import HEADER_BYTES
from baton.shared.transfer import (AUX_KEY, ArrivalEvent, ArrivalTracker, Descriptor,
                                   DescriptorError, EventKind, Faults, Region, TransferMetrics)
from baton.shared.transfer.nixl_ops import VRAM_UNREGISTERED, Xfer, cancel, register
from baton.shared.transfer.nixl_thread import _Inbox
from baton.shared.transfer.notices import Kind, Notice, decode
from baton.shared.transfer.regions import RegionTable, _resolve_vectorised, _whole_items, resolve, write_tag

pytestmark = pytest.mark.unit

BASE = 1 << 32


def table(owner: str, item_bytes: int = 256, base: int = BASE) -> RegionTable:
    return RegionTable([Region("full", 0, base, 4 * item_bytes, item_bytes),
                        Region("full", 1, base + 4096, 4 * item_bytes, item_bytes),
                        Region(AUX_KEY, 0, base + 8192, 4 * 64, 64)], owner)


def aux(src: int = 0, dst: int = 64) -> Descriptor:
    return Descriptor(AUX_KEY, 0, src, dst, 64)


def test_region_registered_twice_or_overlapping_is_refused():
    r = Region("full", 0, BASE, 1024, 256)
    with pytest.raises(ValueError, match="registered twice"):
        RegionTable([r, Region("full", 0, BASE + 4096, 1024, 256)], "me")
    with pytest.raises(ValueError, match="overlap"):
        RegionTable([r, Region("full", 1, BASE + 512, 1024, 256)], "me")
    with pytest.raises(ValueError, match="multiple of item_bytes"):
        RegionTable([Region("full", 0, BASE, 1000, 256)], "me")
    with pytest.raises(ValueError, match="past any user-space address"):
        RegionTable([Region("full", 0, (1 << 63) - 512, 1024, 256)], "me")
    with pytest.raises(ValueError, match="must not contain ','"):
        RegionTable([Region("full,swa", 0, BASE, 1024, 256)], "me")


def test_item_rows_index_every_item_in_region_order():
    rows = table("me").item_rows("DRAM")
    assert rows.shape == (12, 3)
    assert list(rows[:5, 0]) == [BASE, BASE + 256, BASE + 512, BASE + 768, BASE + 4096]
    assert set(rows[:8, 1]) == {256} and set(rows[8:, 1]) == {64}


def test_whole_items_of_every_component_resolve_to_one_batch_of_prepared_indices():
    local, remote = table("me"), table("peer", base=BASE << 1)
    [batch] = resolve([aux(), Descriptor("full", 1, 512, 0, 512), Descriptor("full", 0, 256, 768, 256)],
                      local, remote)
    assert batch.components == (AUX_KEY, "full")
    assert batch.by_item and batch.nbytes == 64 + 768
    assert list(batch.local) == [8, 6, 7, 1] and list(batch.remote) == [9, 4, 5, 3]


def test_an_aux_prefix_goes_as_its_whole_row_in_the_one_batch_of_whole_items():
    """A real plan sends the aux row's header and the hidden rows it needs: a prefix of the row.
    It used to be a second WRITE of byte ranges (two one-off lists, a post, a notification)."""
    local, remote = table("me"), table("peer", base=BASE << 1)
    [batch] = resolve([Descriptor(AUX_KEY, 0, 64, 128, 24), Descriptor("full", 1, 512, 0, 512)], local, remote)
    assert batch.by_item and batch.components == (AUX_KEY, "full") and batch.nbytes == 64 + 512
    assert list(batch.local) == [9, 6, 7] and list(batch.remote) == [10, 4, 5]
    off_row = resolve([Descriptor(AUX_KEY, 0, 72, 136, 24)], local, remote)  # not on a row: a range
    assert [(b.by_item, b.nbytes) for b in off_row] == [(False, 24)]


def same_batches(a: list, b: list) -> bool:
    return [(x.components, x.nbytes, x.by_item, x.local.tolist(), x.remote.tolist()) for x in a] == \
        [(x.components, x.nbytes, x.by_item, x.local.tolist(), x.remote.tolist()) for x in b]


def test_the_plain_python_path_for_small_plans_agrees_with_the_vectorised_one():
    """`resolve` tries `_whole_items` first for small plans; it must give the same batches, or
    decline (None) and leave the plan, errors included, to the vectorised path."""
    rng = np.random.default_rng(7)
    local, remote = table("me"), table("peer", base=BASE << 1)
    taken = 0
    for _ in range(3000):
        descriptors = [Descriptor(AUX_KEY, 0, 64 * int(rng.integers(0, 4)) + int(rng.choice([0, 0, 0, 8])),
                                  64 * int(rng.integers(0, 4)), int(rng.choice([64, 24, 8, 4])))]
        for _ in range(int(rng.integers(0, 4))):
            descriptors.append(Descriptor("full", int(rng.integers(0, 3)), int(rng.choice([0, 256, 512, 100])),
                                          int(rng.choice([0, 256, 768])), int(rng.choice([256, 512, 88, 0]))))
        rng.shuffle(descriptors)
        try:
            want = _resolve_vectorised(descriptors, local, remote)
        except DescriptorError:
            want = None
        got = _whole_items(descriptors, local, remote)
        if got is not None:
            taken += 1
            assert want is not None and same_batches(got, want), descriptors
        if want is None:
            with pytest.raises(DescriptorError):
                resolve(descriptors, local, remote)
        else:
            assert same_batches(resolve(descriptors, local, remote), want), descriptors
    assert taken > 300, taken


@pytest.mark.parametrize("mode", ["ring", "paged"])
def test_real_plans_take_the_plain_python_path(mode):
    """A worker's plans (whole pages, ring slots, the aux prefix) are what the fast path is for."""
    from baton.shared.kv.plan import make_plan
    from baton.shared.kv.store import KVStore
    from baton.shared.transfer.regions import regions_of
    from test_kv_plan import CFG
    kw = dict(mode=mode, num_pages=64, page_size=4, num_slots=8, max_draft_tokens=3)
    src, dst = KVStore(CFG, draft_enabled=True, **kw), KVStore(CFG, draft_enabled=True, **kw)
    ms, md = src.manifest("p", "fp", role="prefill"), dst.manifest("d", "fp", role="decode")
    plan, lt, rt = make_plan(ms, md), RegionTable(regions_of(ms), "p"), RegionTable(regions_of(md), "d")
    for n, length in enumerate((1, 3, 4, 9, 30)):
        for store in (src, dst):
            store.allocate(f"r{n}", length + 4)
            store.extend(f"r{n}", length)
        descriptors = plan.descriptors(length, src.allocation(f"r{n}"), dst.allocation(f"r{n}"))
        got = _whole_items(descriptors, lt, rt)
        assert got is not None and same_batches(got, _resolve_vectorised(descriptors, lt, rt)), length


@pytest.mark.parametrize("draft_state", ["transfer", "rebuild"])
def test_a_real_plans_aux_row_goes_as_the_blocks_its_prefix_covers(draft_state):
    """The aux rows are registered in blocks of header + one hidden row (kv/aux.py): when the draft
    state travels the request carries one block of its row, not the whole row; when decode rebuilds
    the draft window, the blocks that hold its W hidden rows. Always one WRITE, by index."""
    from msgspec.structs import replace as with_fields

    from baton.shared.kv.plan import make_plan
    from baton.shared.kv.store import KVStore
    from baton.shared.transfer.regions import regions_of
    from test_kv_plan import CFG
    kw = dict(mode="ring", num_pages=64, page_size=4, num_slots=8, max_draft_tokens=3)
    src, dst = KVStore(CFG, draft_enabled=True, **kw), KVStore(CFG, draft_enabled=True, **kw)
    ms, md = src.manifest("p", "fp", role="prefill"), dst.manifest("d", "fp", role="decode")
    plan = with_fields(make_plan(ms, md), draft_state=draft_state)
    lt, rt = RegionTable(regions_of(ms), "p"), RegionTable(regions_of(md), "d")
    layout, length = src.aux_layout, 30
    for store in (src, dst):
        store.allocate("r0", 1)  # the request under test gets slot 1 on both sides
        store.allocate("r1", length + 4)
        store.extend("r1", length)
    [batch] = resolve(plan.descriptors(length, src.allocation("r1"), dst.allocation("r1")), lt, rt)
    aux_first = lt.first_item[(AUX_KEY, 0)]
    blocks = sorted(int(i) - aux_first for i in batch.local if i >= aux_first)
    rows = 1 if draft_state == "transfer" else min(length, layout.hidden_rows)
    per_row = layout.item_bytes // layout.block_bytes
    want = -(-(HEADER_BYTES + rows * layout.row_bytes) // layout.block_bytes)
    assert blocks == list(range(per_row, per_row + want))  # the first blocks of slot 1's row
    assert want < per_row or draft_state == "rebuild"

def test_partial_items_go_as_byte_ranges_next_to_the_whole_items():
    local, remote = table("me"), table("peer", base=BASE << 1)
    items, ranges = resolve([Descriptor("full", 0, 128, 384, 256),  # cuts through items
                             Descriptor("full", 1, 0, 256, 600),  # 2 whole items + 88 B tail
                             aux()], local, remote)
    assert items.by_item and list(items.local) == [4, 5, 8] and list(items.remote) == [5, 6, 9]
    assert items.components == (AUX_KEY, "full") and ranges.components == ("full",)
    assert items.nbytes == 512 + 64 and ranges.nbytes == 256 + 88
    assert not ranges.by_item
    assert ranges.local.tolist() == [[BASE + 128, 256, 0], [BASE + 4096 + 512, 88, 0]]
    assert ranges.remote.tolist() == [[(BASE << 1) + 384, 256, 0], [(BASE << 1) + 4096 + 768, 88, 0]]


@pytest.mark.parametrize("descriptors, message", [
    ([Descriptor("full", 0, 0, 0, 256)], "no aux descriptor"),
    ([aux(), aux(64, 128)], "exactly one aux"),
    ([Descriptor("swa", 0, 0, 0, 256), aux()], "no region for component 'swa'"),
    ([Descriptor("full", 0, 768, 0, 512), aux()], "source range ends at 1280"),
    ([Descriptor("full", 0, 0, 900, 256), aux()], "destination range ends at 1156"),
    ([Descriptor("full", 0, 0, 0, 0), aux()], "nbytes must be > 0"),
    ([Descriptor("full", 2, 0, 0, 256), aux()], "no region for component 'full' layer 2"),
    ([Descriptor("full", -1, 0, 0, 256), aux()], "no region for component 'full' layer -1"),
    ([Descriptor("full", 0, 2**62, 2**62, 2**62), aux()], "source range ends at"),  # wraps int64
    ([Descriptor("full", 0, 0, 0, 2**70), aux()], "integers within int64"),
    ([Descriptor("full", 0, None, 0, 256), aux()], "integers within int64"),
])
def test_bad_descriptors_name_the_problem(descriptors, message):
    with pytest.raises(DescriptorError, match=message):
        resolve(descriptors, table("me"), table("peer", base=BASE << 1))


def test_item_size_mismatch_between_sides_is_refused():
    with pytest.raises(DescriptorError, match="item sizes differ"):
        resolve([Descriptor("full", 0, 0, 0, 256), aux()], table("me"), table("peer", 128, BASE << 1))


def test_notice_round_trip_and_malformed_input():
    for n in (Notice(Kind.WRITTEN, 2**64 - 1, ("draft/SWA_RING",), 1, 2),
              Notice(Kind.WRITTEN, 7, (AUX_KEY, "target/FULL", "target/SWA")), Notice(Kind.ABORT, 0)):
        assert decode(n.encode()) == n
    tag = bytes(8)
    for junk in (b"", b"BTNW", b"XYZW" + tag + b"\0\1", b"BTNQ" + tag + b"\0\1",
                 b"BTNW" + tag + b"\0\1\xff", b"BTNW" + tag + b"\1\1"):
        assert decode(junk) is None


def test_faults_from_env(monkeypatch):
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", "delay=0.5, drop=aux")
    assert Faults.from_env() == Faults(0.5, None, "aux")
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", "metadata=truncate")
    assert Faults.from_env() == Faults(metadata="truncate")
    for bad in ("explode=1", "metadata=garble"):
        monkeypatch.setenv("BATON_TRANSFER_FAULTS", bad)
        with pytest.raises(ValueError, match="BATON_TRANSFER_FAULTS"):
            Faults.from_env()
    monkeypatch.delenv("BATON_TRANSFER_FAULTS")
    assert Faults.from_env() == Faults()


# --- receiver rules ---------------------------------------------------------------------------
class Receiver:
    def __init__(self):
        self.aux_rows = np.zeros(4 * 64, np.uint8)
        self.aux = Region(AUX_KEY, 0, self.aux_rows.ctypes.data, self.aux_rows.nbytes, 64)
        self.sent: list[tuple[str, Notice]] = []
        self.metrics = TransferMetrics()
        self.tracker = ArrivalTracker(lambda peer, n: self.sent.append((peer, n)), self.aux, self.metrics)

    def events(self) -> list[tuple[int, EventKind]]:
        out = []
        while not self.tracker.events.empty():
            e: ArrivalEvent = self.tracker.events.get_nowait()
            out.append((e.tag, e.kind))
        return out

    def written(self, tag: int, *components: str, peer: str = "p", part: int = 0, parts: int = 1) -> None:
        self.tracker.on_notice(peer, Notice(Kind.WRITTEN, tag, components, part, parts))


def test_arrival_needs_every_write_every_component_and_the_tag_in_the_aux_row():
    r = Receiver()
    r.tracker.expect(5, "p", ["full", "swa"], 64, 10.0)
    write_tag(r.aux, 64, 5)
    r.written(5, "full", "swa", part=1, parts=2)  # the byte ranges came first
    r.written(5, "full", "swa", part=1, parts=2)  # a repeated WRITE counts once
    r.written(5, AUX_KEY, "full", part=0, parts=3)  # inconsistent WRITE count: ignored
    assert r.events() == [] and r.tracker.pending == 1
    r.written(5, AUX_KEY, "full", "draft", part=0, parts=2)  # "draft" is not in the plan: logged
    assert r.events() == [(5, EventKind.ARRIVED)] and r.tracker.pending == 0


def test_a_write_announced_as_starting_is_due_until_it_lands_or_is_released():
    r = Receiver()
    r.tracker.expect(5, "p", ["full"], 0, 10.0)
    r.tracker.expect(6, "p", ["full"], 64, 10.0)
    assert r.tracker.due == 0
    assert r.tracker.incoming(5) and r.tracker.due == 1
    assert not r.tracker.incoming(5) and r.tracker.due == 1  # announced twice: counted once
    assert not r.tracker.incoming(7) and r.tracker.due == 1  # not expected here: ignored
    assert r.tracker.incoming(6) and r.tracker.due == 2
    write_tag(r.aux, 0, 5)
    r.written(5, AUX_KEY, "full")
    assert r.events() == [(5, EventKind.ARRIVED)] and r.tracker.due == 1
    r.tracker.on_notice("p", Notice(Kind.FAILED, 6))
    assert r.events() == [(6, EventKind.FAILED), (6, EventKind.RELEASE)] and r.tracker.due == 0
    assert not r.tracker.incoming(5)  # arrived already: a late announcement changes nothing
    assert r.tracker.due == 0


def test_every_write_landed_without_a_planned_component_fails_and_releases():
    r = Receiver()
    r.tracker.expect(5, "p", ["full", "swa"], 0, 10.0)
    write_tag(r.aux, 0, 5)
    r.written(5, AUX_KEY, "full")
    failed, released = r.tracker.events.get_nowait(), r.tracker.events.get_nowait()
    assert (failed.kind, released.kind, r.tracker.pending) == (EventKind.FAILED, EventKind.RELEASE, 0)
    assert "1 of 1 WRITEs landed; components not written: ['swa']" in failed.reason


def test_aux_tag_mismatch_fails_and_releases():
    r = Receiver()
    r.tracker.expect(5, "p", ["full"], 0, 10.0)
    write_tag(r.aux, 0, 6)
    r.written(5, "full", AUX_KEY)
    assert r.events() == [(5, EventKind.FAILED), (5, EventKind.RELEASE)]


def test_deadline_fails_but_holds_slots_until_acknowledged():
    r = Receiver()
    r.tracker.expect(5, "p", ["full"], 0, 0.0)
    r.tracker.tick()
    assert r.events() == [(5, EventKind.FAILED)] and r.sent == [("p", Notice(Kind.ABORT, 5))]
    r.tracker.tick()
    r.tracker.on_notice("q", Notice(Kind.ABORTED, 5))  # not the sender of this request
    assert r.events() == [] and r.tracker.pending == 1
    r.tracker.on_notice("p", Notice(Kind.ABORTED, 5))
    assert r.events() == [(5, EventKind.RELEASE)] and r.tracker.pending == 0


def test_the_next_deadline_is_the_earliest_one_not_yet_enforced_and_each_expect_says_so():
    r = Receiver()
    added = []
    r.tracker.on_expect = lambda: added.append(r.tracker.next_deadline())
    assert r.tracker.next_deadline() is None
    before = time.monotonic()
    r.tracker.expect(5, "p", ["full"], 0, 10.0)
    r.tracker.expect(6, "p", ["full"], 64, 0.0)
    assert len(added) == 2 and before + 10.0 <= added[0] and added[1] <= time.monotonic()
    r.tracker.tick()  # 6 fails: its slots stay held, but its deadline is done with
    assert r.events() == [(6, EventKind.FAILED)] and r.tracker.pending == 2
    assert r.tracker.next_deadline() == added[0]


def test_after_abort_every_write_landing_also_releases():
    r = Receiver()
    r.tracker.expect(5, "p", ["full"], 0, 10.0)
    r.tracker.abort(5, "client cancelled")
    r.written(5, "full", part=1, parts=2)
    assert r.events() == [(5, EventKind.FAILED)]
    r.written(5, AUX_KEY, "full", part=0, parts=2)
    assert r.events() == [(5, EventKind.RELEASE)]


def test_sender_failure_releases_at_once_and_peer_gone_releases_held_slots():
    r = Receiver()
    r.tracker.expect(5, "p", ["full"], 0, 10.0)
    r.tracker.expect(6, "p", ["full"], 64, 0.0)
    r.tracker.expect(7, "q", ["full"], 128, 10.0)
    r.tracker.on_notice("p", Notice(Kind.FAILED, 5))
    r.tracker.tick()
    assert r.events() == [(5, EventKind.FAILED), (5, EventKind.RELEASE), (6, EventKind.FAILED)]
    r.tracker.peer_gone("p")
    assert r.events() == [(6, EventKind.RELEASE)] and r.tracker.pending == 1
    assert r.metrics.peer("p").arrival_failures == 2


def test_unknown_tags_and_bad_expectations(caplog):
    r = Receiver()
    r.tracker.on_notice("p", Notice(Kind.WRITTEN, 99, ("full",)))
    r.tracker.abort(99)
    assert r.events() == [] and "unknown request 99" in caplog.text
    r.tracker.expect(5, "p", ["full"], 0, 1.0)
    with pytest.raises(ValueError, match="already expected"):
        r.tracker.expect(5, "p", ["full"], 0, 1.0)
    with pytest.raises(ValueError, match="outside region"):
        r.tracker.expect(6, "p", ["full"], 4 * 64, 1.0)
    with pytest.raises(ValueError, match="u64"):
        r.tracker.expect(-1, "p", ["full"], 0, 1.0)


def test_nixl_thread_inbox_is_fifo_times_out_and_wakes_a_waiting_get():
    inbox = _Inbox()
    try:
        with pytest.raises(queue.Empty):
            inbox.get(0.0)
        with pytest.raises(queue.Empty):
            inbox.get(0.001)
        for i in range(3):
            inbox.put(i)
        assert [inbox.get(0.0) for _ in range(3)] == [0, 1, 2]
        got = []
        waiter = threading.Thread(target=lambda: got.append(inbox.get(30.0)))
        waiter.start()
        inbox.put("late")  # before or while the waiter sleeps in select(): either way it returns it
        waiter.join(30.0)
        assert got == ["late"]
        with pytest.raises(queue.Empty):  # nothing left; a stale wake-up only ends a wait early
            inbox.get(0.001)
    finally:
        inbox.close()


class _Handle:
    def __init__(self, refuse: bool = False):
        self.refuse, self.released = refuse, 0

    def release(self):
        self.released += 1
        if self.refuse:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")


def _in_flight(handle: _Handle) -> Xfer:
    batch = resolve([aux()], table("a"), table("b", base=BASE << 1))[0]
    return Xfer(batch, b"", state="PROC", handle=handle)


def test_cancel_releases_in_flight_writes_unless_refused_or_copy_threads_run_them(caplog):
    done, accepted, refused, threaded = _Handle(), _Handle(), _Handle(refuse=True), _Handle()
    xfers = [_in_flight(accepted), _in_flight(refused)]
    finished = _in_flight(done)
    finished.state = "DONE"
    cancel(None, xfers + [finished])
    assert [x.state for x in xfers] == ["CANCELLED", "PROC"] and xfers[1].cancel_refused
    assert done.released == 0  # a finished WRITE is not cancelled
    # an agent with copy threads never releases a WRITE in flight: it is waited for instead
    on_threads = _in_flight(threaded)
    cancel(None, [on_threads], releasable=False)
    cancel(None, [on_threads], releasable=False)
    assert threaded.released == 0 and on_threads.state == "PROC" and on_threads.cancel_refused
    warnings = [r.getMessage() for r in caplog.records if "cannot be cancelled" in r.getMessage()]
    assert len(warnings) == 2 and "copy threads" in warnings[1]  # once per WRITE


def test_notifications_are_collected_fast_only_while_a_started_write_cannot_wait():
    """The NIXL thread polls every 0.1 ms for a WRITE to us that its sender said started, unless
    the receiver's engine is stepping (the arrival waits for that step anyway): then every 1 ms,
    as for a WRITE still to start and with WRITEs of its own in flight; 10 ms with nothing to come."""
    from baton.shared.transfer import nixl_thread as nt
    thread = nt.NixlThread.__new__(nt.NixlThread)  # the interval rule alone: no agent, no thread
    thread._watched, expected, started, busy = [], [False], [False], [False]
    thread.expecting, thread.due, thread.patient = (lambda: expected[0]), (lambda: started[0]), (lambda: busy[0])
    assert thread._progress_interval() == nt.IDLE_PROGRESS_S
    expected[0] = True
    assert thread._progress_interval() == nt.PROGRESS_S
    started[0] = True
    assert thread._progress_interval() == nt.EXPECTING_PROGRESS_S
    busy[0] = True
    assert thread._progress_interval() == nt.PROGRESS_S
    expected[0] = started[0] = False
    assert thread._progress_interval() == nt.IDLE_PROGRESS_S
    thread._watched = [object()]
    assert thread._progress_interval() == nt.PROGRESS_S


class _AgentWithoutCudaTransport:
    """nixl's agent where UCX has no CUDA support: DRAM registers, VRAM raises (as nixl-cu12 on an
    H100 with only CUDA 13's runtime did: NIXL_ERR_BACKEND)."""

    def register_memory(self, descs, kind):
        if kind == "VRAM":
            raise RuntimeError("NIXL_ERR_BACKEND")
        return ("reg", kind, len(descs))

    def prep_xfer_dlist(self, agent, rows, kind):
        return ("dlist", kind)

    def get_agent_metadata(self):
        return b"md"


def test_a_vram_region_nixl_cannot_register_is_refused_with_the_likely_cause():
    vram = RegionTable([Region("full", 0, BASE, 1024, 256, "VRAM", 0),
                        Region(AUX_KEY, 0, BASE + 8192, 4 * 64, 64)], "me")
    with pytest.raises(RuntimeError, match="libcudart.so.12") as raised:
        register(_AgentWithoutCudaTransport(), vram)
    assert str(raised.value) == VRAM_UNREGISTERED and "NIXL_ERR_BACKEND" in str(raised.value.__cause__)
    regs, items, metadata = register(_AgentWithoutCudaTransport(), table("me"))  # DRAM only: registers
    assert regs == [("reg", "DRAM", 3)] and items == {"DRAM": ("dlist", "DRAM")} and metadata == b"md"
