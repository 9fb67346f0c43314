"""Memory regions, transfer descriptors, and their resolution into NIXL descriptor rows.

`Descriptor` has the fields of `baton.shared.kv.Descriptor` and can be replaced by an import.
`Region` is one region of a component, flattened: from a kv manifest component `c`,
`Region(c.name, i, r.addr, r.nbytes, r.item_bytes) for i, r in enumerate(c.regions)`.
Everything here is pure logic on plain data: no NIXL calls, no threads.

A region is a component's memory, keyed (component, index): Baton's KV components are item-major
(`docs/architecture.md`), one region each (index 0) whose items hold every layer, so a run of
adjacent pages is one descriptor; the table also takes several regions per component (the
per-layer layout `bench/transfer.py --layout layer` compares against).
`nbytes = num_items * item_bytes`. NIXL sees every region as a list of items (pages or ring slots),
prepared once per agent and once per peer: the whole items of a descriptor become indices into
those prepared lists (the aux row's prefix goes as its whole row, so a worker's request is one
WRITE); what is left (any descriptor not on item boundaries) is sent as byte ranges through a
list prepared for that request.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

AUX_KEY = "aux/AUX"  # component key of the aux region (= baton.shared.kv's aux component name)
TAG_BYTES = 8  # an aux row starts with the request tag, u64 little-endian (written by the sender)
MAX_TAG = (1 << 64) - 1
SMALL_PLAN = 32  # descriptors up to which `resolve` first tries plain Python (`_whole_items`)
_ADDRESS_END = 1 << 63


def regions_of(manifest) -> list[Region]:
    """NIXL regions of a kv manifest (`baton.shared.kv.manifest.Manifest`, duck-typed: this module
    stays plain data): one per component region (item-major: every layer in each item)."""
    return [Region(comp.name, i, r.addr, r.nbytes, r.item_bytes)
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

    @property
    def key(self) -> tuple[str, int]:
        return (self.component_key, self.layer_index)

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_bytes


@dataclass(frozen=True)
class Descriptor:
    """`nbytes` bytes from `src_offset` of the sender's region to `dst_offset` of the receiver's
    region with the same (component_key, layer_index)."""
    component_key: str
    layer_index: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class Batch:
    """Bytes of one transfer that go as one WRITE, resolved against both sides' region tables.

    `by_item`: `local`/`remote` are int32 indices into the prepared per-item lists (whole items of
    any component). Otherwise they are [n, 3] uint64 rows (addr, nbytes, device 0) for a one-off
    prepared list (byte ranges). `components`: the component keys it carries, sorted."""
    components: tuple[str, ...]
    nbytes: int
    by_item: bool
    local: np.ndarray
    remote: np.ndarray

    @property
    def label(self) -> str:
        """Its components, comma-separated: how logs and errors name this WRITE."""
        return ",".join(self.components)


class RegionTable:
    """The regions of one agent (ours or a peer's), validated, with each region's first index in
    the agent's prepared per-item descriptor list (regions in the given order, items in order)."""

    def __init__(self, regions: list[Region], owner: str):
        self.owner = owner
        self.regions = list(regions)
        self._by_key: dict[tuple[str, int], Region] = {}
        first_item: list[int] = []
        count = 0
        for r in self.regions:
            _check_region(r, owner)
            if r.key in self._by_key:
                raise ValueError(f"{owner}: region {r.key} is registered twice")
            self._by_key[r.key] = r
            first_item.append(count)
            count += r.num_items
        spans = sorted(self.regions, key=lambda r: r.addr)
        for a, b in zip(spans, spans[1:]):
            if a.addr + a.nbytes > b.addr:
                raise ValueError(f"{owner}: regions {a.key} and {b.key} overlap in memory")
        # [regions, 4] int64 (item_bytes, addr, nbytes, first item): what `columns` gathers from
        self._columns = np.array([(r.item_bytes, r.addr, r.nbytes, first) for r, first in
                                  zip(self.regions, first_item)], dtype=np.int64).reshape(-1, 4)
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

    def item_rows(self) -> np.ndarray:
        """[num_items_total, 3] uint64 rows (addr, item_bytes, device 0), in index order."""
        rows = [_rows(r.addr + r.item_bytes * np.arange(r.num_items, dtype=np.uint64), r.item_bytes)
                for r in self.regions]
        return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.uint64)

    def region(self, key: tuple[str, int]) -> Region:
        region = self._by_key.get(key)
        if region is None:
            raise DescriptorError(f"{self.owner} has no region for component {key[0]!r} layer {key[1]}")
        return region

    def columns(self, names: list[str], component: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """[n, 4] int64 (item_bytes, addr, nbytes, first item) of the region of component
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
    """Resolve a transfer's descriptors (every component, aux row included) into at most two
    WRITEs: the whole items of every component by index into the prepared per-item lists, then
    the byte ranges (anything not on item boundaries) through one-off lists. An aux prefix on a
    row boundary goes as its whole row, so a plan of whole pages and slots is one WRITE. A
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
    carried, nbytes, auxes = set(), 0, 0
    for x in descriptors:
        key = (x.component_key, x.layer_index)
        src, dst = local._by_key.get(key), remote._by_key.get(key)
        if src is None or dst is None or src.item_bytes != dst.item_bytes or \
                not type(x.nbytes) is type(x.src_offset) is type(x.dst_offset) is int:
            return None
        ib, n = src.item_bytes, x.nbytes
        if x.component_key == AUX_KEY:
            auxes += 1
            n = max(n, ib) if n >= TAG_BYTES else 0  # as its whole row (_resolve_vectorised)
        if not (0 < n and n % ib == 0 and 0 <= x.src_offset and 0 <= x.dst_offset and x.src_offset % ib == 0
                and x.dst_offset % ib == 0 and x.src_offset + n <= src.nbytes and x.dst_offset + n <= dst.nbytes):
            return None
        count, first_src, first_dst = n // ib, local.first_item[key] + x.src_offset // ib, \
            remote.first_item[key] + x.dst_offset // ib
        local_items += range(first_src, first_src + count)
        remote_items += range(first_dst, first_dst + count)
        carried.add(x.component_key)
        nbytes += n
    if auxes != 1:
        return None
    return [Batch(tuple(sorted(carried)), nbytes, True, np.array(local_items, dtype=np.int32),
                  np.array(remote_items, dtype=np.int32))]


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
    ib, src_addr, src_size, src_first = local.columns(keys, component, layer).T
    dst_ib, dst_addr, dst_size, dst_first = remote.columns(keys, component, layer).T
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
    # The aux prefix (header + the hidden rows sent) goes as its whole row: the row is the
    # request's own slot on both sides and nothing reads past the header's row count (kv/aux.py),
    # and then a request is one WRITE, not two: no one-off lists, one post, one notification
    # (docs/benchmarks.md, issue 23, stop 25).
    nbytes = np.where(aux & aligned, np.maximum(nbytes, ib), nbytes)
    items = np.where(aligned, nbytes // ib, 0)  # [n] whole items
    tail = nbytes - items * ib  # [n] bytes sent as a range
    batches = []
    if items.any():
        owner = np.repeat(np.arange(len(d)), items)  # [items total] descriptor of each item
        within = np.arange(owner.size) - np.repeat(np.cumsum(items) - items, items)
        local_items = (src_first + src_off // ib)[owner] + within
        remote_items = (dst_first + dst_off // ib)[owner] + within
        batches.append(Batch(_carried(keys, component[items > 0]), int((items * ib).sum()), True,
                             local_items.astype(np.int32), remote_items.astype(np.int32)))
    if tail.any():
        r = tail > 0
        start = (items * ib)[r]
        size = tail[r].astype(np.uint64)
        batches.append(Batch(_carried(keys, component[r]), int(size.sum()), False,
                             _rows((src_addr + src_off)[r] + start, size),
                             _rows((dst_addr + dst_off)[r] + start, size)))
    return batches


def _carried(keys: list[str], component: np.ndarray) -> tuple[str, ...]:
    return tuple(sorted(keys[i] for i in np.unique(component)))


def _rows(addrs: np.ndarray, sizes) -> np.ndarray:
    rows = np.zeros((len(addrs), 3), dtype=np.uint64)  # (addr, nbytes, device id 0)
    rows[:, 0], rows[:, 1] = addrs, sizes
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
    if not 0 <= offset <= region.nbytes - TAG_BYTES:
        raise ValueError(f"aux offset {offset} is outside region {region.key} ({region.nbytes} bytes)")


def _check_region(r: Region, owner: str) -> None:
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
