"""Prefill's requests in flight, and where each one's state goes.

A dispatch arrives first and starts computing; its `PrefillTarget` (decode's reserved slots and
the plan) arrives while it computes, or a release says there will be none. The two come on separate
subjects, so a target or release may overtake its dispatch: it is remembered for EARLY_KEEP_S
and applied when the dispatch arrives.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from baton.proto.errors import BatonError
from baton.proto.internal import PrefillDispatch, PrefillTarget
from baton.shared.metrics import Stamps

log = logging.getLogger("baton.prefill.jobs")
EARLY_KEEP_S = 30.0
EARLY_MAX = 10_000


Outcome = PrefillTarget | BatonError  # where the state goes, or why it goes nowhere


@dataclass(eq=False)
class Job:
    dispatch: PrefillDispatch
    done: asyncio.Future  # PrefillDone, or the request's error
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None  # set once, on the event loop; the engine thread only reads it
    at: Stamps = field(default_factory=Stamps)
    cached_tokens: int = 0  # prompt positions taken from the prefix cache (set on the engine thread)

    @property
    def request_id(self) -> str:
        return self.dispatch.request_id

    @property
    def target(self) -> PrefillTarget | None:
        return self.outcome if isinstance(self.outcome, PrefillTarget) else None


class Jobs:
    """Jobs by request id (event loop thread only)."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._early: dict[str, tuple[float, Outcome]] = {}  # request id -> (keep until, outcome)

    def add(self, job: Job) -> None:
        self._jobs[job.request_id] = job
        until, early = self._early.pop(job.request_id, (0.0, None))
        if early is not None and until > time.monotonic():
            self._settle(job, early)

    def remove(self, job: Job) -> None:
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def without_target(self) -> list[Job]:
        """Jobs that have neither a target nor a release yet."""
        return [job for job in self._jobs.values() if job.outcome is None]

    def settle(self, request_id: str, outcome: Outcome) -> None:
        """Apply a target or a release to the request's job, or keep it for a dispatch to come."""
        job = self._jobs.get(request_id)
        if job is not None:
            self._settle(job, outcome)
            return
        now = time.monotonic()
        if len(self._early) >= EARLY_MAX:
            self._early = {r: e for r, e in self._early.items() if e[0] > now}
        self._early[request_id] = (now + EARLY_KEEP_S, outcome)

    @staticmethod
    def _settle(job: Job, outcome: Outcome) -> None:
        if job.outcome is not None:
            log.info("request %s: ignored a second target/release (%s)", job.request_id,
                     type(outcome).__name__)
            return
        job.outcome = outcome
        job.settled.set()


def take_batch(queue: deque[Job], max_prompts: int, max_tokens: int) -> list[Job]:
    """The next batch from the head of `queue`, in order: up to `max_prompts` jobs whose prompts
    add up to at most `max_tokens` tokens (0: no token bound). The first job is always taken, so
    a prompt longer than the bound runs alone. A bounded batch ends sooner and hands its requests
    to decode while the next one computes (a burst of prompts is pipelined, not prefilled whole)."""
    jobs, tokens = [], 0
    while queue and len(jobs) < max_prompts:
        n = len(queue[0].dispatch.token_ids)
        if jobs and max_tokens and tokens + n > max_tokens:
            break
        jobs.append(queue.popleft())
        tokens += n
    return jobs
