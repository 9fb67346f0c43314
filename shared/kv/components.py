"""State components: what one block of KV memory is (identity), its shape (geometry), and where
it lives (one region, for NIXL registration). Frozen msgspec Structs: the protocol (proto/) carries
them as typed fields, decoded and checked in C, unknown fields refused.

Storage layout of a KV component (docs/architecture.md), item-major:
    data: [num_items, num_layers, item_rows, 2, kv_heads, head_dim]
an item is a page (FULL, SWA: item_rows = page_size) or a ring slot (SWA_RING: item_rows = R)
and holds every layer of the component: item i is bytes [i * item_bytes, (i + 1) * item_bytes)
of the component's one region, item_bytes = num_layers * item_rows * row_bytes. The layout is
part of the geometry (`order`, `layers_per_item`, `item_bytes` = the item stride), so a peer that
stores another layout is refused by the plan, never paired byte for byte.
The aux component is one byte tensor [1, num_slots, item_bytes] (header + hidden rows).
"""
from __future__ import annotations

import msgspec

from baton.shared.kv.routing import PoolKey

ITEM_MAJOR = "item_major"  # data: [items, layers, item_rows, ...]; the only layout Baton stores


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV record that travels: immutable, and a peer's record with a field this version does not
    know is refused, never half read."""


class ComponentId(Record):
    owner: str  # "target" | "draft" | "aux"
    kind: str  # FULL | SWA | SWA_RING | AUX
    layer_ids: tuple[int, ...]  # model layer ids held, in region order; () for aux

    @property
    def key(self) -> PoolKey:
        return PoolKey(self.owner, self.kind)

    @property
    def name(self) -> str:
        return self.key.name


class Geometry(Record):
    dtype: str  # element dtype of the rows ("float32", "bfloat16", ...)
    item_rows: int  # page size (FULL, SWA), ring size R (SWA_RING), hidden rows (AUX)
    num_items: int  # pages (FULL, SWA) or slots (SWA_RING, AUX)
    row_bytes: int  # bytes of one row: K+V of one position, or one hidden state
    header_bytes: int  # bytes before the rows of an item (AUX header; 0 for KV)
    item_bytes: int  # item stride: layers_per_item * item_rows * row_bytes (KV); header_bytes +
    #                  item_rows * row_bytes, rounded up to 8 (AUX)
    window: int | None  # sliding window W of the layers (None for FULL and AUX)
    kv_heads: int  # 0 for AUX
    head_dim: int  # 0 for AUX
    order: str  # storage order of the items, ITEM_MAJOR
    layers_per_item: int  # layers an item holds (the component's layers; 0 for AUX)
    index_map: str | None = None  # paged SWA: identity of the full->SWA page mapping used


class Region(Record):
    addr: int  # base address of the component's region
    nbytes: int  # num_items * item_bytes
    item_bytes: int


class Component(Record):
    ident: ComponentId
    geometry: Geometry
    regions: tuple[Region, ...]  # one: the whole component (every item, every layer)
    mem_kind: str = "DRAM"  # NIXL memory kind: "DRAM" | "VRAM"
    device_id: int = 0

    @property
    def key(self) -> PoolKey:
        return self.ident.key

    @property
    def name(self) -> str:
        return self.ident.name


class Allocation(Record):
    """Where one request's state lives in a worker's components (ReserveReply, PrefillTarget)."""

    request_id: str
    num_tokens: int  # positions reserved at allocate time
    length: int  # positions extended so far (0..length-1 may be written)
    floor: int  # first position whose sliding-window rows are still intact
    slot: int  # ring slot (SWA_RING) and aux row
    page_ids: tuple[int, ...]  # page table: FULL page of page index i (positions i*ps ..)
    swa_page_ids: tuple[int, ...] = ()  # paged SWA: SWA page of page index i, -1 if released
    reused: int = 0  # FULL positions below this are held already (shared pages): a plan writes FULL from here
