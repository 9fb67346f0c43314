"""Transfer descriptors: which rows of a component move for a request, merged into byte runs.

Positions a request of L tokens needs on decode (docs/architecture.md window convention: a query
at p sees keys p-W+1 .. p): FULL layers all of 0..L-1; sliding layers max(0, L-W+1)..L-1, the
keys decode's first query (at position L) reads, whatever L is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.shared.kv.components import Allocation, Component
from baton.shared.kv.routing import FULL, SWA, SWA_RING


class PlanError(ValueError):
    """A prefill/decode pairing or a transfer that cannot be done; names the component."""


@dataclass(frozen=True)
class Descriptor:
    component_key: str  # component name, e.g. "draft/SWA_RING"
    layer_index: int  # index into the component's layer ids / regions
    src_offset: int  # bytes from the start of the prefill region
    dst_offset: int  # bytes from the start of the decode region
    nbytes: int


def needed_positions(kind: str, window: int | None, length: int) -> np.ndarray:
    start = 0 if kind == FULL else max(0, length - window + 1)
    return np.arange(start, length, dtype=np.int64)


def alloc_rows(comp: Component, alloc: Allocation, positions: np.ndarray, side: str) -> np.ndarray:
    """Physical rows of `positions` in `comp` for this allocation; PlanError if not held."""
    g, name = comp.geometry, comp.name
    if comp.ident.kind not in (FULL, SWA, SWA_RING):
        raise PlanError(f"component {name} has no row addressing")
    if positions.size == 0:
        return positions
    low = 0 if comp.ident.kind == FULL else alloc.floor
    first, last = int(positions[0]), int(positions[-1])
    if first < low or last >= alloc.length:
        raise PlanError(f"{side} allocation of request {alloc.request_id!r} holds positions "
                        f"{low}..{alloc.length - 1} of {name}; the transfer needs {first}..{last}")
    if comp.ident.kind == SWA_RING:
        rows = alloc.slot * g.item_rows + positions % g.item_rows
    else:
        page_index = positions // g.item_rows
        table = alloc.swa_page_ids if comp.ident.kind == SWA else alloc.page_ids
        if int(page_index[-1]) >= len(table):
            raise PlanError(f"{side} allocation of request {alloc.request_id!r} has no page for "
                            f"position {last} of {name}")
        pages = np.asarray(table, dtype=np.int64)[page_index]
        if (pages < 0).any():
            raise PlanError(f"{side} allocation of request {alloc.request_id!r}: a page of {name} "
                            f"needed for positions {first}..{last} is released")
        rows = pages * g.item_rows + positions % g.item_rows
    if rows.min() < 0 or rows.max() >= g.num_items * g.item_rows:
        raise PlanError(f"{side} allocation of request {alloc.request_id!r} points outside "
                        f"{name} ({g.num_items} items)")
    return rows


def merge_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Fewest (src_row, dst_row, count) runs contiguous on both sides covering all row pairs."""
    if src.size == 0:
        return []
    if np.unique(src).size != src.size or np.unique(dst).size != dst.size:
        raise PlanError("two positions map to the same row")
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [s.size]])
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]
