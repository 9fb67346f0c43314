"""TransferAgent: a worker's NIXL agent, its peers, prepared WRITEs and the notification pump.

Threading: every method runs on one asyncio event loop thread; NIXL itself runs on the agent's
own thread (`NixlThread`), reached only through short calls that the loop awaits. Use it as
`async with TransferAgent(...) as agent:`; entering starts two tasks: the pump, which handles the
notifications the NIXL thread collects (ABORT requests for our WRITEs; WRITTEN/FAILED/ABORTED for
`agent.arrivals`) as they come, and a ticker that enforces arrival deadlines every TICK_S.

Sender (prefill): `await agent.write(peer, descriptors, tag, deadline_s)` returns only when no
WRITE of that request is in flight any more, whatever the outcome, so the sender frees its own
slots right after. Receiver (decode): `agent.arrivals` (see arrivals.py) says when a request's
state has arrived and when its slots may be reused.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from contextlib import suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Awaitable, Callable

from . import nixl_ops
from .arrivals import ArrivalTracker
from .faults import Faults
from .metrics import TransferMetrics
from .nixl_thread import NixlThread, Notifications, cma_hint
from .notices import Kind, Notice, decode
from .regions import (AUX_KEY, MAX_TAG, Batch, Descriptor, DescriptorError, Region, RegionTable,
                      resolve, write_tag)

log = logging.getLogger(__name__)

TICK_S = 0.01  # arrival deadlines are enforced this often
ABORTED_MEMORY = 65536  # tags aborted before their write started, remembered to refuse the write


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


@dataclass(frozen=True)
class PeerInfo:
    """What the registry publishes about a worker: plain data, never pickled."""
    name: str
    metadata: bytes
    regions: list[Region]


@dataclass(eq=False)
class _Peer:
    metadata: bytes
    table: RegionTable
    items: Any  # the peer's per-item prepared list (NIXL handle), None if it has no regions


@dataclass(eq=False)
class _Write:
    peer: str
    stop: str = ""  # why to stop early ("" = don't); set it with halt()
    abort_requested: bool = False  # the receiver sent ABORT: acknowledge it at the end
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def halt(self, reason: str) -> None:
        self.stop = self.stop or reason
        self.stopping.set()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class TransferAgent:
    def __init__(self, name: str, regions: list[Region], *,
                 lookup: Callable[[str], Awaitable[PeerInfo | None]] | None = None,
                 faults: Faults | None = None):
        """Create the NIXL agent and register every region (blocks for a moment: call it at
        start-up). `lookup(name)` fetches an unknown peer's registry entry on first use.
        Raises ValueError for a region registered twice, overlapping regions or bad sizes."""
        self.name = name
        self.table = RegionTable(regions, f"agent {name!r}")
        self.faults = faults if faults is not None else Faults.from_env()
        self.metrics = TransferMetrics()
        aux = [r for r in regions if r.component_key == AUX_KEY]
        self.arrivals = ArrivalTracker(self._send, aux[0] if aux else None, self.metrics)
        self._lookup = lookup
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = asyncio.Lock()
        self._writes: dict[int, _Write] = {}
        self._aborted: OrderedDict[int, None] = OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Task] = set()  # notices waiting for a peer lookup
        self._inbox: asyncio.Queue[Notifications] = asyncio.Queue()
        self._nixl = NixlThread(name)
        self._reg, self._items, self._metadata = self._nixl.call(nixl_ops.register, self.table)
        if hint := cma_hint():
            log.warning(hint)

    def metadata(self) -> bytes:
        """Our NIXL agent metadata (connection info and registered memory) for the registry."""
        return self._metadata

    async def __aenter__(self) -> TransferAgent:
        loop = asyncio.get_running_loop()
        await self._nixl.set_sink(lambda notifs: loop.call_soon_threadsafe(self._inbox.put_nowait, notifs))
        self._tasks = [asyncio.create_task(self._pump(), name=f"transfer-pump-{self.name}"),
                       asyncio.create_task(self._tick(), name=f"transfer-tick-{self.name}")]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop our writes (waiting until none is in flight), drop peers, deregister memory."""
        for job in self._writes.values():
            job.halt("transfer agent closing")
        for job in list(self._writes.values()):
            await job.done.wait()
        await self._nixl.set_sink(None)
        for task in self._tasks:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        for name, peer in list(self._peers.items()):
            await self._nixl.run(nixl_ops.disconnect, name, peer.items)
        self._peers.clear()
        await self._nixl.run(nixl_ops.deregister, self._reg, self._items)
        self._nixl.close()

    # --- peers -------------------------------------------------------------------------------
    async def add_peer(self, name: str, metadata: bytes, regions: list[Region]) -> None:
        """Load a peer's metadata and prepare its regions (from the validated manifest). A known
        peer with the same metadata is a no-op; new metadata means a restarted peer: the old
        one is removed first. Raises ValueError for bad metadata or regions."""
        async with self._peers_lock:
            known = self._peers.get(name)
            if known is not None and known.metadata == metadata and known.table.regions == list(regions):
                return
            if known is not None:
                await self._remove(name)
            table = RegionTable(regions, f"peer {name!r}")
            try:
                got, items = await self._nixl.run(nixl_ops.connect, metadata, table)
            except Exception as e:
                raise ValueError(f"cannot add peer {name!r}: {type(e).__name__}: {e}") from e
            if got != name:
                if got not in self._peers:
                    await self._nixl.run(nixl_ops.disconnect, got, items)
                raise ValueError(f"metadata given for peer {name!r} belongs to agent {got!r}")
            self._peers[name] = _Peer(metadata, table, items)

    async def remove_peer(self, name: str) -> None:
        """The peer left or its lease expired: stop our writes to it (waiting until none is in
        flight), forget it, and release every request expected from it (`arrivals`)."""
        async with self._peers_lock:
            await self._remove(name)

    async def _remove(self, name: str) -> None:
        jobs = [job for job in self._writes.values() if job.peer == name]
        for job in jobs:
            job.halt(f"peer {name!r} left")
        for job in jobs:
            await job.done.wait()
        peer = self._peers.pop(name, None)
        if peer is not None:
            await self._nixl.run(nixl_ops.disconnect, name, peer.items)
        self.arrivals.peer_gone(name)

    async def _peer(self, name: str) -> _Peer | None:
        if name not in self._peers and self._lookup is not None:
            try:
                info = await self._lookup(name)
                if info is not None:
                    await self.add_peer(info.name, info.metadata, info.regions)
            except Exception as e:
                log.error("cannot add peer %r from the registry: %s", name, e)
        return self._peers.get(name)

    # --- sender ------------------------------------------------------------------------------
    async def write(self, peer: str, descriptors: list[Descriptor], tag: int,
                    deadline_s: float) -> TransferResult:
        """WRITE the plan's regions, then the aux row stamped with `tag`, into `peer`'s slots;
        each component's WRITE notifies the peer with (tag, component). Never raises for a bad
        request: the result carries the error. When it returns, nothing is in flight (also when
        cancelled: the WRITEs are stopped first), so the caller may free its own slots."""
        start = time.monotonic()
        if tag in self._aborted:
            return TransferResult(tag, peer, TransferStatus.ABORTED, error="receiver aborted the request")
        if not 0 <= tag <= MAX_TAG or tag in self._writes:
            return self._failed(tag, peer, f"request tag {tag} is not a u64 or already in flight")
        dest = await self._peer(peer)
        if dest is None:
            return self._failed(tag, peer, f"unknown peer {peer!r}")
        try:
            batches = resolve(descriptors, self.table, dest.table)
        except DescriptorError as e:
            self._send(peer, Notice(Kind.FAILED, tag))
            return self._failed(tag, peer, str(e))
        aux = next(d for d in descriptors if d.component_key == AUX_KEY)
        write_tag(self.table.region((AUX_KEY, aux.layer_index)), aux.src_offset, tag)
        xfers = self._xfers(tag, batches)
        job = self._writes[tag] = _Write(peer)
        task = asyncio.create_task(self._run(tag, job, dest, xfers, start, deadline_s))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            job.halt("write was cancelled")
            await asyncio.wait([task])
            raise

    async def _run(self, tag: int, job: _Write, dest: _Peer, xfers: list[nixl_ops.Xfer],
                   start: float, deadline_s: float) -> TransferResult:
        loop = asyncio.get_running_loop()
        try:
            if self.faults.delay_s:  # a slow WRITE in flight: neither abort nor deadline stops it
                await asyncio.sleep(self.faults.delay_s)
            await self._nixl.run(nixl_ops.post, self._items, job.peer, dest.items, xfers)
            if any(x.state == "PROC" for x in xfers):
                landed = loop.create_future()
                self._nixl.watch(xfers, lambda: loop.call_soon_threadsafe(_resolve, landed))
                stopping = loop.create_task(job.stopping.wait())
                await asyncio.wait([landed, stopping], return_when=asyncio.FIRST_COMPLETED,
                                   timeout=max(0.0, start + deadline_s - time.monotonic()))
                stopping.cancel()
                if not landed.done():
                    job.halt(f"deadline of {deadline_s}s passed")
                    await self._nixl.run(nixl_ops.cancel, xfers)
                    await landed  # cancelled, or finished if NIXL could not cancel
            await self._nixl.run(nixl_ops.release, xfers)
            return self._finish(tag, job, xfers, time.monotonic() - start)
        finally:
            del self._writes[tag]
            job.done.set()

    def _xfers(self, tag: int, batches: list[Batch]) -> list[nixl_ops.Xfer]:
        """One WRITE per batch, each notifying (tag, component, part i of the component's n)."""
        parts = Counter(b.component_key for b in batches)
        numbered: Counter[str] = Counter()
        xfers = []
        for b in batches:
            key = b.component_key
            notice = Notice(Kind.WRITTEN, tag, key, numbered[key], parts[key]).encode()
            numbered[key] += 1
            xfers.append(nixl_ops.Xfer(b, b"" if key == self.faults.drop else notice,
                                       fail=key == self.faults.fail))
        return xfers

    def _finish(self, tag: int, job: _Write, xfers: list[nixl_ops.Xfer], seconds: float) -> TransferResult:
        nbytes = sum(x.batch.nbytes for x in xfers)
        if job.abort_requested:
            self._send(job.peer, Notice(Kind.ABORTED, tag))
            self.metrics.peer(job.peer).write_failures += 1
            return TransferResult(tag, job.peer, TransferStatus.ABORTED, 0, seconds, "receiver aborted the request")
        if all(x.state == "DONE" for x in xfers):
            stats = self.metrics.peer(job.peer)
            stats.bytes_written += nbytes
            stats.write_seconds += seconds
            stats.writes += 1
            return TransferResult(tag, job.peer, TransferStatus.DONE, nbytes, seconds)
        self._send(job.peer, Notice(Kind.FAILED, tag))
        errors = [f"{x.batch.component_key}: {x.error or x.state}" for x in xfers if x.state != "DONE"]
        hint = cma_hint() if any(x.state == "ERR" for x in xfers) else ""
        return self._failed(tag, job.peer, "; ".join(filter(None, [job.stop, *errors, hint])), seconds)

    def _failed(self, tag: int, peer: str, error: str, seconds: float = 0.0) -> TransferResult:
        log.warning("write of request %d to %r failed: %s", tag, peer, error)
        self.metrics.peer(peer).write_failures += 1
        return TransferResult(tag, peer, TransferStatus.FAILED, 0, seconds, error)

    def _on_abort(self, peer: str, tag: int) -> None:
        job = self._writes.get(tag)
        if job is not None and job.peer == peer:
            job.abort_requested = True
            job.halt("receiver aborted the request")
            return  # acknowledged by _finish once nothing is in flight
        self._aborted[tag] = None
        if len(self._aborted) > ABORTED_MEMORY:
            self._aborted.popitem(last=False)
        self._send(peer, Notice(Kind.ABORTED, tag))

    # --- notifications -----------------------------------------------------------------------
    def _send(self, peer: str, notice: Notice) -> None:
        """Queue a notice without waiting; an unknown peer is looked up first (in a task)."""
        if peer in self._peers or self._lookup is None:
            self._nixl.submit(nixl_ops.notify, peer, notice.encode())
        else:
            task = asyncio.get_running_loop().create_task(self._send_after_lookup(peer, notice))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_after_lookup(self, peer: str, notice: Notice) -> None:
        await self._peer(peer)
        self._nixl.submit(nixl_ops.notify, peer, notice.encode())

    async def _pump(self) -> None:
        while True:
            received = await self._inbox.get()
            for peer, messages in received.items():
                for message in messages:
                    try:
                        self._dispatch(peer, message)
                    except Exception:
                        log.exception("notification %r from %r: unexpected error (ignored)",
                                      message[:40], peer)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.arrivals.tick()
            except Exception:
                log.exception("arrival deadlines of %r: unexpected error (continuing)", self.name)

    def _dispatch(self, peer: str, message: bytes) -> None:
        notice = decode(message)
        if notice is None:
            log.warning("ignored malformed notification %r from %r", message[:40], peer)
        elif notice.kind is Kind.ABORT:
            self._on_abort(peer, notice.tag)
        else:
            self.arrivals.on_notice(peer, notice)
