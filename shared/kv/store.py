"""KVStore: a worker's KV components (tensors) and the per-request allocators behind them.

Tensors (docs/architecture.md), one per component, routed by `route_layers`, item-major (an
item, a page or a ring slot, holds every layer of its component, so it is one contiguous run of
bytes and a run of adjacent items is one NIXL descriptor):
    FULL      data: [num_pages,     layers, page_size, 2, kv_heads, head_dim]
    SWA       data: [num_swa_pages, layers, page_size, 2, kv_heads, head_dim]  (mode "paged")
    SWA_RING  data: [num_slots,     layers, R,         2, kv_heads, head_dim]  (mode "ring")
    AUX       data: [1, num_slots, item_bytes] uint8, in host memory on every device
with R = span = W + max_draft_tokens. Draft FULL layers share the target's page tables; draft
sliding layers share the target's slot (ring) or full->SWA mapping (paged).

Rows. A layer's K/V are read and written as rows of `kv_rows(layer)`, a view of the component
starting at that layer's first row in item 0: the row of (item i, offset o) is
`i * item_stride(key) + o`, with `item_stride = layers * item_rows` (rows from one item to the next
in any layer), the same for every layer of the pool, so one set of row indices serves them all.

Request lifecycle. Two owners share a store, and need no lock: reservations (`allocate`, `free`:
the page, slot and SWA-page pools, the block table row of a new slot) may run on a service's
event loop while its engine thread advances the requests it holds (`extend`, `rollback`, reads
of the block table and the SWA mapping for those requests). No structure is mutated by both:
the pools only by allocate/free, a request's lengths and SWA mapping only by its own
extend/rollback (and by free, once no step holds it), and the dictionaries both touch only see
single inserts, pops and lookups, which the GIL makes atomic. A request is freed only when no
step is using it.
    allocate(rid, num_tokens)  reserve all pages for num_tokens positions, one slot and (paged)
                               the SWA pages of a span; all-or-nothing, else OutOfCapacity
    extend(rid, new_len)       positions length..new_len-1 become writable; never fails within
                               the reservation. Sliding rows keep positions >= new_len - span:
                               older ring rows get overwritten, older SWA pages are released
    rollback(rid, new_len)     rewind the length (rejected drafts); refused if the sliding window
                               of new_len is no longer intact
    free(rid)                  return everything

Shared pages. `allocate(rid, n, shared_pages=...)` starts a request's page table with pages it
does not own alone: FULL pages of an earlier prompt that the prefix cache (prefix_cache.py) pins
with `pin`. A taken page counts its holders (requests and pins) and goes back to the pool when
the last one lets go; a request never writes a shared page (they lie below the position it
starts from). `free_capacity` counts pages only pins hold as free: the cache gives them up on
demand.

The engine writes K/V of positions [max(old_len, first_resident), new_len) after an extend, at
`rows(rid, layer, positions)` of `kv_buffer(layer)`. An extend of more than max_draft_tokens + 1
positions (a prefill chunk) must take in-chunk keys from its own K/V, not from sliding storage.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.shared.kv.allocator import IdPool, KVError, OutOfCapacity, require
from baton.shared.kv.aux import HEADER_BYTES, AuxLayout
from baton.shared.kv.budget import (aux_layout, dtype_name, kv_row_bytes, sliding_span,
                                    swa_pages_per_request)
from baton.shared.kv.components import (ITEM_MAJOR, Allocation, Component, ComponentId, Geometry,
                                        Region)
from baton.shared.kv.host_memory import huge_page_zeros
from baton.shared.kv.manifest import Manifest
from baton.shared.kv.paged_swa import PagedSwa
from baton.shared.kv.routing import AUX_KEY, FULL, SWA, SWA_RING, PoolKey, route_layers
from baton.shared.config import WorkerSection
from baton.shared.model.config import ModelConfig


@dataclass
class RequestKV:
    """One request's reservation and progress (the store's own bookkeeping)."""
    num_tokens: int
    pages: list[int]
    page_table: torch.Tensor  # [len(pages)] long, on the store's device
    slot: int
    length: int = 0
    floor: int = 0  # first position whose sliding rows are intact
    shared: int = 0  # its first pages are shared ones (held already, never written)


@dataclass(frozen=True)
class FreeCapacity:
    pages: int
    slots: int
    swa_pages: int


class KVStore:
    @classmethod
    def for_worker(cls, cfg: ModelConfig, worker: WorkerSection, *, draft_enabled: bool,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "KVStore":
        """The store a [worker] section describes (storage mode, pages, slots, k); `draft_enabled`:
        a draft window per slot (for the MTP draft)."""
        return cls(cfg, mode=worker.kv_mode, num_pages=worker.num_pages, page_size=worker.page_size,
                   num_slots=worker.num_slots, max_draft_tokens=worker.draft_tokens, dtype=dtype,
                   draft_enabled=draft_enabled, device=device)

    def __init__(self, cfg: ModelConfig, *, mode: str = "ring", num_pages: int, page_size: int,
                 num_slots: int, max_draft_tokens: int, dtype: torch.dtype = torch.float32,
                 draft_enabled: bool = True, num_swa_pages: int | None = None,
                 device: str | torch.device = "cpu"):
        self.cfg, self.mode, self.dtype = cfg, mode, dtype
        self.page_size, self.max_draft_tokens = page_size, max_draft_tokens
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the id NIXL registers
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.routing = route_layers(cfg, mode)
        self.span = sliding_span(cfg, max_draft_tokens)  # ring rows R; resident sliding positions
        self.keys: tuple[PoolKey, ...] = self.routing.keys(draft_enabled)
        self.pages = IdPool(num_pages, "pages")
        self.page_refs = np.zeros(num_pages, dtype=np.int64)  # [P] holders of each page: requests + pins
        self.page_pins = np.zeros(num_pages, dtype=np.int64)  # [P] of which pins (the prefix cache)
        self.slots = IdPool(num_slots, "slots")
        if num_swa_pages is None:
            num_swa_pages = num_slots * swa_pages_per_request(self.span, page_size)
        paged = mode == "paged" and any(key.kind == SWA for key in self.keys)
        self.swa = PagedSwa(num_pages, num_swa_pages) if paged else None
        shape = (2, cfg.num_key_value_heads, cfg.head_dim)
        items = {FULL: (num_pages, page_size), SWA: (num_swa_pages, page_size),
                 SWA_RING: (num_slots, self.span)}
        self.data: dict[PoolKey, torch.Tensor] = {
            key: self._zeros((items[key.kind][0], len(self.routing.layers_of(key)), items[key.kind][1],
                              *shape), dtype)
            for key in self.keys}  # [items, layers, item_rows, 2, kv_heads, head_dim]
        self.aux_layout: AuxLayout = aux_layout(cfg)
        self.aux = self._host_zeros((1, num_slots, self.aux_layout.item_bytes),
                                    torch.uint8)  # [1, num_slots, item_bytes], host memory on any device
        self._layer = {layer_id: (key, i) for key in self.keys
                       for i, layer_id in enumerate(self.routing.layers_of(key))}
        self._requests: dict[str, RequestKV] = {}
        self.windows = {key: cfg.window_of(self.routing.layers_of(key)[0]) for key in self.keys}  # per pool
        # FULL page ids of each slot's request, which the engine's per-step metadata reads on the
        # host (nano-vllm's block_tables): [num_slots, max_pages_per_request] int64, in host memory
        self.max_pages_per_request = min(num_pages, -(-(cfg.max_position_embeddings + max_draft_tokens + 1)
                                                    // page_size))
        self.block_table = np.zeros((num_slots, self.max_pages_per_request), dtype=np.int64)

    # --- request lifecycle ----------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, shared_pages: tuple[int, ...] = ()) -> Allocation:
        """Reserve `num_tokens` positions; `shared_pages`: pinned pages that hold its first
        positions already (the prefix cache's), taken as they are, the rest fresh."""
        if request_id in self._requests:
            raise KVError(f"request {request_id!r} is already allocated")
        if num_tokens <= 0:
            raise KVError(f"request {request_id!r}: num_tokens must be positive, got {num_tokens}")
        n_pages = -(-num_tokens // self.page_size)
        shared = list(shared_pages)
        if len(shared) > n_pages or len(set(shared)) < len(shared) or any(self.page_pins[p] <= 0 for p in shared):
            raise KVError(f"request {request_id!r}: shared pages {shared} are not distinct pinned pages "
                          f"within its {n_pages}")
        n_swa = swa_pages_per_request(self.span, self.page_size, num_tokens) if self.swa else 0
        needs = [(n_pages - len(shared), self.pages), (1, self.slots)]
        if self.swa:
            needs.append((n_swa, self.swa.pool))
        if n_pages > self.max_pages_per_request:
            raise KVError(f"request {request_id!r} of {num_tokens} tokens needs {n_pages} pages; a request "
                          f"may hold at most {self.max_pages_per_request} (max_position_embeddings "
                          f"{self.cfg.max_position_embeddings}, page size {self.page_size})")
        short = [f"{need} {pool.what} ({pool.num_free} free)"
                 for need, pool in needs if need > pool.num_free]
        if short:
            raise OutOfCapacity(f"cannot allocate request {request_id!r} of {num_tokens} tokens: "
                                f"needs {', '.join(short)}")
        pages = shared + self.pages.take(n_pages - len(shared))
        self.page_refs[pages] += 1
        req = RequestKV(num_tokens=num_tokens, pages=pages, slot=self.slots.take(1)[0],
                       page_table=torch.tensor(pages, dtype=torch.long, device=self.device), shared=len(shared))
        self.block_table[req.slot, :n_pages] = pages
        if self.swa:
            self.swa.reserve(request_id, n_swa)
        self._requests[request_id] = req
        return self.allocation(request_id)

    def extend(self, request_id: str, new_len: int) -> None:
        req = self._req(request_id)
        if not req.length <= new_len <= req.num_tokens:
            raise KVError(f"request {request_id!r}: cannot extend from {req.length} to {new_len} "
                          f"(reserved {req.num_tokens} positions)")
        req.length, req.floor = new_len, max(req.floor, new_len - self.span)
        self._sync_swa(request_id, req)

    def rollback(self, request_id: str, new_len: int) -> None:
        req = self._req(request_id)
        if not 0 <= new_len <= req.length:
            raise KVError(f"request {request_id!r}: cannot roll back from {req.length} "
                          f"to {new_len}")
        needed = max(0, new_len - self.cfg.sliding_window + 1)  # window of the query at new_len
        if self._has_sliding() and new_len > 0 and needed < req.floor:
            raise KVError(f"request {request_id!r}: rollback to {new_len} needs sliding positions "
                          f"{needed}..{new_len - 1}, but positions below {req.floor} are no "
                          f"longer stored (sliding storage keeps {self.span} positions)")
        req.length, req.floor = new_len, min(req.floor, new_len)
        self._sync_swa(request_id, req)

    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KVError(f"request {request_id!r} is not allocated")
        if self.swa:
            self.swa.release(request_id)
        self._unref(req.pages)
        self.slots.give([req.slot])

    def pin(self, pages: list[int]) -> None:
        """Hold taken `pages` beyond the requests that hold them (the prefix cache)."""
        if any(self.page_refs[p] <= 0 for p in pages) or len(set(pages)) < len(pages):
            raise KVError(f"pages {pages}: only distinct pages in use can be pinned")
        self.page_refs[pages] += 1
        self.page_pins[pages] += 1

    def unpin(self, pages: list[int]) -> None:
        """Let go of pinned `pages`; those no request holds go back to the pool."""
        if any(self.page_pins[p] <= 0 for p in pages) or len(set(pages)) < len(pages):
            raise KVError(f"pages {pages}: not pinned (or named twice)")
        self.page_pins[pages] -= 1
        self._unref(pages)

    def _unref(self, pages: list[int]) -> None:
        arr = np.asarray(pages, dtype=np.int64)
        self.page_refs[arr] -= 1
        self.pages.give(arr[self.page_refs[arr] == 0].tolist())

    # --- addressing -----------------------------------------------------------------------
    def rows(self, request_id: str, layer_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Physical rows (into kv_buffer(layer_id)) of `positions` [n] long -> [n] long."""
        req = self._req(request_id)
        key, _ = self._layer_of(layer_id)
        positions = positions.to(self.device)
        low = 0 if key.kind == FULL else req.floor
        if positions.numel() and (int(positions.min()) < low or int(positions.max()) >= req.length):
            raise KVError(f"request {request_id!r}, layer {layer_id} ({key.name}): positions "
                          f"must lie in {low}..{req.length - 1}")
        ps = self.page_size
        stride = self.item_stride(key)
        if key.kind == SWA_RING:
            return req.slot * stride + positions % self.span
        page = req.page_table[positions // ps]  # [n] FULL page ids
        if key.kind == SWA:
            page = self.swa.full_to_swa[page.cpu()].to(self.device)  # [n] SWA page ids
        return page * stride + positions % ps

    def first_resident(self, request_id: str, layer_id: int) -> int:
        """Lowest position of this layer that `rows` answers for."""
        key, _ = self._layer_of(layer_id)
        return 0 if key.kind == FULL else self._req(request_id).floor

    def kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer, each [rows, kv_heads, head_dim] (rows: see kv_rows)."""
        rows = self.kv_rows(layer_id)
        return rows[:, 0], rows[:, 1]

    def kv_rows(self, layer_id: int) -> torch.Tensor:
        """One layer's K and V together, [rows, 2, kv_heads, head_dim]: a view of the component
        from this layer's first row on; row i * item_stride + o is its offset o of item i (the
        rows between belong to the other layers and are never addressed through this view)."""
        key, index = self._layer_of(layer_id)
        flat = self.data[key].view(-1, 2, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return flat[index * self.data[key].shape[2]:]  # [items*layers*item_rows - skipped, 2, Hkv, D]

    def item_stride(self, key: PoolKey) -> int:
        """Rows from one item to the next in a layer's `kv_rows` view: layers * item_rows."""
        _, layers, item_rows = self.data[key].shape[:3]
        return layers * item_rows

    def aux_row(self, request_id: str) -> torch.Tensor:
        """The request's aux row, uint8 [item_bytes] (see aux.pack_aux / unpack_aux). Host memory
        on every device: the event loop reads its tag and first token without a device sync, and
        never through a pointer into device memory."""
        return self.aux[0, self._req(request_id).slot]

    def allocation(self, request_id: str) -> Allocation:
        req = self._req(request_id)
        swa = self.swa.swa_page_ids(request_id, req.pages) if self.swa else ()
        return Allocation(request_id=request_id, num_tokens=req.num_tokens, length=req.length,
                          reused=req.shared * self.page_size,
                          floor=req.floor, slot=req.slot, page_ids=tuple(req.pages),
                          swa_page_ids=swa)

    def length(self, request_id: str) -> int:
        return self._req(request_id).length

    def request(self, request_id: str) -> RequestKV:
        """The request's bookkeeping (slot, length, floor), read-only for callers."""
        return self._req(request_id)

    # --- capacity, integrity, manifest --------------------------------------------------------
    def free_capacity(self) -> FreeCapacity:
        """Free pages include those only pins hold: the prefix cache gives them up on demand."""
        return FreeCapacity(pages=self.pages.num_free + self.reclaimable_pages(), slots=self.slots.num_free,
                            swa_pages=self.swa.pool.num_free if self.swa else 0)

    def reclaimable_pages(self) -> int:
        """Pages held by pins alone (no request uses them)."""
        return int(np.count_nonzero((self.page_pins > 0) & (self.page_refs == self.page_pins)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.data.values(), self.aux))

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        self.slots.check_integrity()
        holders = np.bincount(np.asarray([p for r in self._requests.values() for p in r.pages], dtype=np.int64),
                              minlength=self.pages.size) + self.page_pins  # [P]
        slots = [r.slot for r in self._requests.values()]
        require(all(len(set(r.pages)) == len(r.pages) for r in self._requests.values()),
                "full pages: a request holds a page twice")
        require(np.array_equal(holders, self.page_refs) and set(np.flatnonzero(holders).tolist()) == self.pages.used,
                "full pages: holder counts out of sync, or taken but held by no request or pin")
        require(bool((self.page_pins >= 0).all()), "full pages: negative pin counts")
        require(len(slots) == len(set(slots)) and set(slots) == self.slots.used,
                "slots: owned twice, or taken but owned by no request")
        for rid, r in self._requests.items():
            require(0 <= r.floor <= r.length <= r.num_tokens, f"request {rid}: bad lengths")
            require(len(r.pages) * self.page_size >= r.num_tokens, f"request {rid}: pages short")
        if self.swa:
            self.swa.check_integrity({rid: r.pages for rid, r in self._requests.items()})
            for rid, r in self._requests.items():
                mapped = [s >= 0 for s in self.swa.swa_page_ids(rid, r.pages)]
                require(mapped == self._swa_window(r), f"request {rid}: SWA pages != window")

    def manifest(self, worker_id: str, fingerprint: str, role: str = "decode") -> Manifest:
        mem_kind = "VRAM" if self.device.type == "cuda" else "DRAM"
        comps = [self._component(key, mem_kind) for key in self.keys]
        layout = self.aux_layout
        aux_geometry = Geometry(dtype="float32", item_rows=layout.hidden_rows,
                                num_items=self.aux.shape[1], row_bytes=layout.row_bytes,
                                header_bytes=HEADER_BYTES, item_bytes=layout.item_bytes,
                                window=None, kv_heads=0, head_dim=0, order=ITEM_MAJOR,
                                layers_per_item=0)
        comps.append(Component(ComponentId(AUX_KEY.owner, AUX_KEY.kind, ()), aux_geometry,
                               (self._region(self.aux[0], layout.block_bytes),), "DRAM", 0))
        return Manifest(worker_id=worker_id, role=role, fingerprint=fingerprint, mode=self.mode,
                        components=tuple(comps))

    # --- internals ------------------------------------------------------------------------------
    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A KV pool tensor on the store's device."""
        if self.device.type == "cpu":
            return self._host_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _host_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory: on huge pages for a CPU store (NIXL copies them between processes at about
        twice the speed of 4 KiB pages, host_memory), pinned for a CUDA store (the engine's
        copies to and from the device then need no staging)."""
        if self.device.type == "cpu":
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=True)

    def _component(self, key: PoolKey, mem_kind: str) -> Component:
        data = self.data[key]  # [items, layers, item_rows, 2, kv_heads, head_dim]
        items, layers, item_rows = data.shape[:3]
        row = kv_row_bytes(self.cfg, self.dtype)
        geometry = Geometry(dtype=dtype_name(self.dtype), item_rows=item_rows, num_items=items,
                            row_bytes=row, header_bytes=0, item_bytes=layers * item_rows * row,
                            window=None if key.kind == FULL else self.cfg.sliding_window,
                            kv_heads=self.cfg.num_key_value_heads, head_dim=self.cfg.head_dim,
                            index_map=self.swa.index_map_id if key.kind == SWA else None,
                            order=ITEM_MAJOR, layers_per_item=layers)
        return Component(ComponentId(key.owner, key.kind, self.routing.layers_of(key)), geometry,
                         (self._region(data, geometry.item_bytes),), mem_kind, self.device.index or 0)

    @staticmethod
    def _region(data: torch.Tensor, item_bytes: int) -> Region:
        return Region(addr=data.data_ptr(), nbytes=data.numel() * data.element_size(),
                      item_bytes=item_bytes)

    def _swa_window(self, req: RequestKV) -> list[bool]:
        """Which page indices of the request are resident in SWA pages: floor..length-1."""
        lo, hi = req.floor // self.page_size, -(-req.length // self.page_size)
        return [lo <= i < hi for i in range(len(req.pages))]

    def _sync_swa(self, request_id: str, req: RequestKV) -> None:
        if self.swa:
            window = self._swa_window(req)
            self.swa.remap(request_id, [p for p, keep in zip(req.pages, window) if keep])

    def _has_sliding(self) -> bool:
        return any(key.kind != FULL for key in self.keys)

    def _req(self, request_id: str) -> RequestKV:
        req = self._requests.get(request_id)
        if req is None:
            raise KVError(f"request {request_id!r} is not allocated")
        return req

    def _layer_of(self, layer_id: int) -> tuple[PoolKey, int]:
        if layer_id not in self._layer:
            where = (f"it routes to {self.routing.by_layer[layer_id].name}, and the draft is "
                     f"disabled" if 0 <= layer_id < len(self.routing.by_layer) else "no such layer")
            raise KVError(f"layer {layer_id} is not stored here: {where}")
        return self._layer[layer_id]
