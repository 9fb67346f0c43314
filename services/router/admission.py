"""The router's waiting queue in front of admission (one per router, first in first out).

A request goes to the workers (is admitted) while this router drives fewer admitted requests than
the decode workers have slots in all; otherwise it waits here, at most `max_queue_s`, and when
`max_queued` requests already wait it is refused at once with `busy` (the only `busy` a client of
a healthy cluster sees). Each admitted request gives its place back when it ends (`leave`), which
admits the head of the queue.

Slots are shared with other routers, and pages can run out before slots do, so decode may still
refuse an admitted request: it then goes back to the head of the queue (`refused`), and the queue
admits nobody until a request ends or RETRY_S passes. A waiting request that is cancelled leaves
the queue at once and never reaches a worker.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable

from baton.proto.errors import BatonError, ErrorCode
from baton.shared.metrics import ServiceMetrics

RETRY_S = 0.1  # after decode refused an admitted request, how long the queue waits before retrying


class AdmissionQueue:
    def __init__(self, capacity: Callable[[], int | None], max_queued: int, max_queue_s: float,
                 metrics: ServiceMetrics) -> None:
        """`capacity()`: how many requests may be admitted at once; None: unknown (admit, and let
        the request fail as it would without a queue, e.g. when no decode worker is registered)."""
        self.capacity, self.max_queued, self.max_queue_s, self.metrics = capacity, max_queued, max_queue_s, metrics
        self.admitted: set[str] = set()
        self.waiting: OrderedDict[str, asyncio.Future] = OrderedDict()  # request id -> admitted (True) or cancelled
        self._paused_until = 0.0
        self._retry: asyncio.TimerHandle | None = None

    async def enter(self, request_id: str, since: float | None = None) -> bool:
        """Until `request_id` is admitted (True) or cancelled while waiting (False). Raises busy when
        the queue is full, timeout once it has waited `max_queue_s` since `since` (time.monotonic();
        default now: a request refused again and again counts its waits together). A refused
        request waits at the head."""
        if request_id in self.admitted:
            return True
        refused = request_id in self.waiting
        if not self.waiting and self._room():
            self.admitted.add(request_id)
            return True
        if not refused and len(self.waiting) >= self.max_queued:
            raise BatonError(ErrorCode.BUSY, f"the request queue is full ({len(self.waiting)} waiting); retry later")
        future = self.waiting.setdefault(request_id, asyncio.get_running_loop().create_future())
        self.metrics.queued.set(len(self.waiting))
        started = time.monotonic()
        try:
            async with asyncio.timeout(max(self.max_queue_s - (started - (since or started)), 0.0)):
                return await future
        except TimeoutError:
            raise BatonError(ErrorCode.TIMEOUT, f"no capacity within {self.max_queue_s:g} s in the queue "
                             "(router.max_queue_s)") from None
        finally:
            self.waiting.pop(request_id, None)
            self.metrics.queued.set(len(self.waiting))
            self.metrics.queue_wait.observe(time.monotonic() - started)

    def cancel(self, request_id: str) -> None:
        """A waiting request leaves the queue now; its `enter` returns False."""
        future = self.waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(False)
            self.metrics.queued.set(len(self.waiting))

    def leave(self, request_id: str) -> None:
        """An admitted request ended: its place goes to the head of the queue."""
        if request_id in self.admitted:
            self.admitted.discard(request_id)
            self._paused_until = 0.0
            self._admit_waiting()

    def refused(self, request_id: str) -> None:
        """Decode had no room for an admitted request: it waits again, first in line, and nobody
        is admitted until a request ends or RETRY_S passes."""
        self.admitted.discard(request_id)
        self.waiting[request_id] = asyncio.get_running_loop().create_future()
        self.waiting.move_to_end(request_id, last=False)
        self._paused_until = time.monotonic() + RETRY_S
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(RETRY_S, self._resume)

    def _resume(self) -> None:
        """The pause after a refusal is over. asyncio may run this a clock tick before
        `_paused_until`; left to `_room()` then, nobody would be admitted and no timer would
        come again, so the pause ends here."""
        self._paused_until = 0.0
        self._admit_waiting()

    def wake(self) -> None:
        """Capacity may have changed (a worker joined): admit whom it now has room for."""
        self._admit_waiting()

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()

    def _room(self) -> bool:
        limit = self.capacity()
        return time.monotonic() >= self._paused_until and (limit is None or len(self.admitted) < limit)

    def _admit_waiting(self) -> None:
        while self.waiting and self._room():
            request_id, future = self.waiting.popitem(last=False)
            self.admitted.add(request_id)
            if not future.done():
                future.set_result(True)
