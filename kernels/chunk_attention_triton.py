"""Triton kernel for `chunk_attention` (kernels/attention.py holds the contract and the reference).

One program per (sequence b, KV head, block of queries). The program's tile holds BLOCK_Q
queries x GROUP query heads that share the KV head (GQA: query head h reads KV head h // GROUP),
so each gathered K/V block is loaded once per group, and decode/verify (Q = k+1 small) still
fills the 16-row minimum of `tl.dot`. Two key loops with one online softmax:
    1. cached keys: rows `old_rows[b, n]` of k_cache/v_cache (paged pages, SWA pages or ring
       rows: all just rows), positions `old_pos[b, n]`;
    2. the chunk's own keys `k_new[b, j]`, positions `q_pos[b, j]` (causal inside the chunk).
Which (query, key) pairs count comes from positions only, exactly as in the reference:
    key position >= 0, query p sees key p' iff 0 <= p - p' (< window when windowed).
A key block that no query of the tile can see is skipped (it would only add zeros).
Padded queries (q_pos < 0) write zeros (the reference writes an unspecified mix; callers drop both).

Precision: scores and the softmax run in fp32. The two dots run in DOT_DTYPE: fp16/bf16 inputs
in their own type on a GPU (fp32 accumulate), fp32 inputs in fp32 with IEEE precision (no TF32:
greedy decoding must not drift from the reference). Under TRITON_INTERPRET=1 everything is cast
to fp32 first (the interpreter mis-computes bf16 `tl.dot`, triton#11584).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _block_visible(kpos, q_lo, q_hi, window, WINDOWED: tl.constexpr):
    """kpos [BN] key positions (-1: padding) -> (valid keys [BN], whether any query of the tile
    with positions q_lo..q_hi can see any of them): blocks nobody sees are skipped."""
    k_ok = kpos >= 0
    k_lo = tl.min(tl.where(k_ok, kpos, 1 << 62))
    k_hi = tl.max(tl.where(k_ok, kpos, -1))
    visible = (k_lo <= q_hi) & (k_hi >= 0)
    if WINDOWED:
        visible = visible & (k_hi > q_lo - window)
    return k_ok, visible


@triton.jit
def _online_softmax_step(q, k_t, v, ok, m_i, l_i, acc, sm_scale_log2,
                         DOT_DTYPE: tl.constexpr):
    # q: [BM, BD]; k_t: [BD, BN]; v: [BN, BD]; ok: [BM, BN] bool; m_i, l_i: [BM]; acc: [BM, BD]
    s = tl.dot(q, k_t.to(DOT_DTYPE), input_precision="ieee") * sm_scale_log2  # [BM, BN] fp32
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp2(s - m_safe[:, None])  # [BM, BN], 0 where masked
    alpha = tl.exp2(m_i - m_safe)  # [BM], 0 while m_i is -inf
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _chunk_attention_kernel(
        Q, QPOS, KN, VN, KC, VC, OROWS, OPOS, OUT,
        sm_scale_log2, window, Qlen, M, Hkv, D,
        s_qb, s_qq, s_qh, s_pb, s_pq,
        s_knb, s_knq, s_knh, s_vnb, s_vnq, s_vnh,
        s_kcr, s_kch, s_vcr, s_vch,
        s_rb, s_rm, s_ob, s_om,
        s_outb, s_outq, s_outh,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr,
        DOT_DTYPE: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    kvh = (pid % Hkv).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    qi = tl.program_id(1) * BLOCK_Q + r // GROUP_P  # [BM] query index in the chunk
    g = r % GROUP_P
    h = kvh * GROUP + g  # [BM] query head
    row_ok = (qi < Qlen) & (g < GROUP)
    qpos = tl.load(QPOS + b * s_pb + qi * s_pq, mask=row_ok, other=-1)  # [BM]
    row_ok = row_ok & (qpos >= 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * s_qb + qi[:, None] * s_qq + h[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BM, BD]
    q_lo = tl.min(tl.where(row_ok, qpos, 1 << 62))  # lowest / highest valid query position
    q_hi = tl.max(tl.where(row_ok, qpos, -1))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1. cached keys, gathered row by row
    for start in range(0, M, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        kpos = tl.load(OPOS + b * s_ob + n * s_om, mask=n < M, other=-1)  # [BN]
        k_ok, visible = _block_visible(kpos, q_lo, q_hi, window, WINDOWED)
        if visible:
            rows = tl.load(OROWS + b * s_rb + n * s_rm, mask=k_ok, other=0).to(tl.int64)  # [BN]
            kv_ok = k_ok[:, None] & d_ok[None, :]
            k_t = tl.load(KC + rows[None, :] * s_kcr + kvh * s_kch + d[:, None],
                          mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [BD, BN]
            v = tl.load(VC + rows[:, None] * s_vcr + kvh * s_vch + d[None, :],
                        mask=kv_ok, other=0.0)  # [BN, BD]
            delta = qpos[:, None] - kpos[None, :]  # [BM, BN]
            ok = row_ok[:, None] & k_ok[None, :] & (delta >= 0)
            if WINDOWED:
                ok = ok & (delta < window)
            m_i, l_i, acc = _online_softmax_step(q, k_t, v, ok, m_i, l_i, acc, sm_scale_log2,
                                                 DOT_DTYPE)

    # 2. the chunk's own keys (causal by position)
    for start in range(0, Qlen, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        kpos = tl.load(QPOS + b * s_pb + j * s_pq, mask=j < Qlen, other=-1)  # [BN]
        k_ok, visible = _block_visible(kpos, q_lo, q_hi, window, WINDOWED)
        if visible:
            kv_ok = k_ok[:, None] & d_ok[None, :]
            k_t = tl.load(KN + b * s_knb + j[None, :] * s_knq + kvh * s_knh + d[:, None],
                          mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [BD, BN]
            v = tl.load(VN + b * s_vnb + j[:, None] * s_vnq + kvh * s_vnh + d[None, :],
                        mask=kv_ok, other=0.0)  # [BN, BD]
            delta = qpos[:, None] - kpos[None, :]
            ok = row_ok[:, None] & k_ok[None, :] & (delta >= 0)
            if WINDOWED:
                ok = ok & (delta < window)
            m_i, l_i, acc = _online_softmax_step(q, k_t, v, ok, m_i, l_i, acc, sm_scale_log2,
                                                 DOT_DTYPE)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded queries: 0
    tl.store(OUT + b * s_outb + qi[:, None] * s_outq + h[:, None] * s_outh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=(qi < Qlen)[:, None] & (g < GROUP)[:, None] & d_ok[None, :])


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_dtype(*tensors: torch.Tensor):
    """fp16/bf16 dots when every input is that type (GPU only), else fp32 (IEEE, no TF32)."""
    dtypes = {t.dtype for t in tensors}
    if _interpreting() or len(dtypes) > 1:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtypes.pop(), tl.float32)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def chunk_attention_triton(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window,
                           *, block_n: int | None = None, num_warps: int = 4):
    """Same contract as kernels.attention.chunk_attention_reference; q [B, Q, H, D] -> [B, Q, H, D].

    Tensors may be views (k_cache = data[l].view(-1, 2, Hkv, D)[:, 0] is fine): any strides, the
    last dimension is made contiguous if it is not. Valid queries must see at least themselves
    (their own key is in k_new), so no valid row is ever empty.
    """
    B, Qlen, H, D = q.shape
    Hkv = k_new.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({Hkv})")
    out = torch.empty_like(q)
    if B == 0 or Qlen == 0:
        return out
    if old_rows.shape[1] == 0:  # nothing cached: one padded entry keeps the pointers valid
        old_rows = torch.zeros((B, 1), dtype=torch.long, device=q.device)
        old_pos = torch.full((B, 1), -1, dtype=torch.long, device=q.device)
    q, k_new, v_new, k_cache, v_cache = map(_last_contiguous, (q, k_new, v_new, k_cache, v_cache))
    # index metadata may be built on the host (StoreAttention does): move it next to q
    q_pos, old_rows, old_pos = (t.to(q.device) for t in (q_pos, old_rows, old_pos))
    group = H // Hkv
    group_p = triton.next_power_of_2(group)
    block_m = max(16, min(64, triton.next_power_of_2(Qlen * group_p)), group_p)
    block_q = block_m // group_p
    block_d = max(16, triton.next_power_of_2(D))
    block_n = block_n or (64 if _interpreting() else 32)
    dot_dtype = _dot_dtype(q, k_new, k_cache)
    grid = (B * Hkv, triton.cdiv(Qlen, block_q))
    _chunk_attention_kernel[grid](
        q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, out,
        _LOG2E / math.sqrt(D), int(window) if window is not None else 0, Qlen, old_rows.shape[1], Hkv, D,
        q.stride(0), q.stride(1), q.stride(2), q_pos.stride(0), q_pos.stride(1),
        k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        old_rows.stride(0), old_rows.stride(1), old_pos.stride(0), old_pos.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        WINDOWED=window is not None, DOT_DTYPE=dot_dtype,
        num_warps=num_warps)
    return out
