"""Transfer descriptors: which items of a component move for a request, merged into byte runs.

Positions a request of L tokens needs on decode (docs/architecture.md window convention: a query
at p sees keys p-W+1 .. p): FULL layers all of 0..L-1; sliding layers max(0, L-W+1)..L-1, the
keys decode's first query (at position L) reads, whatever L is.

Components are item-major (components.py): an item (a page or a ring slot) holds every layer, so
what moves is whole items — the pages holding those positions, the request's ring slot — and a
run of items adjacent on both sides is one descriptor for every layer at once. Whole items carry
rows the transfer does not need (the rest of a last page, the ring rows outside the window, the
rows of an SWA page below the window); on decode those rows belong to the request and hold
positions it writes before any query reads them, or positions below its window that no query
reads.
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
    layer_index: int  # index into the component's regions: 0 (one region per component)
    src_offset: int  # bytes from the start of the prefill region
    dst_offset: int  # bytes from the start of the decode region
    nbytes: int


def needed_positions(kind: str, window: int | None, length: int) -> np.ndarray:
    start = 0 if kind == FULL else max(0, length - window + 1)
    return np.arange(start, length, dtype=np.int64)


def alloc_items(comp: Component, alloc: Allocation, positions: np.ndarray, side: str) -> np.ndarray:
    """Items (pages, the ring slot) of `comp` holding `positions` for this allocation, in position
    order, each once; PlanError if the allocation does not hold them."""
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
        items = np.array([alloc.slot], dtype=np.int64)
    else:
        page_index = np.arange(first // g.item_rows, last // g.item_rows + 1)
        table = alloc.swa_page_ids if comp.ident.kind == SWA else alloc.page_ids
        if int(page_index[-1]) >= len(table):
            raise PlanError(f"{side} allocation of request {alloc.request_id!r} has no page for "
                            f"position {last} of {name}")
        items = np.asarray(table, dtype=np.int64)[page_index]
        if (items < 0).any():
            raise PlanError(f"{side} allocation of request {alloc.request_id!r}: a page of {name} "
                            f"needed for positions {first}..{last} is released")
    if items.min() < 0 or items.max() >= g.num_items:
        raise PlanError(f"{side} allocation of request {alloc.request_id!r} points outside "
                        f"{name} ({g.num_items} items)")
    return items


def merge_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Fewest (src, dst, count) runs of ids (items) contiguous on both sides covering all pairs."""
    if src.size == 0:
        return []
    if np.unique(src).size != src.size or np.unique(dst).size != dst.size:
        raise PlanError("two pages of a request map to the same item")
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [s.size]])
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]
