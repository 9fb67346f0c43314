"""Attention over a KVStore for one batched forward (prefill chunks, decode, verify, draft).

The step's metadata is built once per forward and per pool, never per layer (nano-vllm's
`block_tables` / `context_lens` / `slot_mapping`): on the host, with numpy over flat integer
arrays — each sequence's start, length, slot and lowest readable position, the store's block
table (FULL, paged SWA) or ring slot — then handed to the engine's device, where every layer of
the pool shares it. Nothing inside the forward syncs with the host or has a data-dependent shape.

Every forward follows one order, so sliding storage (rings, SWA pages) is never read after it
was overwritten:
    1. `StoreAttention(store, chunks, layers)` computes, per pool, which cached rows each chunk
       may read (positions below the chunk's start) while every request still has its old length;
    2. it extends each request to the chunk's end, then computes where the new K/V go;
    3. each layer call reads the cached rows, attends with the chunk's own K/V, then writes the
       new K/V (sliding layers only the positions storage keeps).
Where no new row lands on a row the forward reads (always for FULL; for sliding storage when the
chunks are short enough: decode, verify, draft), step 3 writes first and attends over the cached
rows and the chunk's own where they lie (`_PoolMeta.read_rows`, `cpu_fused.paged_attention`: on
the CPU no gathered copy, elsewhere one gather), with no concatenation per layer.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from baton.kernels import cpu_fused
from baton.kernels.attention import attend, chunk_attention, visible
from baton.kernels.dispatch import use_triton
from baton.shared.kv.allocator import KVError
from baton.shared.kv.routing import FULL, SWA, SWA_RING, PoolKey
from baton.shared.kv.store import KVStore


@dataclass(frozen=True)
class Chunk:
    """New tokens of one request in a forward: positions start .. start+n-1."""
    request_id: str
    start: int
    n: int
    floor: int = 0  # lowest cached position this forward may read (draft layers in cold/rebuild)


@dataclass
class _PoolMeta:
    """What every layer of one pool reads and writes in this forward (on the engine's device)."""
    window: int | None
    old_rows: torch.Tensor  # [B, M] cache rows of the earlier positions each chunk may see
    old_pos: torch.Tensor  # [B, M] their positions, -1 where not visible
    key_pos: np.ndarray  # [B, M+Q] on the host: old_pos, then the chunk's own positions (q_pos)
    write_rows: torch.Tensor | None = None  # [W] rows the new K/V go to
    write_tokens: torch.Tensor | None = None  # [W] which flat tokens those are; None: all of them
    read_rows: torch.Tensor | None = None  # [B, M+Q] old_rows, then each chunk's own rows (padded):
    # set where writing first clobbers no row read (then one attention call reads both), else None
    read_pos: torch.Tensor | None = None  # [B, M+Q] key_pos on the device, set with read_rows
    mask: torch.Tensor | None = None  # [B, 1, Q, M+Q] additive, built on first use (`StoreAttention._mask`)


class StoreAttention:
    def __init__(self, store: KVStore, chunks: list[Chunk], layer_ids: list[int], *,
                 extend_first: bool = False) -> None:
        """`extend_first`: extend every request to its chunks' end before planning the reads (`chain`)."""
        self.store, self.chunks = store, chunks
        reqs = [store.request(c.request_id) for c in chunks]
        if extend_first:
            for c, r in zip(chunks, reqs):
                if r.length < c.start + c.n:
                    store.extend(c.request_id, c.start + c.n)
        for c, r in zip(chunks, reqs):
            if not 0 <= c.start <= r.length:
                raise KVError(f"request {c.request_id!r}: a chunk at {c.start} leaves a gap after "
                              f"its {r.length} stored positions")
        self._pool_of = {layer: store.routing.key_of(layer) for layer in layer_ids}
        self._starts = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
        self._ns = np.array([c.n for c in chunks], dtype=np.int64)
        self._slots = np.array([r.slot for r in reqs], dtype=np.int64)
        B, Q = len(chunks), int(self._ns.max())
        self.max_position = int((self._starts + self._ns).max()) - 1
        self._uniform = bool((self._ns == Q).all())  # then padded [B, Q] is a view of flat [T]
        cols = np.arange(Q)
        self._q_pos = np.where(cols < self._ns[:, None], self._starts[:, None] + cols, -1)  # [B, Q]
        flat = self._q_pos.reshape(-1) >= 0
        self._positions = self._q_pos.reshape(-1)[flat]  # [T] in flat token order
        self.q_pos, self.positions = self._device(self._q_pos), self._device(self._positions)
        if not self._uniform:
            T = len(self._positions)
            pad = np.zeros(B * Q, dtype=np.int64)
            pad[flat] = np.arange(T)
            self._pad, self._unpad = self._device(pad), self._device(np.flatnonzero(flat))
        pools = sorted(set(self._pool_of.values()))
        self._read_lows = {key: self._read_floors(key, reqs) for key in pools}  # [B] per pool
        self._old_rows: dict[PoolKey, np.ndarray] = {}  # [B, M] per pool, on the host
        self._meta = {key: self._read_meta(key, self._read_lows[key]) for key in pools}
        for c, r in zip(chunks, reqs):
            if r.length < c.start + c.n:
                store.extend(c.request_id, c.start + c.n)
        for key in pools:
            self._plan_writes(key, reqs)

    @classmethod
    def chain(cls, store: KVStore, chunks: list[Chunk], layer_ids: list[int],
              steps: int) -> list["StoreAttention"]:
        """A draft chain's metadata in one pass: `steps` forwards of one new token per chunk, the
        j-th at c.start + j (chunks of n = 1), one StoreAttention each. The chain's last position
        is reserved (extended to) before any read is planned; that is safe because the chain spans
        fewer positions than sliding storage keeps beyond the window (W + K), so no position a
        step reads falls below a request's floor (`_read_floors` refuses one that would)."""
        B = len(chunks)
        if steps == 0 or B == 0:
            return []
        flat = [Chunk(c.request_id, c.start + j, 1, c.floor) for j in range(steps) for c in chunks]
        whole = cls(store, flat, layer_ids, extend_first=True)
        return [whole._rows(j * B, (j + 1) * B) for j in range(steps)]

    def _rows(self, lo: int, hi: int) -> "StoreAttention":
        """The forward of chunks lo..hi-1 alone (one token each): a view of this one's metadata."""
        part = copy.copy(self)
        part.chunks = self.chunks[lo:hi]
        part._q_pos, part.q_pos = self._q_pos[lo:hi], self.q_pos[lo:hi]
        part._positions, part.positions = self._positions[lo:hi], self.positions[lo:hi]
        part.max_position = int(part._positions.max())
        part._meta = {}
        for key, meta in self._meta.items():
            if meta.write_tokens is not None:
                raise KVError(f"{key.name}: a chain step would write below a request's floor")
            part._meta[key] = _PoolMeta(meta.window, meta.old_rows[lo:hi], meta.old_pos[lo:hi], meta.key_pos[lo:hi],
                                        meta.write_rows[lo:hi], None,
                                        None if meta.read_rows is None else meta.read_rows[lo:hi],
                                        None if meta.read_pos is None else meta.read_pos[lo:hi])
        return part

    def _device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.store.device.type == "cpu" else tensor.to(self.store.device, non_blocking=True)

    def _mask(self, meta: _PoolMeta) -> torch.Tensor:
        """The pool's mask for attention over gathered rows, built once per forward on first use:
        SDPA's additive one (0 / -inf, in the cache's dtype), which SDPA would otherwise make from a
        boolean mask itself, in two more ops per layer call. `paged_attention` takes positions."""
        if meta.mask is None:
            allowed = visible(self._q_pos, meta.key_pos, meta.window)[:, None]  # [B, 1, Q, M+Q]
            mask = torch.from_numpy(np.where(allowed, np.float32(0), np.float32(-np.inf)))
            meta.mask = mask.to(self.store.device, self.store.dtype, non_blocking=True)
        return meta.mask

    # --- metadata (once per forward and pool, on the host) ------------------------------------
    def _read_floors(self, key: PoolKey, reqs) -> np.ndarray:
        """Lowest cached position each chunk reads in this pool, [B]."""
        window = self.store.windows[key]
        lows = []
        for c, r in zip(self.chunks, reqs):
            lo = max(c.floor, 0 if window is None else c.start - window + 1, 0)
            if key.kind != FULL and lo < min(r.floor, c.start):
                raise KVError(f"request {c.request_id!r} ({key.name}): positions {lo}..{c.start - 1} are "
                              f"needed but those below {r.floor} are no longer stored")
            lows.append(lo)
        return np.array(lows, dtype=np.int64)

    def _read_meta(self, key: PoolKey, low: np.ndarray) -> _PoolMeta:
        store, ps, B = self.store, self.store.page_size, len(self.chunks)
        stride = store.item_stride(key)  # rows from one item to the next (item-major storage)
        starts = self._starts[:, None]  # [B, 1]
        if key.kind == SWA_RING:
            ring = np.arange(store.span)
            rows = self._slots[:, None] * stride + ring  # [B, R]
            pos = (starts - 1) - (starts - 1 - ring) % store.span  # latest position < start in each row
        else:
            pages = -(-int(self._starts.max()) // ps)  # FULL: every page below the latest start
            first = np.zeros(B, dtype=np.int64)
            if key.kind == SWA:  # the window's positions lo..start-1 (< W of them) span this many
                pages, first = min(pages, -(-self.store.windows[key] // ps) + 1), low // ps
            cols = np.minimum(first[:, None] + np.arange(pages), store.max_pages_per_request - 1)  # [B, P]
            page = store.block_table[self._slots[:, None], cols]  # [B, P] FULL page ids
            if key.kind == SWA:
                page = np.maximum(store.swa.table[page], 0)  # [B, P] SWA page ids
            offs = np.arange(ps)
            rows = (page[:, :, None] * stride + offs).reshape(B, -1)  # [B, P*ps]
            pos = (cols[:, :, None] * ps + offs).reshape(B, -1)
        old_pos = np.where((pos >= low[:, None]) & (pos < starts), pos, -1)  # [B, M]
        window, self._old_rows[key] = self.store.windows[key], rows
        return _PoolMeta(window, self._device(rows), self._device(old_pos), np.concatenate((old_pos, self._q_pos), 1))

    def _plan_writes(self, key: PoolKey, reqs) -> None:
        """Where this pool's new K/V go; and, where writing them first clobbers no row the
        forward reads, the rows each layer attends over, cached and own together."""
        meta = self._meta[key]
        rows, keep = self._writes(key, reqs)
        meta.write_rows, meta.write_tokens = self._device(rows), None if keep is None else self._device(keep)
        if keep is None and self._reads_survive_writes(key, reqs):
            B, Q = self._q_pos.shape
            own = np.zeros(B * Q, dtype=np.int64)  # padding reads row 0: masked for every real query
            own[self._q_pos.reshape(-1) >= 0] = rows
            meta.read_rows = self._device(np.concatenate((self._old_rows[key], own.reshape(B, Q)), 1))
            meta.read_pos = self._device(meta.key_pos)

    def _reads_survive_writes(self, key: PoolKey, reqs) -> bool:
        """No new row lands on a row read: FULL rows hold one position each; sliding storage keeps
        positions >= floor (after the extend) in distinct rows, so it holds when no chunk reads
        below its request's floor."""
        return key.kind == FULL or bool((self._read_lows[key] >= np.array([r.floor for r in reqs])).all())

    def _writes(self, key: PoolKey, reqs) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of the new tokens' K/V after the extend, [W]; sliding pools keep only what storage
        holds (a prefill chunk longer than the ring writes its last rows only: `keep`, the flat
        tokens written, else None)."""
        store, ps, stride = self.store, self.store.page_size, self.store.item_stride(key)
        pos, slots, keep = self._positions, np.repeat(self._slots, self._ns), None
        if key.kind != FULL:
            floors = np.repeat(np.array([r.floor for r in reqs], dtype=np.int64), self._ns)
            if (pos < floors).any():
                keep = np.flatnonzero(pos >= floors)
                pos, slots = pos[keep], slots[keep]
        if key.kind == SWA_RING:
            return slots * stride + pos % store.span, keep
        page = store.block_table[slots, pos // ps]
        return (store.swa.table[page] if key.kind == SWA else page) * stride + pos % ps, keep

    # --- per layer --------------------------------------------------------------------------
    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, Q, ...]"""
        B, Q = self._q_pos.shape
        return (x if self._uniform else x.index_select(0, self._pad)).view(B, Q, *x.shape[1:])

    def __call__(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; kv: [T, 2, Hkv, D] -> [T, H, D]
        meta = self._meta[self._pool_of[layer_id]]
        cache = self.store.kv_rows(layer_id)  # [rows, 2, Hkv, D], a view (item-major, see store.py)
        kv = kv.to(cache.dtype)
        qp = self._padded(q)  # [B, Q, H, D]
        if meta.read_rows is not None and not use_triton(qp):
            cache.index_copy_(0, meta.write_rows, kv)
            return self._unpadded(cpu_fused.paged_attention(qp, cache, meta.read_rows, meta.read_pos, self.q_pos,
                                                            meta.window))
        kvp = self._padded(kv)  # [B, Q, 2, Hkv, D]
        if use_triton(qp):
            out = chunk_attention(qp, self.q_pos, kvp[:, :, 0], kvp[:, :, 1], cache[:, 0], cache[:, 1],
                                  meta.old_rows, meta.old_pos, meta.window)
        else:
            B, M = meta.old_rows.shape  # index_select, not cache[old_rows]: 4-5x faster on CPU (docs/benchmarks.md)
            old = cache.index_select(0, meta.old_rows.view(-1)).view(B, M, *cache.shape[1:])  # [B, M, 2, Hkv, D]
            out = attend(qp, torch.cat((old, kvp), 1), self._mask(meta))  # [B, Q, H, D]
        cache.index_copy_(0, meta.write_rows, kv if meta.write_tokens is None else kv.index_select(0, meta.write_tokens))
        return self._unpadded(out)

    def _unpadded(self, out: torch.Tensor) -> torch.Tensor:
        """[B, Q, H, D] -> [T, H, D]"""
        out = out.reshape(-1, *out.shape[2:])  # [B*Q, H, D]
        return out if self._uniform else out.index_select(0, self._unpad)

