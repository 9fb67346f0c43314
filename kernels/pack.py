"""Pack a request's rows (ring wrap-around, scattered pages) into one contiguous staging buffer,
and unpack them back: a transfer of many small runs becomes one descriptor.

    src/dst view  [R, E] (one layer: store.kv_rows(l).view(-1, E)) or [L, R, E] (every layer
                  of an item-major component as one strided view: layer stride item_rows * E,
                  row stride E), E = elements of one row (2 * kv_heads * head_dim for KV; item
                  bytes for aux); the last dimension must be contiguous, other strides are free
    rows          [n] long, physical rows (kv.store rows())
    staging       [n, E] or [L, n, E], row i of staging is row rows[i] of the view

pack_rows(view, rows, out=None) -> staging      staging[..., i, :] = view[..., rows[i], :]
unpack_rows(staging, view, rows) -> view         view[..., rows[i], :] = staging[..., i, :]

Rows in unpack must be distinct (a row written twice has no defined winner). The copy moves raw
bits (any dtype, bf16 and uint8 included). `pack_rows`/`unpack_rows` pick Triton on CUDA and the
torch reference elsewhere (kernels/dispatch.py).
"""
from __future__ import annotations

import torch

from baton.kernels.dispatch import use_triton


def _check(view: torch.Tensor, staging: torch.Tensor, rows: torch.Tensor) -> None:
    if view.dim() not in (2, 3):
        raise ValueError(f"row view must be [R, E] or [L, R, E], got shape {tuple(view.shape)}")
    want = (*view.shape[:-2], rows.numel(), view.shape[-1])
    if tuple(staging.shape) != want:
        raise ValueError(f"staging must be {want} for {rows.numel()} rows, got {tuple(staging.shape)}")
    if staging.dtype != view.dtype or staging.device != view.device:
        raise ValueError(f"staging ({staging.dtype}, {staging.device}) must match the view "
                         f"({view.dtype}, {view.device})")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError("rows must be a 1-D int32/int64 tensor")


def _staging(view: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty((*view.shape[:-2], rows.numel(), view.shape[-1]), dtype=view.dtype,
                          device=view.device)
    _check(view, out, rows)
    return out


def pack_rows_reference(view: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = _staging(view, rows, out)
    torch.index_select(view, view.dim() - 2, rows.to(view.device, torch.long), out=out)
    return out


def unpack_rows_reference(staging: torch.Tensor, view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    _check(view, staging, rows)
    view.index_copy_(view.dim() - 2, rows.to(view.device, torch.long), staging)
    return view


def pack_rows(view: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch point: staging [.., n, E] = view[.., rows, E] (Triton on CUDA, torch elsewhere)."""
    if use_triton(view):
        from baton.kernels.pack_triton import pack_rows_triton
        return pack_rows_triton(view, rows, _staging(view, rows, out))
    return pack_rows_reference(view, rows, out)


def unpack_rows(staging: torch.Tensor, view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dispatch point: view[.., rows, E] = staging (Triton on CUDA, torch elsewhere); returns view."""
    _check(view, staging, rows)
    if use_triton(view):
        from baton.kernels.pack_triton import unpack_rows_triton
        return unpack_rows_triton(staging, view, rows)
    return unpack_rows_reference(staging, view, rows)
