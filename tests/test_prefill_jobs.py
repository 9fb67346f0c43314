"""Prefill's bookkeeping of dispatched requests and their targets (pure logic)."""
import asyncio
from collections import deque

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import PrefillDispatch, PrefillTarget, SamplingParams
from baton.services.prefill import jobs as jobs_module
from baton.services.prefill.jobs import Job, Jobs, take_batch
from proto_examples import ALLOCATION, PLAN

pytestmark = pytest.mark.unit
LOOP = asyncio.new_event_loop()  # jobs only need a loop to make their futures; nothing runs on it


def new_job(request_id: str, prompt_tokens: int = 2) -> Job:
    dispatch = PrefillDispatch(request_id=request_id, token_ids=[1] * prompt_tokens, sampling=SamplingParams())
    return Job(dispatch, LOOP.create_future())


TARGET = PrefillTarget(request_id="r1", decode_worker_id="decode-1", decode_allocation=ALLOCATION,
                       transfer_plan=PLAN)  # the bookkeeping never looks inside


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


def queue_of(*prompt_tokens: int) -> deque[Job]:
    return deque(new_job(f"r{i}", n) for i, n in enumerate(prompt_tokens))


def test_a_batch_takes_prompts_in_order_up_to_its_token_bound():
    queue = queue_of(128, 128, 128, 128, 128, 64)
    batches = []
    while queue:
        batches.append([job.request_id for job in take_batch(queue, max_prompts=64, max_tokens=512)])
    assert batches == [["r0", "r1", "r2", "r3"], ["r4", "r5"]]


def test_a_prompt_longer_than_the_bound_runs_alone_and_nothing_overtakes_it():
    queue = queue_of(100, 1000, 10)
    assert [j.request_id for j in take_batch(queue, 64, 512)] == ["r0"]  # r1 does not fit beside r0
    assert [j.request_id for j in take_batch(queue, 64, 512)] == ["r1"]  # alone, over the bound
    assert [j.request_id for j in take_batch(queue, 64, 512)] == ["r2"]
    assert not queue


def test_a_batch_takes_at_most_max_prompts_and_a_zero_bound_takes_any_tokens():
    queue = queue_of(*[1000] * 5)
    assert len(take_batch(queue, max_prompts=3, max_tokens=0)) == 3
    assert len(take_batch(queue, max_prompts=3, max_tokens=0)) == 2
    assert take_batch(queue, max_prompts=3, max_tokens=0) == []
