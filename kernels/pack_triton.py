"""Triton kernels for kernels/pack.py: one program per (row i, block of the row, layer), copying
BLOCK elements between row rows[i] of the view and row i of the staging buffer. Tensors are
reinterpreted as same-width integers first, so the copy is bit-exact for any dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_rows_kernel(VIEW, STAGE, ROWS, E, s_vl, s_vr, s_sl, s_sr,
                      BLOCK: tl.constexpr, PACK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # staging row
    layer = tl.program_id(2).to(tl.int64)
    row = tl.load(ROWS + i).to(tl.int64)  # view row
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = e < E
    view_ptr = VIEW + layer * s_vl + row * s_vr + e
    stage_ptr = STAGE + layer * s_sl + i * s_sr + e
    if PACK:
        tl.store(stage_ptr, tl.load(view_ptr, mask=ok), mask=ok)
    else:
        tl.store(view_ptr, tl.load(stage_ptr, mask=ok), mask=ok)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError("the row dimension (last) must be contiguous")
    if t.dtype.is_floating_point or t.dtype in (torch.uint8, torch.bool):
        return t.view(_AS_INT[t.element_size()])
    return t


def _launch(view: torch.Tensor, staging: torch.Tensor, rows: torch.Tensor, pack: bool) -> None:
    n, E = rows.numel(), view.shape[-1]
    if n == 0 or E == 0:
        return
    v, s = _as_int(view), _as_int(staging)
    if v.dim() == 2:
        v, s = v.unsqueeze(0), s.unsqueeze(0)
    rows = rows.to(view.device).contiguous()
    block = min(1024, triton.next_power_of_2(E))
    grid = (n, triton.cdiv(E, block), v.shape[0])
    _copy_rows_kernel[grid](v, s, rows, E, v.stride(0), v.stride(1), s.stride(0), s.stride(1),
                            BLOCK=block, PACK=pack, num_warps=4)


def pack_rows_triton(view: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    _launch(view, out, rows, pack=True)
    return out


def unpack_rows_triton(staging: torch.Tensor, view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    _launch(view, staging, rows, pack=False)
    return view
