"""Receiver side: when has a request's state arrived, and when may its slots be reused?

Threading: plain logic, called on the event loop thread only (the agent's notification pump feeds
it; the decode service calls `expect` and `abort`). Events go to `events`, an asyncio.Queue.

Per request tag the receiver sees, in order:
- `ARRIVED`: WRITTEN notices came for every WRITE of the request, they carried every expected
  component, and the aux row carries the tag. The slots now hold the request's state; the tracker forgets the tag.
- `FAILED` (with a reason): the request cannot use its slots (sender failed, deadline passed,
  aborted here, aux tag mismatch, peer gone). The request gets an error now...
- `RELEASE`: ...and only at this event may its slots go back to the free list: no WRITE into them
  is in flight. That is known from the sender's FAILED notice, its ABORTED acknowledgement, the
  WRITTEN notice of every WRITE, or the peer being gone (`peer_gone`, when the registry drops it).
  A deadline alone never releases: a WRITE may still land (sglang #27372, vLLM #46283).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable

from .metrics import TransferMetrics
from .notices import Kind, Notice
from .regions import AUX_KEY, MAX_TAG, Region, read_tag

log = logging.getLogger(__name__)


class EventKind(Enum):
    ARRIVED = "arrived"
    FAILED = "failed"
    RELEASE = "release"


@dataclass(frozen=True)
class ArrivalEvent:
    tag: int
    kind: EventKind
    reason: str = ""


@dataclass
class _Pending:
    peer: str
    components: frozenset[str]
    aux_offset: int
    deadline: float  # time.monotonic()
    failed: bool = False  # FAILED already emitted; waiting for a reason to RELEASE
    due: bool = False  # its sender said a WRITE started (`incoming`)
    parts: int = 0  # the request's number of WRITEs, from its first WRITTEN notice (0: none yet)
    seen: set[int] = field(default_factory=set)  # WRITEs landed
    carried: set[str] = field(default_factory=set)  # components those WRITEs carried

    def all_landed(self) -> bool:
        return self.parts > 0 and len(self.seen) == self.parts

    def missing(self) -> str:
        writes = f"{len(self.seen)} of {self.parts} WRITEs landed" if self.parts else "no WRITE landed"
        return f"{writes}; components not written: {sorted(self.components - self.carried)}"


class ArrivalTracker:
    def __init__(self, send: Callable[[str, Notice], None], aux: Region | None,
                 metrics: TransferMetrics):
        """`send(peer, notice)` queues a notice to a peer without blocking; `aux` is our aux region
        (None on a worker that only sends)."""
        self.events: asyncio.Queue[ArrivalEvent] = asyncio.Queue()
        self._send = send
        self._aux = aux
        self._metrics = metrics
        self._pending: dict[int, _Pending] = {}
        self.due = 0  # pending requests whose sender said a WRITE started (an int: read from the NIXL thread)
        self.on_expect: Callable[[], None] = lambda: None  # a new deadline to enforce (`next_deadline` may be sooner)

    @property
    def pending(self) -> int:
        """Requests whose slots are still held (waiting for arrival or for a safe release)."""
        return len(self._pending)

    def incoming(self, tag: int) -> bool:
        """The sender of `tag` says its WRITE starts now (a hint; it may trail the WRITE, or never
        come). -> whether `tag` is pending and was not due yet."""
        entry = self._pending.get(tag)
        if entry is None or entry.due:
            return False
        entry.due = True
        self.due += 1
        return True

    def expect(self, tag: int, peer: str, components: Iterable[str], aux_offset: int,
               deadline_s: float) -> None:
        """Start tracking `tag` from `peer`: its slots are reserved and the sender may now write.
        `components` are the plan's component keys (the aux row is always expected too);
        `aux_offset` is the byte offset of the request's aux row in our aux region."""
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"request tag must be a u64, got {tag}")
        if tag in self._pending:
            raise ValueError(f"request tag {tag} is already expected")
        if self._aux is None:
            raise ValueError("this agent registered no aux region, so it cannot receive requests")
        read_tag(self._aux, aux_offset)  # checks the offset now rather than at arrival
        self._pending[tag] = _Pending(peer, frozenset(components) | {AUX_KEY}, aux_offset,
                                      time.monotonic() + deadline_s)
        self.on_expect()

    def abort(self, tag: int, reason: str = "aborted by the receiver") -> None:
        """Give up on `tag` (e.g. the client cancelled): FAILED now, RELEASE once the sender
        acknowledges or is gone."""
        entry = self._pending.get(tag)
        if entry is None:
            log.info("abort of request %d ignored: not pending", tag)
        elif not entry.failed:
            self._fail(tag, entry, reason)
            self._send(entry.peer, Notice(Kind.ABORT, tag))

    def on_notice(self, peer: str, notice: Notice) -> None:
        entry = self._pending.get(notice.tag)
        if entry is None or entry.peer != peer:
            # FAILED/ABORTED may trail the last WRITTEN notice of a request that gave up: benign.
            level = logging.WARNING if notice.kind is Kind.WRITTEN else logging.INFO
            log.log(level, "ignored %s notice for unknown request %d from %r", notice.kind.name,
                    notice.tag, peer)
            return
        if notice.kind is Kind.WRITTEN:
            self._written(notice, entry)
        elif notice.kind in (Kind.FAILED, Kind.ABORTED):
            if not entry.failed:
                self._fail(notice.tag, entry, f"sender {peer!r} reported {notice.kind.name}")
            self._release(notice.tag)
        else:
            log.warning("ignored %s notice from %r: not a receiver's notice", notice.kind.name, peer)

    def next_deadline(self) -> float | None:
        """The earliest deadline `tick` still has to enforce (time.monotonic()), None if none."""
        return min((e.deadline for e in self._pending.values() if not e.failed), default=None)

    def tick(self) -> None:
        """Fail requests past their deadline (their slots stay held)."""
        now = time.monotonic()
        for tag, entry in list(self._pending.items()):
            if not entry.failed and now > entry.deadline:
                self._fail(tag, entry, f"transfer deadline passed; {entry.missing()}")
                self._send(entry.peer, Notice(Kind.ABORT, tag))

    def peer_gone(self, peer: str) -> None:
        """`peer` is dead or left: nothing it started can still be in flight."""
        for tag, entry in list(self._pending.items()):
            if entry.peer == peer:
                if not entry.failed:
                    self._fail(tag, entry, f"sender {peer!r} is gone")
                self._release(tag)

    def _written(self, notice: Notice, entry: _Pending) -> None:
        if (entry.parts and entry.parts != notice.parts) or notice.part in entry.seen:
            log.warning("ignored WRITTEN notice of request %d: WRITE %d/%d repeats one or contradicts "
                        "the count %d", notice.tag, notice.part, notice.parts, entry.parts)
            return
        entry.parts = notice.parts
        entry.seen.add(notice.part)
        entry.carried.update(notice.components)
        if extra := set(notice.components) - entry.components:
            log.warning("WRITTEN notice of request %d carried components not in its plan: %s",
                        notice.tag, sorted(extra))
        if entry.all_landed():
            self._all_written(notice.tag, entry)

    def _all_written(self, tag: int, entry: _Pending) -> None:
        if entry.failed:  # every WRITE landed after we gave up: nothing is in flight any more
            self._release(tag)
            return
        if not entry.components <= entry.carried:  # the sender's plan lacks some of ours
            self._fail(tag, entry, f"every WRITE landed but {entry.missing()}")
            self._release(tag)
            return
        found = read_tag(self._aux, entry.aux_offset)
        if found != tag:
            self._fail(tag, entry, f"aux row carries tag {found}, not {tag}")
            self._release(tag)
            return
        self._forget(tag)
        self._metrics.peer(entry.peer).arrivals += 1
        self._emit(tag, EventKind.ARRIVED)

    def _fail(self, tag: int, entry: _Pending, reason: str) -> None:
        entry.failed = True
        self._metrics.peer(entry.peer).arrival_failures += 1
        self._emit(tag, EventKind.FAILED, reason)

    def _release(self, tag: int) -> None:
        self._forget(tag)
        self._emit(tag, EventKind.RELEASE)

    def _forget(self, tag: int) -> None:
        if self._pending.pop(tag).due:
            self.due -= 1

    def _emit(self, tag: int, kind: EventKind, reason: str = "") -> None:
        self.events.put_nowait(ArrivalEvent(tag, kind, reason))
