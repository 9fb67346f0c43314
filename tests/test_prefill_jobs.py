"""Prefill's bookkeeping of dispatched requests and their targets (pure logic)."""
import asyncio

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import PrefillDispatch, SamplingParams
from baton.services.prefill import jobs as jobs_module
from baton.services.prefill.jobs import Job, Jobs, Target

pytestmark = pytest.mark.unit
LOOP = asyncio.new_event_loop()  # jobs only need a loop to make their futures; nothing runs on it


def new_job(request_id: str) -> Job:
    dispatch = PrefillDispatch(request_id=request_id, token_ids=[1, 2], sampling=SamplingParams())
    return Job(dispatch, LOOP.create_future())


TARGET = Target("decode-1", plan=None, decode_alloc=None)  # the bookkeeping never looks inside


def test_target_settles_a_dispatched_job():
    jobs, job = Jobs(), new_job("r1")
    jobs.add(job)
    assert job.target is None and not job.settled.is_set()
    jobs.settle("r1", TARGET)
    assert job.target is TARGET and job.settled.is_set()


def test_a_target_that_overtakes_its_dispatch_is_applied_when_the_dispatch_comes():
    jobs = Jobs()
    jobs.settle("r1", TARGET)
    job = new_job("r1")
    jobs.add(job)
    assert job.target is TARGET and job.settled.is_set()
    other = new_job("r2")
    jobs.add(other)
    assert other.outcome is None  # kept for r1 only


def test_the_first_outcome_wins_a_later_release_is_ignored():
    jobs, job = Jobs(), new_job("r1")
    jobs.add(job)
    jobs.settle("r1", TARGET)
    jobs.settle("r1", BatonError(ErrorCode.UNAVAILABLE, "released"))
    assert job.target is TARGET


def test_a_release_leaves_the_job_without_target():
    jobs, job = Jobs(), new_job("r1")
    jobs.add(job)
    jobs.settle("r1", BatonError(ErrorCode.UNAVAILABLE, "released"))
    assert job.target is None and isinstance(job.outcome, BatonError) and job.settled.is_set()


def test_an_early_outcome_expires(monkeypatch):
    monkeypatch.setattr(jobs_module, "EARLY_KEEP_S", -1.0)
    jobs = Jobs()
    jobs.settle("r1", TARGET)
    job = new_job("r1")
    jobs.add(job)
    assert job.outcome is None


def test_removed_jobs_are_forgotten():
    jobs, job = Jobs(), new_job("r1")
    jobs.add(job)
    assert "r1" in jobs
    jobs.remove(job)
    assert "r1" not in jobs
