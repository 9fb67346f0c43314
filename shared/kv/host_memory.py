"""Zeroed host tensors on transparent huge pages, for the pools NIXL moves.

A NIXL WRITE between two processes on one machine is UCX's `cma` transport: process_vm_writev,
which pins the peer's pages and copies them one page at a time. On 4 KiB pages that runs at about
half of memcpy here; on 2 MiB transparent huge pages at about memcpy (docs/benchmarks.md, "NIXL
transfer bandwidth"). With the kernel's default THP mode "madvise" a mapping gets huge pages only
when it asks, and torch's allocator does not ask, so a pool is its own anonymous mapping, aligned
to 2 MiB and advised MADV_HUGEPAGE. Where the kernel has no THP the advice is a no-op (or fails
and is skipped): the tensor is the same, only slower to copy across processes.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in memory advised for 2 MiB huge pages. The
    tensor keeps its mapping alive; every page is touched (resident, like torch.zeros)."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # [nbytes + HUGE_PAGE], holds `mapping`
    start = -raw.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes:
        try:
            mapping.madvise(advice, start, nbytes)
        except OSError:
            pass  # no THP in this kernel: 4 KiB pages
    out = raw[start:start + nbytes].view(dtype).view(shape)
    out.zero_()
    return out
