"""Sender side (prefill): WRITE one request's regions into a peer's reserved slots.

Threading: event loop thread only, like the agent that owns it; NIXL calls go to the agent's
NixlThread. `write` returns only when no WRITE of the request is in flight any more, whatever the
outcome (done, failed, deadline, aborted by the receiver, cancelled), so the caller may free its
own slots right after; a failure is always a result with an error, and the receiver is told
(FAILED, or ABORTED to acknowledge its ABORT) once nothing is in flight.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from . import nixl_ops
from .faults import Faults
from .metrics import TransferMetrics
from .nixl_thread import NixlThread, cma_hint
from .notices import Kind, Notice
from .regions import AUX_KEY, MAX_TAG, Batch, Descriptor, DescriptorError, RegionTable, resolve, write_tag

log = logging.getLogger(__name__)

ABORTED_MEMORY = 65536  # tags aborted before their write started, remembered to refuse that write
ABORTED_KEEP_S = 600.0  # ... for at most this long (a write comes within its transfer deadline)


class TransferStatus(Enum):
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"  # the receiver asked to stop; it has been acknowledged


@dataclass(frozen=True)
class TransferResult:
    tag: int
    peer: str
    status: TransferStatus
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE


@dataclass(frozen=True, eq=False)
class Destination:
    """A peer's regions and its per-item prepared lists (NIXL handles) by memory kind."""
    table: RegionTable
    items: dict[str, Any]


@dataclass(eq=False)
class _Write:
    peer: str
    wake: asyncio.Future  # done once the WRITEs landed or the write was asked to stop (halt)
    landed: asyncio.Future  # done once no WRITE is in flight (their handles go next on the NIXL thread)
    stop: str = ""  # why to stop early ("" = don't); set it with halt()
    abort_requested: bool = False  # the receiver sent ABORT: acknowledge it at the end
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def halt(self, reason: str) -> None:
        self.stop = self.stop or reason
        _settle(self.wake)

    def land(self) -> None:
        _settle(self.landed)
        _settle(self.wake)


class Sender:
    def __init__(self, nixl: NixlThread, table: RegionTable, items: Any, metrics: TransferMetrics,
                 send: Callable[[str, Notice], None], faults: Faults):
        """`items`: our per-item prepared lists by memory kind (None once the agent closed); `send(peer, notice)`
        queues a notice."""
        self.faults = faults
        self.items = items
        self._nixl = nixl
        self._table = table
        self._metrics = metrics
        self._send = send
        self._writes: dict[int, _Write] = {}
        self._aborted: OrderedDict[int, float] = OrderedDict()  # tag -> until when its write is refused

    async def stop(self, reason: str, peer: str | None = None) -> None:
        """Stop the writes (to `peer`, or all) and wait until none of them is in flight."""
        jobs = [job for job in self._writes.values() if peer is None or job.peer == peer]
        for job in jobs:
            job.halt(reason)
        for job in jobs:
            await job.done.wait()

    async def write(self, peer: str, dest: Destination | None, descriptors: list[Descriptor], tag: int,
                    deadline_s: float) -> TransferResult:
        """WRITE the plan's regions and the aux row stamped with `tag` into `dest`, as one WRITE
        of whole items and, if needed, one of byte ranges per pair of memory kinds (`resolve`; on
        the CPU one WRITE); each notifies the peer with (tag, its components, WRITE i of n).
        Never raises for a bad request."""
        start = time.monotonic()
        if self._aborted.pop(tag, 0.0) > start:  # refused once: the same tag later is a request id used again
            return TransferResult(tag, peer, TransferStatus.ABORTED, error="receiver aborted the request")
        if not 0 <= tag <= MAX_TAG or tag in self._writes:
            return self.failed(tag, peer, f"request tag {tag} is not a u64 or already in flight")
        if dest is None:
            return self.failed(tag, peer, f"unknown peer {peer!r}")
        try:
            batches = resolve(descriptors, self._table, dest.table)
        except DescriptorError as e:
            self._send(peer, Notice(Kind.FAILED, tag))
            return self.failed(tag, peer, str(e))
        aux = next(d for d in descriptors if d.component_key == AUX_KEY)
        write_tag(self._table.region((AUX_KEY, aux.layer_index)), aux.src_offset, tag)
        loop = asyncio.get_running_loop()
        job = self._writes[tag] = _Write(peer, loop.create_future(), loop.create_future())
        xfers = self._xfers(tag, batches)
        if not self.faults.delay_s:
            self._post(job, dest, xfers)  # on the wire now, not when the task first runs
        task = asyncio.create_task(self._run(tag, job, dest, xfers, start, deadline_s))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            job.halt("write was cancelled")
            await asyncio.wait([task])
            raise

    def failed(self, tag: int, peer: str, error: str, seconds: float = 0.0) -> TransferResult:
        log.warning("write of request %d to %r failed: %s", tag, peer, error)
        self._metrics.peer(peer).write_failures += 1
        return TransferResult(tag, peer, TransferStatus.FAILED, 0, seconds, error)

    def on_abort(self, peer: str, tag: int) -> None:
        """The receiver sent ABORT for `tag`: stop its write, or refuse it if it has not started;
        acknowledged (ABORTED) once nothing is in flight."""
        job = self._writes.get(tag)
        if job is not None and job.peer == peer:
            job.abort_requested = True
            job.halt("receiver aborted the request")
            return  # acknowledged by _finish
        self._aborted[tag] = time.monotonic() + ABORTED_KEEP_S
        if len(self._aborted) > ABORTED_MEMORY:
            self._aborted.popitem(last=False)
        self._send(peer, Notice(Kind.ABORTED, tag))

    async def _run(self, tag: int, job: _Write, dest: Destination, xfers: list[nixl_ops.Xfer],
                   start: float, deadline_s: float) -> TransferResult:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(max(0.0, start + deadline_s - time.monotonic()),
                                   job.halt, f"deadline of {deadline_s}s passed")
        try:
            if self.faults.delay_s:  # a slow WRITE in flight: neither abort nor deadline stops it
                await asyncio.sleep(self.faults.delay_s)
                self._post(job, dest, xfers)
            await job.wake
            if not job.landed.done():  # stopped early: abort, deadline, peer gone, cancelled
                await self._nixl.run(nixl_ops.cancel, xfers, self._nixl.copy_threads == 0)
                await job.landed  # cancelled, or finished if NIXL could not cancel
            return self._finish(tag, job, xfers, time.monotonic() - start)
        finally:
            deadline.cancel()
            del self._writes[tag]
            job.done.set()

    def _post(self, job: _Write, dest: Destination, xfers: list[nixl_ops.Xfer]) -> None:
        loop = asyncio.get_running_loop()
        self._nixl.post(nixl_ops.post, xfers, lambda: loop.call_soon_threadsafe(job.land),
                        self.items, job.peer, dest.items)

    def _xfers(self, tag: int, batches: list[Batch]) -> list[nixl_ops.Xfer]:
        """One WRITE per batch, each notifying (tag, its components, WRITE i of n)."""
        xfers = []
        for i, b in enumerate(batches):
            notice = Notice(Kind.WRITTEN, tag, b.components, i, len(batches)).encode()
            xfers.append(nixl_ops.Xfer(b, b"" if self.faults.drop in b.components else notice,
                                       fail=self.faults.fail in b.components))
        return xfers

    def _finish(self, tag: int, job: _Write, xfers: list[nixl_ops.Xfer], seconds: float) -> TransferResult:
        nbytes = sum(x.batch.nbytes for x in xfers)
        if job.abort_requested:
            self._send(job.peer, Notice(Kind.ABORTED, tag))
            self._metrics.peer(job.peer).write_failures += 1
            return TransferResult(tag, job.peer, TransferStatus.ABORTED, 0, seconds, "receiver aborted the request")
        if all(x.state == "DONE" for x in xfers):
            stats = self._metrics.peer(job.peer)
            stats.bytes_written += nbytes
            stats.write_seconds += seconds
            stats.writes += 1
            return TransferResult(tag, job.peer, TransferStatus.DONE, nbytes, seconds)
        self._send(job.peer, Notice(Kind.FAILED, tag))
        errors = [f"WRITE of {x.batch.label}: {x.error or x.state}" for x in xfers if x.state != "DONE"]
        hint = cma_hint() if any(x.state == "ERR" for x in xfers) else ""
        return self.failed(tag, job.peer, "; ".join(filter(None, [job.stop, *errors, hint])), seconds)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
