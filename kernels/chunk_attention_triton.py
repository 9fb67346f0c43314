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

Split-K (flash-decoding) for few programs over many keys: one long request gives only B * Hkv
programs, each walking all M cached keys alone while most of the GPU idles (1 x 8192 keys took
0.59 ms on an H200 against SDPA's 0.09). Then the cached keys are cut into S contiguous ranges
of whole key blocks, one program per (sequence, KV head, query block, range); the last range also
takes the chunk's own keys. Each writes its unnormalised partial (running max m, sum l, acc) to
fp32 scratch, and a second kernel merges the S partials of each row with the log-sum-exp rule:
    m = max_s m_s,  out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
A range nobody sees (outside the window, or all padding) leaves m_s = -inf, l_s = 0 and weighs 0.
The rule (`auto_num_splits`): split only while the plain grid has fewer than SPLIT_TARGET_PROGRAMS
programs (about one wave on an H100/H200), into S = min(ceil(target / programs), M / (8 BLOCK_N),
64) ranges, so each range keeps at least 8 key blocks; S < 2 means no split.

Precision: scores and the softmax run in fp32. The two dots run in DOT_DTYPE: fp16/bf16 inputs
in their own type on a GPU (fp32 accumulate), fp32 inputs in fp32 with IEEE precision (no TF32:
greedy decoding must not drift from the reference). Under TRITON_INTERPRET=1 everything is cast
to fp32 first (the interpreter mis-computes bf16 `tl.dot`, triton#11584). Split partials and
their merge are fp32 too.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
SPLIT_TARGET_PROGRAMS = 128  # about one wave of 4-warp programs on 132 SMs; not tuned yet
SPLIT_MIN_BLOCKS = 8  # key blocks per range at least: a range must outweigh its merge
SPLIT_MAX = 64  # bounds the scratch and the merge's loop
_COMBINE_ROWS = 16  # rows (query, head) per merge program


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
def _pair_mask(qpos, row_ok, kpos, k_ok, window, WINDOWED: tl.constexpr):
    """[BM, BN] True where query row i may attend key n (positions only, as the reference)."""
    delta = qpos[:, None] - kpos[None, :]  # [BM, BN]
    ok = row_ok[:, None] & k_ok[None, :] & (delta >= 0)
    if WINDOWED:
        ok = ok & (delta < window)
    return ok


@triton.jit
def _query_tile(Q, QPOS, b, kvh, q_block, Qlen, D, s_qb, s_qq, s_qh, s_pb, s_pq,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The tile's rows: BLOCK_Q queries x GROUP_P heads of KV head kvh. Returns query index qi
    [BM], head h [BM], rows that exist (in_out [BM]: written out), rows that attend (row_ok [BM]:
    also not padding), their positions [BM], q [BM, BD] and the lowest / highest valid position."""
    r = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q_block * BLOCK_Q + r // GROUP_P  # [BM] query index in the chunk
    g = r % GROUP_P
    h = kvh * GROUP + g  # [BM] query head
    in_out = (qi < Qlen) & (g < GROUP)
    qpos = tl.load(QPOS + b * s_pb + qi * s_pq, mask=in_out, other=-1)  # [BM]
    row_ok = in_out & (qpos >= 0)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * s_qb + qi[:, None] * s_qq + h[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & (d < D)[None, :], other=0.0).to(DOT_DTYPE)  # [BM, BD]
    q_lo = tl.min(tl.where(row_ok, qpos, 1 << 62))
    q_hi = tl.max(tl.where(row_ok, qpos, -1))
    return qi, h, in_out, row_ok, qpos, q, q_lo, q_hi


@triton.jit
def _program_start(Q, QPOS, Hkv, Qlen, D, s_qb, s_qq, s_qh, s_pb, s_pq, GROUP: tl.constexpr,
                   GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_DTYPE: tl.constexpr):
    """What every attention program starts from: its sequence b and KV head (program axis 0), its
    query tile (axis 1, `_query_tile`), an empty online-softmax state (m_i, l_i [BM], acc [BM, BD])."""
    b = (tl.program_id(0) // Hkv).to(tl.int64)
    kvh = (tl.program_id(0) % Hkv).to(tl.int64)
    qi, h, in_out, row_ok, qpos, q, q_lo, q_hi = _query_tile(
        Q, QPOS, b, kvh, tl.program_id(1), Qlen, D, s_qb, s_qq, s_qh, s_pb, s_pq,
        GROUP, GROUP_P, BLOCK_Q, BLOCK_D, DOT_DTYPE)
    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    return b, kvh, qi, h, in_out, row_ok, qpos, q, q_lo, q_hi, m_i, l_i, acc


@triton.jit
def _attend_block(q, qpos, row_ok, kpos, k_ok, m_i, l_i, acc, K, k_row_off, V, v_row_off, d, d_ok, window,
                  sm_scale_log2, WINDOWED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One block of keys: K/V rows at K + k_row_off[n] / V + v_row_off[n] (this KV head's base
    pointers), loaded and folded into the online softmax."""
    k_t = tl.load(K + k_row_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [BD, BN]
    v = tl.load(V + v_row_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BD]
    ok = _pair_mask(qpos, row_ok, kpos, k_ok, window, WINDOWED)
    return _online_softmax_step(q, k_t, v, ok, m_i, l_i, acc, sm_scale_log2, DOT_DTYPE)


@triton.jit
def _attend_cached(q, qpos, row_ok, q_lo, q_hi, m_i, l_i, acc, KC, VC, OROWS, OPOS, b, kvh,
                   lo, hi, D, window, sm_scale_log2, s_kcr, s_kch, s_vcr, s_vch, s_rb, s_rm,
                   s_ob, s_om, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   WINDOWED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Online softmax over cached keys lo..hi-1 of sequence b, gathered row by row."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        kpos = tl.load(OPOS + b * s_ob + n * s_om, mask=n < hi, other=-1)  # [BN]
        k_ok, visible = _block_visible(kpos, q_lo, q_hi, window, WINDOWED)
        if visible:
            rows = tl.load(OROWS + b * s_rb + n * s_rm, mask=k_ok, other=0).to(tl.int64)  # [BN]
            m_i, l_i, acc = _attend_block(q, qpos, row_ok, kpos, k_ok, m_i, l_i, acc, KC + kvh * s_kch,
                                          rows * s_kcr, VC + kvh * s_vch, rows * s_vcr, d, d_ok, window,
                                          sm_scale_log2, WINDOWED, DOT_DTYPE)
    return m_i, l_i, acc


@triton.jit
def _attend_own(q, qpos, row_ok, q_lo, q_hi, m_i, l_i, acc, QPOS, KN, VN, b, kvh, Qlen, D,
                window, sm_scale_log2, s_pb, s_pq, s_knb, s_knq, s_knh, s_vnb, s_vnq, s_vnh,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """Online softmax over the chunk's own keys (causal by position)."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    for start in range(0, Qlen, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        kpos = tl.load(QPOS + b * s_pb + j * s_pq, mask=j < Qlen, other=-1)  # [BN]
        k_ok, visible = _block_visible(kpos, q_lo, q_hi, window, WINDOWED)
        if visible:
            m_i, l_i, acc = _attend_block(q, qpos, row_ok, kpos, k_ok, m_i, l_i, acc,
                                          KN + b * s_knb + kvh * s_knh, j * s_knq,
                                          VN + b * s_vnb + kvh * s_vnh, j * s_vnq, d, d_ok, window,
                                          sm_scale_log2, WINDOWED, DOT_DTYPE)
    return m_i, l_i, acc


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
    b, kvh, qi, h, in_out, row_ok, qpos, q, q_lo, q_hi, m_i, l_i, acc = _program_start(
        Q, QPOS, Hkv, Qlen, D, s_qb, s_qq, s_qh, s_pb, s_pq, GROUP, GROUP_P, BLOCK_Q, BLOCK_D, DOT_DTYPE)
    m_i, l_i, acc = _attend_cached(q, qpos, row_ok, q_lo, q_hi, m_i, l_i, acc, KC, VC, OROWS, OPOS,
                                   b, kvh, 0, M, D, window, sm_scale_log2, s_kcr, s_kch, s_vcr,
                                   s_vch, s_rb, s_rm, s_ob, s_om, BLOCK_N, BLOCK_D, WINDOWED,
                                   DOT_DTYPE)
    m_i, l_i, acc = _attend_own(q, qpos, row_ok, q_lo, q_hi, m_i, l_i, acc, QPOS, KN, VN, b, kvh,
                                Qlen, D, window, sm_scale_log2, s_pb, s_pq, s_knb, s_knq, s_knh,
                                s_vnb, s_vnq, s_vnh, BLOCK_N, BLOCK_D, WINDOWED, DOT_DTYPE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded queries: 0
    d = tl.arange(0, BLOCK_D)
    tl.store(OUT + b * s_outb + qi[:, None] * s_outq + h[:, None] * s_outh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=in_out[:, None] & (d < D)[None, :])


@triton.jit
def _chunk_attention_split_kernel(
        Q, QPOS, KN, VN, KC, VC, OROWS, OPOS, PART_M, PART_L, PART_ACC,
        sm_scale_log2, window, Qlen, M, Hkv, D, keys_per_split,
        s_qb, s_qq, s_qh, s_pb, s_pq,
        s_knb, s_knq, s_knh, s_vnb, s_vnq, s_vnh,
        s_kcr, s_kch, s_vcr, s_vch,
        s_rb, s_rm, s_ob, s_om,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr,
        DOT_DTYPE: tl.constexpr):
    """Program (b * Hkv + kvh, query block, split): cached keys [split * keys_per_split, +
    keys_per_split) and, in the last split, the chunk's own keys -> unnormalised partials.
    PART_M, PART_L: [S, B, Q, H]; PART_ACC: [S, B, Q, H, D] (fp32, contiguous)."""
    b, kvh, qi, h, in_out, row_ok, qpos, q, q_lo, q_hi, m_i, l_i, acc = _program_start(
        Q, QPOS, Hkv, Qlen, D, s_qb, s_qq, s_qh, s_pb, s_pq, GROUP, GROUP_P, BLOCK_Q, BLOCK_D, DOT_DTYPE)
    split = tl.program_id(2).to(tl.int64)
    lo = split * keys_per_split
    m_i, l_i, acc = _attend_cached(q, qpos, row_ok, q_lo, q_hi, m_i, l_i, acc, KC, VC, OROWS, OPOS,
                                   b, kvh, lo, tl.minimum(lo + keys_per_split, M), D, window,
                                   sm_scale_log2, s_kcr, s_kch, s_vcr, s_vch, s_rb, s_rm, s_ob,
                                   s_om, BLOCK_N, BLOCK_D, WINDOWED, DOT_DTYPE)
    if split == tl.num_programs(2) - 1:
        m_i, l_i, acc = _attend_own(q, qpos, row_ok, q_lo, q_hi, m_i, l_i, acc, QPOS, KN, VN, b,
                                    kvh, Qlen, D, window, sm_scale_log2, s_pb, s_pq, s_knb, s_knq,
                                    s_knh, s_vnb, s_vnq, s_vnh, BLOCK_N, BLOCK_D, WINDOWED,
                                    DOT_DTYPE)
    B = tl.num_programs(0) // Hkv
    part = ((split * B + b) * Qlen + qi) * (Hkv * GROUP) + h  # [BM] row of [S, B, Q, H]
    tl.store(PART_M + part, m_i, mask=in_out)
    tl.store(PART_L + part, l_i, mask=in_out)
    d = tl.arange(0, BLOCK_D)
    tl.store(PART_ACC + part[:, None] * D + d[None, :], acc, mask=in_out[:, None] & (d < D)[None, :])


@triton.jit
def _combine_splits_kernel(PART_M, PART_L, PART_ACC, OUT, R, Qlen, H, D, num_splits,
                           s_outb, s_outq, s_outh,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the partials of BLOCK_R rows (row = (b * Q + qi) * H + h, R rows in all) with the
    log-sum-exp rule; rows no split saw (padded queries) write 0."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = r < R
    d = tl.arange(0, BLOCK_D)
    rd_ok = r_ok[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    pm, pl, pacc = PART_M + r, PART_L + r, PART_ACC + r[:, None] * D + d[None, :]  # split 0
    for _ in range(0, num_splits):
        m_s = tl.load(pm, mask=r_ok, other=float("-inf"))  # [BR]
        l_s = tl.load(pl, mask=r_ok, other=0.0)  # [BR]
        acc_s = tl.load(pacc, mask=rd_ok, other=0.0)  # [BR, BD]
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_s - m_safe)  # 0 for a -inf side
        l = l * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
        pm, pl, pacc = pm + R, pl + R, pacc + R * D  # next split
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    b, qi, h = r // (Qlen * H), r // H % Qlen, r % H
    tl.store(OUT + b[:, None] * s_outb + qi[:, None] * s_outq + h[:, None] * s_outh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=rd_ok)


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


def _tile(Qlen: int, group: int) -> tuple[int, int]:
    """(GROUP_P, BLOCK_Q): the group padded to a power of two, queries per tile (16..64 rows)."""
    group_p = triton.next_power_of_2(group)
    block_m = max(16, min(64, triton.next_power_of_2(Qlen * group_p)), group_p)
    return group_p, block_m // group_p


def default_block_n() -> int:
    """Keys per block: 32 compiled; 64 in the interpreter, where every block step costs Python time."""
    return 64 if _interpreting() else 32


def auto_num_splits(B: int, Qlen: int, H: int, Hkv: int, M: int, block_n: int) -> int:
    """Ranges to cut the M cached keys into: 1 (no split) once the plain grid, B * Hkv * query
    blocks programs, fills about a wave; else enough ranges to reach one, each at least
    SPLIT_MIN_BLOCKS key blocks long, at most SPLIT_MAX."""
    programs = B * Hkv * triton.cdiv(Qlen, _tile(Qlen, H // Hkv)[1])
    if programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(SPLIT_TARGET_PROGRAMS, programs),
                      M // (SPLIT_MIN_BLOCKS * block_n), SPLIT_MAX))


def split_plan(M: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(splits, keys_per_split): ranges of whole key blocks covering 0..M-1, none empty (so at
    most num_splits, fewer when M has fewer blocks); the last range may be shorter."""
    keys = triton.cdiv(triton.cdiv(M, max(1, num_splits)), block_n) * block_n
    return triton.cdiv(M, keys), keys


def chunk_attention_triton(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window,
                           *, block_n: int | None = None, num_warps: int = 4,
                           num_splits: int | None = None):
    """Same contract as kernels.attention.chunk_attention_reference; q [B, Q, H, D] -> [B, Q, H, D].

    Tensors may be views (k_cache = data[l].view(-1, 2, Hkv, D)[:, 0] is fine): any strides, the
    last dimension is made contiguous if it is not. Valid queries must see at least themselves
    (their own key is in k_new), so no valid row is ever empty. num_splits: ranges of cached keys
    run by separate programs and merged (split-K); None picks `auto_num_splits`, 1 never splits.
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
    M, group = old_rows.shape[1], H // Hkv
    group_p, block_q = _tile(Qlen, group)
    block_n = block_n or default_block_n()
    if num_splits is None:
        num_splits = auto_num_splits(B, Qlen, H, Hkv, M, block_n)
    splits, keys_per_split = split_plan(M, num_splits, block_n)
    args = (q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos)
    scalars = (_LOG2E / math.sqrt(D), int(window) if window is not None else 0, Qlen, M, Hkv, D)
    strides = (q.stride(0), q.stride(1), q.stride(2), q_pos.stride(0), q_pos.stride(1),
               k_new.stride(0), k_new.stride(1), k_new.stride(2),
               v_new.stride(0), v_new.stride(1), v_new.stride(2),
               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               old_rows.stride(0), old_rows.stride(1), old_pos.stride(0), old_pos.stride(1))
    consts = dict(GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n,
                  BLOCK_D=max(16, triton.next_power_of_2(D)), WINDOWED=window is not None,
                  DOT_DTYPE=_dot_dtype(q, k_new, k_cache), num_warps=num_warps)
    grid = (B * Hkv, triton.cdiv(Qlen, block_q))
    if splits == 1:
        _chunk_attention_kernel[grid](*args, out, *scalars, *strides,
                                      out.stride(0), out.stride(1), out.stride(2), **consts)
        return out
    part_m = torch.empty((splits, B, Qlen, H), dtype=torch.float32, device=q.device)  # [S, B, Q, H]
    part_l = torch.empty_like(part_m)  # [S, B, Q, H]
    part_acc = torch.empty((splits, B, Qlen, H, D), dtype=torch.float32, device=q.device)  # [S, B, Q, H, D]
    _chunk_attention_split_kernel[grid + (splits,)](*args, part_m, part_l, part_acc, *scalars,
                                                    keys_per_split, *strides, **consts)
    rows = B * Qlen * H
    _combine_splits_kernel[(triton.cdiv(rows, _COMBINE_ROWS),)](
        part_m, part_l, part_acc, out, rows, Qlen, H, D, splits,
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_R=_COMBINE_ROWS, BLOCK_D=consts["BLOCK_D"], num_warps=num_warps)
    return out
