"""Memory regions, transfer descriptors, and their resolution into NIXL descriptor rows.

`Descriptor` is the transfer plan's own (`baton.shared.kv.descriptors`): `nbytes` bytes from
`src_offset` of the sender's region to `dst_offset` of the receiver's region with the same
(component_key, layer_index).
`Region` is one region of a component, flattened: from a kv manifest component `c`,
`Region(c.name, i, r.addr, r.nbytes, r.item_bytes, c.mem_kind, c.device_id) for i, r in
enumerate(c.regions)`. Its memory kind ("DRAM" host, "VRAM" a GPU's) and device id are what NIXL
registers it as; the aux rows are host memory on every device (kv/store.py), so the tag is read
and written through a host pointer, never one into device memory.
Everything here is pure logic on plain data: no NIXL calls, no threads.

A region is a component's memory, keyed (component, index): Baton's KV components are item-major
(`docs/architecture.md`), one region each (index 0) whose items hold every layer, so a run of
adjacent pages is one descriptor; the table also takes several regions per component (the
per-layer layout `bench/transfer.py --layout layer` compares against).
`nbytes = num_items * item_bytes`. NIXL sees every region as a list of items (pages or ring slots),
prepared once per agent and once per peer: the whole items of a descriptor become indices into
those prepared lists (the aux rows are registered in blocks, kv/aux.py, and a row's prefix goes
as the whole blocks it covers, so a worker's request is one WRITE); what is left (any descriptor not on item boundaries) is sent as byte ranges through a
list prepared for that request. Prepared lists are one per memory kind (NIXL's lists have one),
so a request whose KV is in VRAM and aux row in DRAM is two WRITEs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from baton.shared.kv.descriptors import Descriptor

AUX_KEY = "aux/AUX"  # component key of the aux region (= baton.shared.kv's aux component name)
TAG_BYTES = 8  # an aux row starts with the request tag, u64 little-endian (written by the sender)
MAX_TAG = (1 << 64) - 1
MEM_KINDS = ("DRAM", "VRAM")  # NIXL's names for host and GPU memory
SMALL_PLAN = 32  # descriptors up to which `resolve` first tries plain Python (`_whole_items`)
_ADDRESS_END = 1 << 63


def regions_of(manifest) -> list[Region]:
    """NIXL regions of a kv manifest (`baton.shared.kv.manifest.Manifest`, duck-typed: this module
    stays plain data): one per component region (item-major: every layer in each item)."""
    return [Region(comp.name, i, r.addr, r.nbytes, r.item_bytes, comp.mem_kind, comp.device_id)
            for comp in manifest.components for i, r in enumerate(comp.regions)]


class DescriptorError(ValueError):
    """A transfer request that does not fit the registered regions; fails that request only."""


@dataclass(frozen=True)
class Region:
    component_key: str
    layer_index: int
    addr: int
    nbytes: int
    item_bytes: int
    mem_kind: str = "DRAM"  # NIXL memory kind: DRAM | VRAM
    device_id: int = 0  # the GPU of a VRAM region (0 for DRAM)

    @property
    def key(self) -> tuple[str, int]:
        return (self.component_key, self.layer_index)

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_bytes


@dataclass(frozen=True, eq=False)
class Batch:
    """Bytes of one transfer that go as one WRITE, resolved against both sides' region tables.

    `by_item`: `local`/`remote` are int32 indices into the prepared per-item lists (whole items of
    any component). Otherwise they are [n, 3] uint64 rows (addr, nbytes, device id) for a one-off
    prepared list (byte ranges). `components`: the component keys it carries, sorted.
    `local_kind`, `remote_kind`: the memory kind of its bytes on each side (one per WRITE)."""
    components: tuple[str, ...]
    nbytes: int
    by_item: bool
    local: np.ndarray
    remote: np.ndarray
    local_kind: str = "DRAM"
    remote_kind: str = "DRAM"

    @property
    def label(self) -> str:
        """Its components, comma-separated: how logs and errors name this WRITE."""
        return ",".join(self.components)


class RegionTable:
    """The regions of one agent (ours or a peer's), validated, with each region's first index in
    the agent's prepared per-item descriptor list of its memory kind (one list per kind, in
    `kinds` order; regions in the given order, items in order)."""

    def __init__(self, regions: list[Region], owner: str):
        self.owner = owner
        self.regions = list(regions)
        self.kinds = tuple(dict.fromkeys(r.mem_kind for r in self.regions))  # memory kinds, first seen first
        self._by_key: dict[tuple[str, int], Region] = {}
        first_item: list[int] = []
        count = dict.fromkeys(self.kinds, 0)  # items so far in each kind's list
        for r in self.regions:
            _check_region(r, owner)
            if r.key in self._by_key:
                raise ValueError(f"{owner}: region {r.key} is registered twice")
            self._by_key[r.key] = r
            first_item.append(count[r.mem_kind])
            count[r.mem_kind] += r.num_items
        spans = sorted(self.regions, key=lambda r: (r.mem_kind, r.device_id, r.addr))
        for a, b in zip(spans, spans[1:]):
            if (a.mem_kind, a.device_id) == (b.mem_kind, b.device_id) and a.addr + a.nbytes > b.addr:
                raise ValueError(f"{owner}: regions {a.key} and {b.key} overlap in memory")
        # [regions, 6] int64 (item_bytes, addr, nbytes, first item, kind index, device id): what
        # `columns` gathers from
        self._columns = np.array([(r.item_bytes, r.addr, r.nbytes, first, self.kinds.index(r.mem_kind), r.device_id)
                                  for r, first in zip(self.regions, first_item)], dtype=np.int64).reshape(-1, 6)
        self.first_item = {r.key: first for r, first in zip(self.regions, first_item)}  # index of its item 0
        # the row of region (component, layer) is _row_of[_layer_base[component] + layer], -1 if none
        self._layer_base: dict[str, int] = {}
        self._layer_count: dict[str, int] = {}
        row_of: list[int] = []
        for key in dict.fromkeys(r.component_key for r in self.regions):
            layers = {r.layer_index: row for row, r in enumerate(self.regions) if r.component_key == key}
            count = max(layers) + 1
            self._layer_base[key], self._layer_count[key] = len(row_of), count
            row_of += [layers.get(i, -1) for i in range(count)]
        self._row_of = np.array(row_of, dtype=np.int64)

    def item_rows(self, kind: str) -> np.ndarray:
        """[items of that kind, 3] uint64 rows (addr, item_bytes, device id), in index order: the
        per-item list of memory kind `kind`."""
        rows = [_rows(r.addr + r.item_bytes * np.arange(r.num_items, dtype=np.uint64), r.item_bytes, r.device_id)
                for r in self.regions if r.mem_kind == kind]
        return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.uint64)

    def region(self, key: tuple[str, int]) -> Region:
        region = self._by_key.get(key)
        if region is None:
            raise DescriptorError(f"{self.owner} has no region for component {key[0]!r} layer {key[1]}")
        return region

    def columns(self, names: list[str], component: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """[n, 6] int64 (item_bytes, addr, nbytes, first item, kind index, device id) of the region of component
        names[component[i]], layer layers[i], for each i; DescriptorError naming the first (component,
        layer) that has no region."""
        base = np.array([self._layer_base.get(k, -1) for k in names], dtype=np.int64)[component]
        count = np.array([self._layer_count.get(k, 0) for k in names], dtype=np.int64)[component]
        known = (base >= 0) & (layers >= 0) & (layers < count)
        rows = np.full(len(layers), -1, dtype=np.int64)
        rows[known] = self._row_of[(base + layers)[known]]
        if (rows < 0).any():
            i = int(np.argmax(rows < 0))
            self.region((names[component[i]], int(layers[i])))  # raises
        return self._columns[rows]


def resolve(descriptors: list[Descriptor], local: RegionTable, remote: RegionTable) -> list[Batch]:
    """Resolve a transfer's descriptors (every component, aux row included) into as few WRITEs
    as the memory kinds allow (one where both sides keep everything in one kind, as on the CPU):
    the whole items of every component by index into the prepared per-item lists, then the byte
    ranges (anything not on item boundaries) through one-off lists, each per pair of kinds. An aux prefix on a
    block boundary goes as the whole blocks it covers, so a plan of whole pages and slots is one WRITE. A
    descriptor starting on an item boundary on both sides sends its whole items by index and its
    tail as a range; any other descriptor is one range. One WRITE per request, not one per
    component: each WRITE costs a post, a notification and a completion check (on 2 cores about
    0.1 ms each), which dominated small requests. Vectorised: a large request has thousands of
    descriptors (layers x pages).

    Raises DescriptorError naming the offending descriptor: unknown region on either side, item
    sizes that differ between the sides, a range outside a region, or not exactly one aux row."""
    if len(descriptors) <= SMALL_PLAN:
        whole = _whole_items(descriptors, local, remote)
        if whole is not None:
            return whole
    return _resolve_vectorised(descriptors, local, remote)


def _whole_items(descriptors: list[Descriptor], local: RegionTable, remote: RegionTable) -> list[Batch] | None:
    """`resolve` for the common small plan, in plain Python (numpy's per-call cost made a 4-descriptor
    plan take ~0.27 ms in the service against ~0.03 here): every descriptor whole items on both
    sides, exactly one aux; None for anything else, which the vectorised path resolves or refuses."""
    local_items: list[int] = []
    remote_items: list[int] = []
    carried, nbytes, auxes, kinds = set(), 0, 0, set()
    for x in descriptors:
        key = (x.component_key, x.layer_index)
        src, dst = local._by_key.get(key), remote._by_key.get(key)
        if src is None or dst is None or src.item_bytes != dst.item_bytes or \
                not type(x.nbytes) is type(x.src_offset) is type(x.dst_offset) is int:
            return None
        kinds.add((src.mem_kind, dst.mem_kind))
        ib, n = src.item_bytes, x.nbytes
        if x.component_key == AUX_KEY:
            auxes += 1
            n = -(-n // ib) * ib if n >= TAG_BYTES else 0  # as whole blocks (_resolve_vectorised)
        if not (0 < n and n % ib == 0 and 0 <= x.src_offset and 0 <= x.dst_offset and x.src_offset % ib == 0
                and x.dst_offset % ib == 0 and x.src_offset + n <= src.nbytes and x.dst_offset + n <= dst.nbytes):
            return None
        count, first_src, first_dst = n // ib, local.first_item[key] + x.src_offset // ib, \
            remote.first_item[key] + x.dst_offset // ib
        local_items += range(first_src, first_src + count)
        remote_items += range(first_dst, first_dst + count)
        carried.add(x.component_key)
        nbytes += n
    if auxes != 1 or len(kinds) != 1:
        return None
    (local_kind, remote_kind), = kinds
    return [Batch(tuple(sorted(carried)), nbytes, True, np.array(local_items, dtype=np.int32),
                  np.array(remote_items, dtype=np.int32), local_kind, remote_kind)]


def _resolve_vectorised(descriptors: list[Descriptor], local: RegionTable, remote: RegionTable) -> list[Batch]:
    names: dict[str, int] = {}
    try:
        d = np.array([(names.setdefault(x.component_key, len(names)), x.layer_index, x.src_offset,
                       x.dst_offset, x.nbytes) for x in descriptors], dtype=np.int64).reshape(-1, 5)
    except (OverflowError, TypeError, ValueError) as e:
        raise DescriptorError(f"descriptor fields must be integers within int64: {e}") from e
    component, layer, src_off, dst_off, nbytes = d.T  # [n] each
    if AUX_KEY not in names:
        raise DescriptorError("transfer has no aux descriptor; the aux row carries the request tag")
    aux = component == names[AUX_KEY]
    if aux.sum() != 1 or nbytes[aux][0] < TAG_BYTES:
        raise DescriptorError(f"transfer needs exactly one aux descriptor of >= {TAG_BYTES} bytes")
    keys = list(names)
    ib, src_addr, src_size, src_first, src_kind, src_dev = local.columns(keys, component, layer).T
    dst_ib, dst_addr, dst_size, dst_first, dst_kind, dst_dev = remote.columns(keys, component, layer).T
    if (ib != dst_ib).any():
        i = int(np.argmax(ib != dst_ib))
        raise DescriptorError(f"component {keys[component[i]]!r} layer {layer[i]}: item sizes differ "
                              f"(local {ib[i]} B, remote {dst_ib[i]} B), so the two descriptor lists "
                              "would not match")
    bad = (nbytes <= 0) | (src_off < 0) | (dst_off < 0) | (nbytes > src_size - src_off) \
        | (nbytes > dst_size - dst_off)  # (offset + nbytes could wrap around int64)
    if bad.any():
        x = descriptors[int(np.argmax(bad))]
        _check_descriptor(x, local.region((x.component_key, x.layer_index)),
                          remote.region((x.component_key, x.layer_index)))
    aligned = (src_off % ib == 0) & (dst_off % ib == 0)  # [n] starts on an item on both sides
    # The aux prefix (header + the hidden rows sent) goes as the whole blocks it covers: a row is
    # whole blocks (kv/aux.py), the request's own slot on both sides, and nothing reads past the
    # header's row count; then a request is one WRITE, not two: no one-off lists, one post, one
    # notification (docs/benchmarks.md, issue 23, stop 25).
    nbytes = np.where(aux & aligned, -(-nbytes // ib) * ib, nbytes)
    items = np.where(aligned, nbytes // ib, 0)  # [n] whole items
    tail = nbytes - items * ib  # [n] bytes sent as a range
    batches = []
    for kind_pair in sorted(set(zip(src_kind.tolist(), dst_kind.tolist()))):
        same = (src_kind == kind_pair[0]) & (dst_kind == kind_pair[1])  # [n] descriptors of this pair
        kinds = (local.kinds[kind_pair[0]], remote.kinds[kind_pair[1]])
        n_items = np.where(same, items, 0)
        if n_items.any():
            owner = np.repeat(np.arange(len(d)), n_items)  # [items total] descriptor of each item
            within = np.arange(owner.size) - np.repeat(np.cumsum(n_items) - n_items, n_items)
            local_items = (src_first + src_off // ib)[owner] + within
            remote_items = (dst_first + dst_off // ib)[owner] + within
            batches.append(Batch(_carried(keys, component[n_items > 0]), int((n_items * ib).sum()), True,
                                 local_items.astype(np.int32), remote_items.astype(np.int32), *kinds))
        r = same & (tail > 0)
        if r.any():
            start = (items * ib)[r]
            size = tail[r].astype(np.uint64)
            batches.append(Batch(_carried(keys, component[r]), int(size.sum()), False,
                                 _rows((src_addr + src_off)[r] + start, size, src_dev[r]),
                                 _rows((dst_addr + dst_off)[r] + start, size, dst_dev[r]), *kinds))
    return sorted(batches, key=lambda b: not b.by_item)  # whole items first, as before


def _carried(keys: list[str], component: np.ndarray) -> tuple[str, ...]:
    return tuple(sorted(keys[i] for i in np.unique(component)))


def _rows(addrs: np.ndarray, sizes, devices) -> np.ndarray:
    rows = np.zeros((len(addrs), 3), dtype=np.uint64)  # (addr, nbytes, device id)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, sizes, devices
    return rows


def write_tag(region: Region, offset: int, tag: int) -> None:
    """Stamp `tag` at the start of the aux row at byte `offset` of `region` (our own memory)."""
    _check_row(region, offset)
    ctypes.memmove(region.addr + offset, tag.to_bytes(TAG_BYTES, "little"), TAG_BYTES)


def read_tag(region: Region, offset: int) -> int:
    """The tag at the start of the aux row at byte `offset` of `region` (our own memory)."""
    _check_row(region, offset)
    return int.from_bytes(ctypes.string_at(region.addr + offset, TAG_BYTES), "little")


def _check_row(region: Region, offset: int) -> None:
    if region.mem_kind != "DRAM":  # a host pointer into device memory would crash the process
        raise ValueError(f"aux region {region.key} is {region.mem_kind}: tags are read and written in host "
                         "memory only (the store keeps its aux rows there on every device)")
    if not 0 <= offset <= region.nbytes - TAG_BYTES:
        raise ValueError(f"aux offset {offset} is outside region {region.key} ({region.nbytes} bytes)")


def _check_region(r: Region, owner: str) -> None:
    if r.mem_kind not in MEM_KINDS or r.device_id < 0:
        raise ValueError(f"{owner}: region {r.key} has memory kind {r.mem_kind!r} device {r.device_id}; "
                         f"expected one of {', '.join(MEM_KINDS)} and a device id >= 0")
    if "," in r.component_key:  # notices list components comma-separated
        raise ValueError(f"{owner}: component key {r.component_key!r} must not contain ','")
    if r.addr <= 0 or r.item_bytes <= 0 or r.nbytes <= 0 or r.nbytes % r.item_bytes:
        raise ValueError(f"{owner}: region {r.key} must have addr > 0 and nbytes a positive multiple "
                         f"of item_bytes (addr={r.addr:#x}, nbytes={r.nbytes}, item_bytes={r.item_bytes})")
    if r.addr + r.nbytes > _ADDRESS_END:  # resolve computes addresses in int64
        raise ValueError(f"{owner}: region {r.key} ends at {r.addr + r.nbytes:#x}, past any user-space address")


def _check_descriptor(d: Descriptor, src: Region, dst: Region) -> None:
    where = f"descriptor {d.component_key!r} layer {d.layer_index}"
    if d.nbytes <= 0 or d.src_offset < 0 or d.dst_offset < 0:
        raise DescriptorError(f"{where}: nbytes must be > 0 and offsets >= 0, got {d}")
    if d.src_offset + d.nbytes > src.nbytes:
        raise DescriptorError(f"{where}: source range ends at {d.src_offset + d.nbytes}, "
                              f"past the local region's {src.nbytes} bytes")
    if d.dst_offset + d.nbytes > dst.nbytes:
        raise DescriptorError(f"{where}: destination range ends at {d.dst_offset + d.nbytes}, "
                              f"past the remote region's {dst.nbytes} bytes")
