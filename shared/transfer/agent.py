"""TransferAgent: a worker's NIXL agent, its peers, prepared WRITEs and the notification pump.

Threading: every method runs on one asyncio event loop thread; NIXL itself runs on the agent's
own thread (`NixlThread`), reached only through short calls that the loop awaits. Use it as
`async with TransferAgent(...) as agent:`; entering starts two tasks: the pump, which handles the
notifications the NIXL thread collects (ABORT requests for our WRITEs; WRITTEN/FAILED/ABORTED for
`agent.arrivals`) as they come, and a ticker that enforces arrival deadlines when the earliest one
passes (and at least every TICK_S).

Sender (prefill): `await agent.write(peer, descriptors, tag, deadline_s)` (sender.py) returns
only when no WRITE of that request is in flight any more, whatever the outcome, so the sender
frees its own slots right after. Receiver (decode): `agent.arrivals` (arrivals.py) says when a
request's state has arrived and when its slots may be reused.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass
from typing import Awaitable, Callable

from . import nixl_ops
from .arrivals import ArrivalTracker
from .faults import Faults
from .metrics import TransferMetrics
from .nixl_thread import NixlThread, Notifications, cma_hint
from .notices import Kind, Notice, decode
from .regions import AUX_KEY, Descriptor, Region, RegionTable
from .sender import Destination, Sender, TransferResult

log = logging.getLogger(__name__)

TICK_S = 1.0  # the ticker's longest sleep: it wakes at the earliest arrival deadline, or when one is added
TICK_LATE_S = 0.001  # how long after a deadline it looks again, if it woke on it a hair early


@dataclass(frozen=True)
class PeerInfo:
    """What the registry publishes about a worker: plain data, never pickled."""
    name: str
    metadata: bytes
    regions: list[Region]


@dataclass(frozen=True, eq=False)
class _Peer:
    metadata: bytes
    dest: Destination


class TransferAgent:
    def __init__(self, name: str, regions: list[Region], *,
                 lookup: Callable[[str], Awaitable[PeerInfo | None]] | None = None,
                 faults: Faults | None = None, copy_threads: int = 0):
        """Create the NIXL agent and register every region (blocks for a moment: call it at
        start-up). `lookup(name)` fetches an unknown peer's registry entry on first use.
        `copy_threads` > 0: large WRITEs copy on that many threads in parallel (`create_agent`).
        Raises ValueError for a region registered twice, overlapping regions or bad sizes."""
        self.name = name
        self.table = RegionTable(regions, f"agent {name!r}")
        self.metrics = TransferMetrics()
        aux = [r for r in regions if r.component_key == AUX_KEY]
        self.arrivals = ArrivalTracker(self._send, aux[0] if aux else None, self.metrics)
        self._deadline_added = asyncio.Event()
        self.arrivals.on_expect = self._deadline_added.set
        self._lookup = lookup
        self._peers: dict[str, _Peer] = {}
        self._leaving: dict[str, _Peer] = {}  # being removed: no new WRITE, notices still go out
        # adding and removing one peer happen in order; a removal waiting for a WRITE to a hung
        # peer (copy threads: not cancellable) holds up only that peer, not adding others
        self._peer_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Task] = set()  # notices waiting for a peer lookup
        self._inbox: asyncio.Queue[Notifications] = asyncio.Queue()
        self._nixl = NixlThread(name, copy_threads)
        self._nixl.expecting = lambda: self.arrivals.pending > 0  # len() of a dict: safe from that thread
        self._nixl.due = lambda: self.arrivals.due > 0  # an int attribute: likewise
        # set by a receiver whose engine thread is stepping (read on the NIXL thread: a plain
        # attribute read): a state that lands then waits for the step in flight anyway, so its
        # notification is collected every 1 ms, not every 0.1 ms, taking the GIL from that step less often
        self.engine_busy: Callable[[], bool] = lambda: False
        self._nixl.patient = lambda: self.engine_busy()
        self._reg, items, self._metadata = self._nixl.call(nixl_ops.register, self.table)
        self._sender = Sender(self._nixl, self.table, items, self.metrics, self._send,
                              faults if faults is not None else Faults.from_env())
        if hint := cma_hint():
            log.warning(hint)

    @property
    def faults(self) -> Faults:
        """Fault injection for our WRITEs (tests); assignable."""
        return self._sender.faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self._sender.faults = faults

    def metadata(self) -> bytes:
        """Our NIXL agent metadata (connection info and registered memory) for the registry."""
        if self._sender.faults.metadata == "truncate":
            return self._metadata[:len(self._metadata) // 2]
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
        await self._sender.stop("transfer agent closing")
        await self._nixl.set_sink(None)
        for task in self._tasks:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await self._disconnect_all()
        await self._nixl.run(nixl_ops.deregister, self._reg, self._sender.items)
        # NIXL's handles hold its agent, whose teardown must happen on its own thread (nixl_thread):
        # none may be left here when that thread ends
        self._sender.items = None
        self._nixl.close()

    async def _disconnect_all(self) -> None:
        peers = {**self._peers, **self._leaving}
        self._peers.clear()
        self._leaving.clear()
        for name, peer in peers.items():
            await self._nixl.run(nixl_ops.disconnect, name, peer.dest.items)

    # --- peers -------------------------------------------------------------------------------
    async def add_peer(self, name: str, metadata: bytes, regions: list[Region]) -> None:
        """Load a peer's metadata and prepare its regions (from the validated manifest). A known
        peer with the same metadata is a no-op; new metadata means a restarted peer: the old
        one is removed first. Raises ValueError for bad metadata or regions."""
        async with self._peer_locks[name]:
            known = self._peers.get(name)
            if known is not None and known.metadata == metadata and known.dest.table.regions == list(regions):
                return
            if known is not None or name in self._leaving:  # restarted, or a removal was cancelled
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
            self._peers[name] = _Peer(metadata, Destination(table, items))

    async def remove_peer(self, name: str) -> None:
        """The peer left or its lease expired: forget it (no new WRITE to it starts), stop our
        writes to it and wait until none is in flight, disconnect, and release every request
        expected from it (`arrivals`)."""
        async with self._peer_locks[name]:
            await self._remove(name)

    async def _remove(self, name: str) -> None:
        """Forget the peer first, so that no WRITE to it starts while ours in flight are stopped
        and waited for; disconnect only then. Its notices (FAILED, ABORTED) still go out, before
        the disconnect."""
        peer = self._peers.pop(name, None) or self._leaving.get(name)
        if peer is not None:
            self._leaving[name] = peer
        await self._sender.stop(f"peer {name!r} left", peer=name)
        if peer is not None and self._leaving.pop(name, None) is not None:  # else close() did it
            await self._nixl.run(nixl_ops.disconnect, name, peer.dest.items)
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
        """WRITE the plan's regions and the aux row stamped with `tag` into `peer`'s slots
        (see sender.py). Never raises for a bad request: the result carries the error. When it
        returns nothing is in flight, also when cancelled, so the caller may free its slots."""
        known = await self._peer(peer)
        return await self._sender.write(peer, known and known.dest, descriptors, tag, deadline_s)

    # --- receiver ------------------------------------------------------------------------------
    def incoming(self, tag: int) -> None:
        """The sender of an expected request says its WRITE starts now: look for the WRITE's
        notifications at once and every 0.1 ms until it lands (before, every 1 ms)."""
        if self.arrivals.incoming(tag):
            self._nixl.hurry()

    # --- notifications -----------------------------------------------------------------------
    def _send(self, peer: str, notice: Notice) -> None:
        """Queue a notice without waiting; an unknown peer is looked up first (in a task)."""
        if peer in self._peers or peer in self._leaving or self._lookup is None:
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
        """Enforce arrival deadlines as the earliest passes, not on a timer: a wake-up of this loop
        takes the GIL (and, pinned, the core) from the engine thread, and at every 10 ms it was ~30%
        of an idle prefill loop's CPU (py-spy; docs/benchmarks.md, stop 54)."""
        while True:
            self._deadline_added.clear()
            due = self.arrivals.next_deadline()
            sleep_s = TICK_S if due is None else min(TICK_S, max(TICK_LATE_S, due - time.monotonic()))
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._deadline_added.wait(), sleep_s)
            try:
                self.arrivals.tick()
            except Exception:
                log.exception("arrival deadlines of %r: unexpected error (continuing)", self.name)

    def _dispatch(self, peer: str, message: bytes) -> None:
        notice = decode(message)
        if notice is None:
            log.warning("ignored malformed notification %r from %r", message[:40], peer)
        elif notice.kind is Kind.ABORT:
            self._sender.on_abort(peer, notice.tag)
        else:
            self.arrivals.on_notice(peer, notice)
