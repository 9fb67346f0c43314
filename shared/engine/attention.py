"""Attention over a KVStore for one batched forward (prefill chunks, decode, verify, draft).

The step's metadata is built once per forward and per pool, never per layer (nano-vllm's
`block_tables` / `context_lens` / `slot_mapping`): the host packs a few integers per sequence
(start, length, slot, lowest readable position) into one tensor, copied to the store's device
in one transfer; every index the layers need is then derived there from the store's block table
(FULL, paged SWA) or slot (ring) and shared by all layers of the pool. Nothing inside the
forward syncs with the host or has a data-dependent shape.

Every forward follows one order, so sliding storage (rings, SWA pages) is never read after it
was overwritten:
    1. `StoreAttention(store, chunks, layers)` computes, per pool, which cached rows each chunk
       may read (positions below the chunk's start) while every request still has its old length;
    2. it extends each request to the chunk's end, then computes where the new K/V go;
    3. each layer call reads the cached rows, attends with the chunk's own K/V, then writes the
       new K/V (sliding layers only the positions storage keeps).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from baton.kernels.attention import chunk_attention, chunk_mask
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
    """What every layer of one pool reads and writes in this forward."""
    window: int | None
    old_rows: torch.Tensor  # [B, M] cache rows of the earlier positions each chunk may see
    old_pos: torch.Tensor  # [B, M] their positions, -1 where not visible
    q_pos: torch.Tensor  # [B, Q] the chunk's positions, -1 for padding
    write_rows: torch.Tensor | None = None  # [W] rows the new K/V go to
    write_tokens: torch.Tensor | None = None  # [W] which flat tokens those are; None: all of them

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, M+Q] for the torch reference (the Triton kernel masks by position itself)."""
        return chunk_mask(self.q_pos, self.old_pos, self.window)[:, None]


class StoreAttention:
    def __init__(self, store: KVStore, chunks: list[Chunk], layer_ids: list[int]) -> None:
        self.store, self.chunks = store, chunks
        reqs = [store.request(c.request_id) for c in chunks]
        for c, r in zip(chunks, reqs):
            if not 0 <= c.start <= r.length:
                raise KVError(f"request {c.request_id!r}: a chunk at {c.start} leaves a gap after "
                              f"its {r.length} stored positions")
        B, Q = len(chunks), max(c.n for c in chunks)
        self.max_position = max(c.start + c.n for c in chunks) - 1
        self._pools = {store.routing.key_of(layer) for layer in layer_ids}
        self._pool_of = {layer: store.routing.key_of(layer) for layer in layer_ids}
        self._uniform = all(c.n == Q for c in chunks)  # then padded [B, Q] is a view of flat [T]
        lows = {key: self._read_floors(key, reqs) for key in sorted(self._pools)}
        host = [c.start for c in chunks] + [c.n for c in chunks] + [r.slot for r in reqs]
        for key in sorted(self._pools):
            host += lows[key]
        if not self._uniform:
            host += self._padding_index(Q)
        packed = torch.tensor(host, dtype=torch.long).to(store.device, non_blocking=True)
        self._starts, self._ns, self._slots = packed[:B], packed[B:2 * B], packed[2 * B:3 * B]
        offset, low_t = 3 * B, {}
        for key in sorted(self._pools):
            low_t[key], offset = packed[offset:offset + B], offset + B
        if not self._uniform:
            T = sum(c.n for c in chunks)
            self._pad, self._unpad = packed[offset:offset + B * Q], packed[offset + B * Q:offset + B * Q + T]
        cols = torch.arange(Q, device=store.device)
        self.q_pos = torch.where(cols < self._ns[:, None], self._starts[:, None] + cols, -1)  # [B, Q]
        self.positions = self.q_pos.view(-1) if self._uniform else self.q_pos.view(-1)[self._unpad]  # [T]
        self._meta = {key: self._read_meta(key, low_t[key], max(c.start for c in chunks)) for key in self._pools}
        for c, r in zip(chunks, reqs):
            if r.length < c.start + c.n:
                store.extend(c.request_id, c.start + c.n)
        for key in self._pools:
            self._meta[key].write_rows, self._meta[key].write_tokens = self._writes(key, reqs)

    # --- metadata (once per forward and pool) -----------------------------------------------
    def _window(self, key: PoolKey) -> int | None:
        return self.store.cfg.window_of(self.store.routing.layers_of(key)[0])

    def _read_floors(self, key: PoolKey, reqs) -> list[int]:
        """Lowest cached position each chunk reads in this pool (host ints)."""
        window = self._window(key)
        lows = []
        for c, r in zip(self.chunks, reqs):
            lo = max(c.floor, 0 if window is None else c.start - window + 1, 0)
            if key.kind != FULL and lo < min(r.floor, c.start):
                raise KVError(f"request {c.request_id!r} ({key.name}): positions {lo}..{c.start - 1} are "
                              f"needed but those below {r.floor} are no longer stored")
            lows.append(lo)
        return lows

    def _padding_index(self, Q: int) -> list[int]:
        """pad [B*Q] (flat token of each padded slot, 0 for padding) and unpad [T] (padded slot of
        each flat token)."""
        pad, unpad, offset = [], [], 0
        for b, c in enumerate(self.chunks):
            pad += list(range(offset, offset + c.n)) + [0] * (Q - c.n)
            unpad += range(b * Q, b * Q + c.n)
            offset += c.n
        return pad + unpad

    def _read_meta(self, key: PoolKey, low: torch.Tensor, max_start: int) -> _PoolMeta:
        store, ps, B = self.store, self.store.page_size, len(self.chunks)
        dev, starts = store.device, self._starts[:, None]  # [B, 1]
        if key.kind == SWA_RING:
            R = store.span
            ring = torch.arange(R, device=dev)
            rows = self._slots[:, None] * R + ring  # [B, R]
            pos = (starts - 1) - torch.remainder(starts - 1 - ring, R)  # latest position < start in each row
        else:
            first = torch.div(low, ps, rounding_mode="floor") if key.kind == SWA else torch.zeros_like(low)
            pages = -(-max_start // ps)  # FULL: every page below the latest start
            if key.kind == SWA:  # the window's positions lo..start-1 (< W of them) span this many
                pages = min(pages, -(-self._window(key) // ps) + 1)
            cols = first[:, None] + torch.arange(pages, device=dev)  # [B, P] page index in the request
            cols = cols.clamp_max(store.max_pages_per_request - 1)
            page = store.block_table[self._slots[:, None], cols]  # [B, P] FULL page ids
            if key.kind == SWA:
                page = store.swa.full_to_swa[page].clamp_min(0)  # [B, P] SWA page ids
            offs = torch.arange(ps, device=dev)
            rows = (page[:, :, None] * ps + offs).reshape(B, -1)  # [B, P*ps]
            pos = (cols[:, :, None] * ps + offs).reshape(B, -1)
        visible = (pos >= low[:, None]) & (pos < starts)  # [B, M]
        return _PoolMeta(self._window(key), rows, torch.where(visible, pos, -1), self.q_pos)

    def _writes(self, key: PoolKey, reqs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of the new tokens' K/V after the extend; sliding pools keep only what storage holds
        (a prefill chunk longer than the ring writes its last rows only)."""
        store, ps = self.store, self.store.page_size
        keep = None
        if key.kind != FULL and any(r.floor > c.start for c, r in zip(self.chunks, reqs)):
            keep, offset = [], 0
            for c, r in zip(self.chunks, reqs):
                keep += range(offset + max(r.floor, c.start) - c.start, offset + c.n)
                offset += c.n
            keep = torch.tensor(keep, dtype=torch.long).to(store.device, non_blocking=True)
        seq_of = self._seq_of_token()  # [T]
        pos = self.positions if keep is None else self.positions[keep]
        slots = self._slots[seq_of if keep is None else seq_of[keep]]
        if key.kind == SWA_RING:
            return slots * store.span + pos % store.span, keep
        page = store.block_table[slots, torch.div(pos, ps, rounding_mode="floor")]
        if key.kind == SWA:
            page = store.swa.full_to_swa[page]
        return page * ps + pos % ps, keep

    def _seq_of_token(self) -> torch.Tensor:
        B, Q = self.q_pos.shape
        seq = torch.arange(B, device=self.q_pos.device)[:, None].expand(B, Q).reshape(-1)
        return seq if self._uniform else seq[self._unpad]

    # --- per layer --------------------------------------------------------------------------
    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, D] -> [B, Q, heads, D]"""
        B, Q = self.q_pos.shape
        return (x if self._uniform else x[self._pad]).view(B, Q, *x.shape[1:])

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        meta = self._meta[self._pool_of[layer_id]]
        k_cache, v_cache = self.store.kv_buffer(layer_id)  # [R, Hkv, D] each
        qp = self._padded(q)
        mask = None if use_triton(qp) else meta.mask
        out = chunk_attention(qp, meta.q_pos, self._padded(k), self._padded(v), k_cache, v_cache,
                              meta.old_rows, meta.old_pos, meta.window, mask=mask)  # [B, Q, H, D]
        if meta.write_tokens is not None:
            k, v = k[meta.write_tokens], v[meta.write_tokens]
        k_cache.index_copy_(0, meta.write_rows, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.write_rows, v.to(v_cache.dtype))
        out = out.reshape(-1, *out.shape[2:])  # [B*Q, H, D]
        return out if self._uniform else out[self._unpad]
