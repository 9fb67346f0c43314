"""Attention of new query tokens over cached keys (paged pages, SWA pages or ring rows) plus the
new tokens' own keys: the one dispatch point the serving path calls.

Layout: a layer's cache is `k_cache, v_cache: [R, Hkv, D]` (all rows of that layer's component);
which rows a sequence reads is given per sequence, so paged, paged-SWA and ring storage all look
the same here. The queries of a batch are padded per sequence:

    q:            [B, Q, H, D]    new tokens' queries (Q = longest chunk in the batch)
    q_pos:        [B, Q]          their positions, -1 for padding
    k_new, v_new: [B, Q, Hkv, D]  the new tokens' keys/values (not yet in the cache)
    old_rows:     [B, M]          cache rows of the earlier positions this chunk may see
    old_pos:      [B, M]          their positions, -1 for padding
    window:       None (full attention) or W (query p sees keys p-W+1 .. p)
    -> out        [B, Q, H, D]

Valid queries (q_pos >= 0) see every key whose position p' has 0 <= p - p' (and p - p' < window
when windowed); GQA maps query head h to KV head h // (H // Hkv). Outputs of padded queries are
unspecified (the reference attends everything, the Triton kernel writes zeros): callers drop them.
Verify (k+1 queries), decode (1), prefill chunks, and the MTP draft layer's ring all use this one
contract: a ring is just rows.

`chunk_attention` picks the Triton kernel (kernels/chunk_attention_triton.py) on CUDA and the
torch reference below elsewhere; see kernels/dispatch.py for the rule and its override.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from baton.kernels.dispatch import use_triton


def visible(q_pos, key_pos, window):
    """[B, Q, S] True where a query sees a key: q_pos [B, Q] (-1 for padding), key_pos [B, S]
    (-1 where not readable). A query at p sees keys at 0 <= p' <= p (and p - p' < window when
    windowed); a padded query sees every key (its output is dropped, and no row is empty). Takes
    torch tensors or numpy arrays (the serving path builds its masks on the host)."""
    delta = q_pos[:, :, None] - key_pos[:, None, :]  # [B, Q, S]
    allowed = (key_pos[:, None, :] >= 0) & (delta >= 0)
    if window is not None:
        allowed &= delta < window
    return allowed | (q_pos < 0)[:, :, None]


def chunk_mask(q_pos, old_pos, window):
    """[B, Q, M+Q] `visible` over the cached keys (old_pos) then the chunk's own keys (q_pos)."""
    cat = torch.cat if isinstance(q_pos, torch.Tensor) else np.concatenate
    return visible(q_pos, cat((old_pos, q_pos), 1), window)


def attend(q, kv, mask):
    """q [B, Q, H, D], kv [B, M+Q, 2, Hkv, D] (cached keys/values, then the chunk's own), mask
    [B, 1, Q, M+Q] (True where a query sees a key, or SDPA's additive 0 / -inf) -> [B, Q, H, D].
    GQA reads each KV head once (enable_gqa), no copies."""
    keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, Hkv, M+Q, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)  # [B, Q, H, D]


def chunk_attention_reference(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window):
    kv_old = torch.stack((k_cache[old_rows], v_cache[old_rows]), 2)  # [B, M, 2, Hkv, D]
    kv = torch.cat((kv_old, torch.stack((k_new, v_new), 2)), 1)  # [B, M+Q, 2, Hkv, D]
    return attend(q, kv, chunk_mask(q_pos, old_pos, window)[:, None])


def chunk_attention(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window):
    """Dispatch point: Triton on CUDA (see kernels/README.md), the torch reference elsewhere."""
    if use_triton(q):
        from baton.kernels.chunk_attention_triton import chunk_attention_triton
        return chunk_attention_triton(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window)
    return chunk_attention_reference(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window)
