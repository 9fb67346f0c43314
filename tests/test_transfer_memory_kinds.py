"""Memory kinds on the transfer path (issue 27): a GPU worker's KV regions are VRAM on its device,
its aux rows DRAM. Each region is registered with NIXL as its own kind and device id, prepared
lists are one per kind, a request's WRITEs never mix kinds, and request tags are read and written
only in host memory. NIXL itself is a recording fake here (no VRAM on this machine); the same
calls run against real agents in DRAM in tests/test_transfer_agent.py."""
from __future__ import annotations

import numpy as np
import pytest

from baton.shared.transfer import AUX_KEY, Descriptor, Region
from baton.shared.transfer import nixl_ops
from baton.shared.transfer.regions import RegionTable, read_tag, resolve, write_tag

pytestmark = pytest.mark.unit

HOST, GPU = 1 << 32, 1 << 40
ITEM, AUX_ITEM = 256, 64


def gpu_worker(owner: str, device: int, shift: int = 0) -> RegionTable:
    """Two KV components in VRAM of `device`, the aux rows in host memory."""
    return RegionTable([Region("target/FULL", 0, (GPU << shift), 8 * ITEM, ITEM, "VRAM", device),
                        Region("target/SWA_RING", 0, (GPU << shift) + 8 * ITEM, 4 * ITEM, ITEM, "VRAM", device),
                        Region(AUX_KEY, 0, HOST << shift, 4 * AUX_ITEM, AUX_ITEM)], owner)


class FakeList:
    def __init__(self, log: list, what: tuple) -> None:
        self.log, self.what = log, what

    def release(self) -> None:
        self.log.append(("release", *self.what))


class FakeAgent:
    """Records the NIXL calls nixl_ops makes, with their memory kinds and device ids."""

    def __init__(self) -> None:
        self.log: list = []

    def register_memory(self, rows, kind):
        self.log.append(("register", kind, [tuple(r) for r in rows]))
        return ("reg", kind)

    def deregister_memory(self, reg):
        self.log.append(("deregister", reg))

    def prep_xfer_dlist(self, agent, rows, kind):
        rows = np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
        self.log.append(("prep", agent, kind, rows.tolist()))
        return FakeList(self.log, (agent, kind))

    def get_agent_metadata(self):
        return b"meta"

    def add_remote_agent(self, metadata):
        return b"peer"

    def make_connection(self, name):
        pass

    def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx, notif):
        self.log.append(("xfer", local.what, list(local_idx), remote.what, list(remote_idx)))
        return FakeList(self.log, ("xfer",))

    def transfer(self, handle):
        return "DONE"


def test_each_region_is_registered_as_its_memory_kind_and_device_with_one_prepared_list_per_kind():
    agent, table = FakeAgent(), gpu_worker("me", device=3)
    regs, items, metadata = nixl_ops.register(agent, table)
    registered = {entry[1]: entry[2] for entry in agent.log if entry[0] == "register"}
    assert registered == {"VRAM": [(GPU, 8 * ITEM, 3, ""), (GPU + 8 * ITEM, 4 * ITEM, 3, "")],
                          "DRAM": [(HOST, 4 * AUX_ITEM, 0, "")]}
    prepared = {entry[2]: entry[3] for entry in agent.log if entry[0] == "prep"}
    assert [row[2] for row in prepared["VRAM"]] == [3] * 12  # every item of both KV regions, device 3
    assert [row[0] for row in prepared["DRAM"]] == [HOST + i * AUX_ITEM for i in range(4)]
    assert set(items) == {"VRAM", "DRAM"} and metadata == b"meta"
    nixl_ops.deregister(agent, regs, items)
    assert sorted(e for e in agent.log if e[0] == "deregister") == [("deregister", ("reg", "DRAM")),
                                                                     ("deregister", ("reg", "VRAM"))]


def test_a_request_is_one_write_per_memory_kind_from_and_to_that_kinds_lists():
    local, remote = gpu_worker("me", device=0), gpu_worker("peer", device=1, shift=1)
    plan = [Descriptor("target/FULL", 0, 0, 2 * ITEM, 2 * ITEM), Descriptor("target/SWA_RING", 0, ITEM, 0, ITEM),
            Descriptor(AUX_KEY, 0, AUX_ITEM, 2 * AUX_ITEM, 24)]
    batches = resolve(plan, local, remote)
    assert [(b.components, b.local_kind, b.remote_kind, b.by_item) for b in batches] == [
        (("target/FULL", "target/SWA_RING"), "VRAM", "VRAM", True), ((AUX_KEY,), "DRAM", "DRAM", True)]
    assert list(batches[0].local) == [0, 1, 9] and list(batches[0].remote) == [2, 3, 8]  # VRAM list indices
    assert list(batches[1].local) == [1] and list(batches[1].remote) == [2]  # DRAM list: the aux rows

    agent = FakeAgent()
    _, ours, _ = nixl_ops.register(agent, local)
    _, theirs = nixl_ops.connect(agent, b"meta", remote)
    xfers = [nixl_ops.Xfer(b, b"") for b in batches]
    nixl_ops.post(agent, ours, "peer", theirs, xfers)
    assert [x.state for x in xfers] == ["DONE", "DONE"]
    posted = [e for e in agent.log if e[0] == "xfer"]
    assert [(e[1], e[3]) for e in posted] == [(("NIXL_INIT_AGENT", "VRAM"), ("peer", "VRAM")),
                                              (("NIXL_INIT_AGENT", "DRAM"), ("peer", "DRAM"))]


def test_byte_ranges_carry_their_regions_device_ids():
    local, remote = gpu_worker("me", device=2), gpu_worker("peer", device=5, shift=1)
    plan = [Descriptor("target/FULL", 0, 10, 20, 100), Descriptor(AUX_KEY, 0, 0, 0, 24)]
    ranges = [b for b in resolve(plan, local, remote) if not b.by_item]
    assert [(b.local_kind, b.local[:, 2].tolist(), b.remote[:, 2].tolist()) for b in ranges] == [
        ("VRAM", [2], [5])]
    assert ranges[0].local[0, 0] == GPU + 10 and ranges[0].remote[0, 0] == (GPU << 1) + 20


def test_tags_are_read_and_written_only_in_host_memory():
    aux = np.zeros(4 * AUX_ITEM, dtype=np.uint8)
    host = Region(AUX_KEY, 0, aux.ctypes.data, aux.nbytes, AUX_ITEM)
    write_tag(host, AUX_ITEM, 0xFEEDFACE)
    assert read_tag(host, AUX_ITEM) == 0xFEEDFACE
    device = Region(AUX_KEY, 0, GPU, 4 * AUX_ITEM, AUX_ITEM, "VRAM", 0)
    for call in (lambda: write_tag(device, 0, 1), lambda: read_tag(device, 0)):
        with pytest.raises(ValueError, match=r"is VRAM: tags are read and written in host memory only"):
            call()


def test_an_unknown_memory_kind_is_refused_when_the_table_is_built():
    with pytest.raises(ValueError, match=r"memory kind 'HBM' .* expected one of DRAM, VRAM"):
        RegionTable([Region("target/FULL", 0, GPU, ITEM, ITEM, "HBM", 0)], "me")
