"""Attention over a KVStore for one batched forward (prefill chunks, decode, verify, draft).

Every forward follows one order, so sliding storage (rings, SWA pages) is never read after it
was overwritten:
    1. `StoreAttention(store, chunks)` computes, per pool, which cached rows each chunk may read
       (positions below the chunk's start) while every request still has its old length;
    2. it extends each request to the chunk's end;
    3. each layer call reads the cached rows, attends with the chunk's own K/V, then writes the
       new K/V (sliding layers only the positions storage keeps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.kernels.attention import chunk_attention
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
    old_rows: torch.Tensor  # [B, M] rows of cached keys (0 where padded)
    old_pos: torch.Tensor  # [B, M] their positions, -1 where padded
    write_tokens: torch.Tensor  # [W] flat token indices whose K/V are stored
    write_rows: torch.Tensor  # [W] rows they go to


class StoreAttention:
    def __init__(self, store: KVStore, chunks: list[Chunk], layer_ids: list[int]) -> None:
        self.store, self.chunks = store, chunks
        B, Q = len(chunks), max(c.n for c in chunks)
        self.q_pos = torch.full((B, Q), -1, dtype=torch.long)  # [B, Q]
        self.token_index = torch.zeros((B, Q), dtype=torch.long)  # [B, Q] -> flat token index
        offset = 0
        for b, c in enumerate(chunks):
            self.q_pos[b, :c.n] = torch.arange(c.start, c.start + c.n)
            self.token_index[b, :c.n] = torch.arange(offset, offset + c.n)
            offset += c.n
        self.valid = self.q_pos >= 0  # [B, Q]
        self.positions = self.q_pos[self.valid]  # [T] in flat token order
        self._pool_of = {layer: store.routing.key_of(layer) for layer in layer_ids}
        old = {key: self._old_keys(layer) for layer, key in self._pool_of.items()}
        for c in chunks:
            if store.length(c.request_id) < c.start + c.n:
                store.extend(c.request_id, c.start + c.n)
        self._meta = {key: _PoolMeta(*old[key], *self._writes(layer)) for layer, key in self._pool_of.items()}

    def _old_keys(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.store.cfg.window_of(layer_id)
        spans = []
        for c in self.chunks:
            lo = c.floor if window is None else max(c.floor, c.start - window + 1)
            spans.append(torch.arange(max(lo, 0), c.start))
        M = max(1, max(len(s) for s in spans))
        rows = torch.zeros((len(spans), M), dtype=torch.long)
        pos = torch.full((len(spans), M), -1, dtype=torch.long)
        for b, (c, span) in enumerate(zip(self.chunks, spans)):
            rows[b, :len(span)] = self.store.rows(c.request_id, layer_id, span)
            pos[b, :len(span)] = span
        return rows, pos

    def _writes(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, rows, offset = [], [], 0
        for c in self.chunks:
            lo = max(c.start, self.store.first_resident(c.request_id, layer_id))
            span = torch.arange(lo, c.start + c.n)
            tokens.append(offset + span - c.start)
            rows.append(self.store.rows(c.request_id, layer_id, span))
            offset += c.n
        return torch.cat(tokens), torch.cat(rows)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        meta = self._meta[self._pool_of[layer_id]]
        k_cache, v_cache = self.store.kv_buffer(layer_id)  # [R, Hkv, D] each
        idx = self.token_index
        out = chunk_attention(q[idx], self.q_pos, k[idx], v[idx], k_cache, v_cache,
                              meta.old_rows, meta.old_pos, self.store.cfg.window_of(layer_id))
        k_cache[meta.write_rows] = k[meta.write_tokens].to(k_cache.dtype)
        v_cache[meta.write_rows] = v[meta.write_tokens].to(v_cache.dtype)
        return out[self.valid]  # [T, H, D]
