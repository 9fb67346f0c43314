"""The aux component: one byte row per request slot, the small state decode needs to start.

Row layout (item_bytes, a whole number of blocks):

    offset 0   u64   request tag
    offset 8   i64   first sampled token t_L
    offset 16  i64   n = number of valid hidden rows
    offset 24  f32   hidden tail [hidden_rows, hidden_size], NEWEST FIRST: row i = h_{L-1-i}

Newest-first means any prefix of the row (header + m hidden rows) carries the m most recent
hidden states, so a transfer plan copies one contiguous run: m = 1 (h_{L-1}) when the draft
state travels, m = min(L, W) when decode rebuilds the draft window from target hidden states.

NIXL registers the rows in blocks of `block_bytes` (the header and one hidden row, rounded up to
8), not whole rows: a transfer sends the whole blocks its prefix covers, by index into the
prepared lists like pages, so the request stays one WRITE and the common prefix (m = 1) is one
block, not the whole row (1 KB instead of 65 KB for this model).
"""
from __future__ import annotations

import ctypes

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the layout is plain data (registry, router); packing runs on workers
    import torch

HEADER_BYTES = 24
_U64 = 1 << 64


@dataclass(frozen=True)
class AuxLayout:
    hidden_size: int
    hidden_rows: int  # the tail length; the sliding window W, enough to rebuild the draft window

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * 4  # float32

    @property
    def block_bytes(self) -> int:
        """The unit NIXL registers and sends: the header and one hidden row, rounded up to 8."""
        return -(-(HEADER_BYTES + self.row_bytes) // 8) * 8

    @property
    def item_bytes(self) -> int:
        """One request's row: enough whole blocks for the header and every hidden row."""
        return -(-(HEADER_BYTES + self.hidden_rows * self.row_bytes) // self.block_bytes) * self.block_bytes


@dataclass(frozen=True)
class AuxRecord:
    tag: int
    first_token: int
    hidden: torch.Tensor  # [n, hidden_size] float32, oldest -> newest (n ends at h_{L-1})


def pack_aux(row: torch.Tensor, layout: AuxLayout, tag: int, first_token: int,
             hidden: torch.Tensor) -> None:
    """Write one aux row in place. row: uint8 [item_bytes]; hidden: [n, hidden_size], oldest
    first (the last row is h_{L-1})."""
    n = hidden.shape[0]
    if n > layout.hidden_rows or hidden.shape[1:] != (layout.hidden_size,):
        raise ValueError(f"hidden tail {tuple(hidden.shape)} does not fit aux rows "
                         f"[{layout.hidden_rows}, {layout.hidden_size}]")
    if not 0 <= tag < _U64:
        raise ValueError(f"request tag {tag} is not a u64")
    import torch

    header = row[:HEADER_BYTES].view(torch.int64)  # [3]
    header.copy_(torch.tensor([tag - _U64 if tag >= 1 << 63 else tag, first_token, n], device=row.device))
    body = row[HEADER_BYTES:HEADER_BYTES + n * layout.row_bytes].view(torch.float32)
    body.view(n, layout.hidden_size).copy_(hidden.flip(0))  # [n, hidden] newest first


def first_token_at(row_address: int) -> int:
    """The first token of the aux row at `row_address` (host memory), read without torch: decode
    streams it the moment the row has landed."""
    return int.from_bytes(ctypes.string_at(row_address + 8, 8), "little", signed=True)


def unpack_aux(row: torch.Tensor, layout: AuxLayout, max_rows: int | None = None) -> AuxRecord:
    """Read one aux row; `max_rows` caps n at what a transfer actually carried."""
    import torch

    tag, first_token, n = row[:HEADER_BYTES].view(torch.int64).tolist()
    n = min(n, layout.hidden_rows if max_rows is None else max_rows)
    body = row[HEADER_BYTES:HEADER_BYTES + n * layout.row_bytes].view(torch.float32)
    hidden = body.view(n, layout.hidden_size).flip(0).clone()  # [n, hidden] oldest first
    return AuxRecord(tag=tag % _U64, first_token=first_token, hidden=hidden)
