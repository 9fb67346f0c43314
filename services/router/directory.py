"""The router's view of the cluster: live workers and transfer plans, cached from the registry,
and what each worker's cache holds (prefill's prefix caches, decode's turn caches), from the
workers' events (affinity.py).

Refreshed in the background and on worker events; when the registry is briefly down the last
view keeps serving (requests keep flowing through a registry restart). A worker whose cache
view is missing or stale is asked for a snapshot at the next background refresh.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.internal import (LookupReply, LookupRequest, PlanReply, PlanRequest, PrefixEvents, PrefixQuery,
                                  WorkerEvent, WorkerInfo)
from baton.shared.bus import Bus
from baton.shared.bus.wire import decode_event
from baton.shared.kv.plan import TransferPlan

from .affinity import PrefixAffinity

log = logging.getLogger("baton.router.directory")


class Directory:
    def __init__(self, bus: Bus, affinity: PrefixAffinity | None = None, refresh_s: float = 0.5) -> None:
        self.bus, self.refresh_s = bus, refresh_s
        self.affinity = affinity or PrefixAffinity()  # what each prefill worker's prefix cache holds
        self.turns = PrefixAffinity(self.affinity.weight)  # what each decode worker's turn cache holds
        self._stale_prefixes: set[str] = set()  # workers whose cache events showed a gap
        self.workers: dict[str, WorkerInfo] = {}
        self._plans: dict[tuple[str, str], TransferPlan] = {}
        self._outstanding: dict[str, int] = {}  # in flight from this router: prompt tokens per prefill, requests per decode
        self._seen_at: dict[str, float] = {}  # worker id -> when this view first listed it (monotonic)
        self._lookups_started = 0
        self._lookup_applied = 0  # the newest lookup whose answer is the view: an older one never overwrites it
        self.on_left: Callable[[str, str], None] = lambda worker_id, reason: None  # set by the router
        self.on_refresh: Callable[[], None] = lambda: None  # after each view the registry gave

    async def start(self) -> None:
        await self.bus.subscribe(subjects.WORKER_EVENTS, self._on_event)
        await self.bus.subscribe(subjects.PREFIX_EVENTS, self._on_prefix_events)
        await self.refresh()
        await self.sync_prefixes()

    async def refresh(self) -> bool:
        """Replace the view with the registry's; False (the last view kept) when it cannot be asked."""
        self._lookups_started += 1
        lookup = self._lookups_started
        try:
            reply = await self.bus.request(subjects.LOOKUP, LookupRequest(), LookupReply, timeout=2.0)
        except BatonError as exc:
            log.warning("registry lookup failed, keeping the last view (%d workers): %s", len(self.workers), exc)
            return False
        if lookup < self._lookup_applied:  # a later lookup (e.g. one an event started) answered first
            return True
        self._lookup_applied = lookup
        fresh = {w.registration.worker_id: w for w in reply.workers}
        for gone in set(self.workers) - set(fresh):
            self._forget(gone)
        now = time.monotonic()
        for worker_id in fresh:
            self._seen_at.setdefault(worker_id, now)
        self.workers = fresh
        self.on_refresh()
        return True

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
            await self.sync_prefixes()

    def cached(self, role: str) -> PrefixAffinity:
        """The index of what workers of `role` hold: prefill's prefix caches, decode's turn caches."""
        return self.affinity if role == "prefill" else self.turns

    async def sync_prefixes(self) -> None:
        """Ask each worker whose cache view is missing or stale for a snapshot."""
        asked = [w for w in self.workers.values() if w.registration.worker_id in self._stale_prefixes
                 or not self.cached(w.registration.role).knows(w.registration.worker_id, w.registration.instance_id)]
        for worker, reply in zip(asked, await asyncio.gather(*map(self._prefix_snapshot, asked))):
            worker_id = worker.registration.worker_id
            if reply is not None and worker_id in self.workers:
                self._stale_prefixes.discard(worker_id)
                self.cached(worker.registration.role).apply(reply)

    async def _prefix_snapshot(self, worker: WorkerInfo) -> PrefixEvents | None:
        worker_id = worker.registration.worker_id
        subject = (subjects.prefill_prefixes if worker.registration.role == "prefill" else subjects.decode_prefixes)
        try:
            return await self.bus.request(subject(worker_id), PrefixQuery(), PrefixEvents, timeout=1.0)
        except BatonError as exc:  # tried again at the next refresh
            log.debug("cache snapshot of %s failed: %s", worker_id, exc)
            return None

    async def _on_prefix_events(self, msg) -> None:
        if (events := decode_event(msg.data, PrefixEvents, log)) is None:
            return
        worker = self.workers.get(events.worker_id)
        if worker is not None and not self.cached(worker.registration.role).apply(events):
            self._stale_prefixes.add(events.worker_id)

    def of_role(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.registration.role == role]

    async def known(self, role: str) -> list[WorkerInfo]:
        """Workers of `role`; when the view has none, the registry is asked first: a worker that
        just joined is missing until the lookup its event started has answered."""
        if not self.of_role(role):
            await self.refresh()
        return self.of_role(role)

    def joined_at(self, worker_id: str) -> float:
        """When this view first listed the worker (monotonic; 0 if it never did): requests to it
        just after may find its subscriptions not yet propagated (Bus.request, `joined_at`)."""
        return self._seen_at.get(worker_id, 0.0)

    def outstanding(self, worker_id: str) -> int:
        return self._outstanding.get(worker_id, 0)

    def add_outstanding(self, worker_id: str, tokens: int) -> None:
        self._outstanding[worker_id] = self._outstanding.get(worker_id, 0) + tokens

    async def plan(self, prefill_id: str, decode_id: str) -> TransferPlan:
        key = (prefill_id, decode_id)
        if key not in self._plans:
            reply = await self.bus.request(subjects.PLAN, PlanRequest(prefill_worker_id=prefill_id,
                                                                      decode_worker_id=decode_id),
                                           PlanReply, timeout=2.0)
            self._plans[key] = reply.plan
        return self._plans[key]

    def _forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self._seen_at.pop(worker_id, None)
        self.affinity.forget(worker_id)
        self.turns.forget(worker_id)
        self._stale_prefixes.discard(worker_id)
        self._plans = {k: v for k, v in self._plans.items() if worker_id not in k}

    async def _on_event(self, msg) -> None:
        if (event := decode_event(msg.data, WorkerEvent, log)) is None:
            return
        log.info("worker %s %s (%s)", event.worker_id, event.kind, event.reason)
        if event.kind == "left":
            await self._on_left(event)
            return
        if event.kind == "joined":  # a re-registered worker may come back with new memory
            self._forget(event.worker_id)
        await self.refresh()

    async def _on_left(self, event: WorkerEvent) -> None:
        """Act on a departure only when the registry's own view agrees: a forged or stale "left"
        for an instance the registry still lists changes nothing. When the registry cannot be
        asked, the event is believed (a real departure matters more), as workers do."""
        if await self.refresh() and self._lists(event):
            log.warning("ignored a 'left' event for %s, which the registry lists as live", event.worker_id)
            return
        self._forget(event.worker_id)
        self.on_left(event.worker_id, event.reason)

    def _lists(self, event: WorkerEvent) -> bool:
        worker = self.workers.get(event.worker_id)
        return worker is not None and (not event.instance_id or worker.registration.instance_id == event.instance_id)
