"""The router's view of the cluster (pure logic: the registry's lookup answers are fed by hand)."""
import asyncio
from dataclasses import replace

import pytest

from baton.proto.internal import LookupReply, WorkerInfo
from baton.services.router.directory import Directory
from proto_examples import LOAD, REGISTRATION

pytestmark = pytest.mark.unit


def info(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(registration=replace(REGISTRATION, worker_id=worker_id, role=role), load=LOAD)


class Registry:
    """Answers each lookup with the workers registered when it is released (`answer`)."""

    def __init__(self) -> None:
        self.workers: list[WorkerInfo] = []
        self.waiting: list[asyncio.Future] = []

    async def request(self, subject, message, reply_cls, timeout):
        pending = asyncio.get_running_loop().create_future()
        self.waiting.append(pending)
        return LookupReply(workers=await pending)

    def answer(self, index: int, workers: list[WorkerInfo]) -> None:
        self.waiting[index].set_result(workers)


def test_a_role_missing_from_the_view_is_looked_up_before_giving_up():
    async def run():
        registry = Registry()
        directory = Directory(registry)
        lookup = asyncio.create_task(directory.known("decode"))
        await asyncio.sleep(0)
        registry.answer(0, [info("d0", "decode")])  # registered since the view was taken
        assert [w.registration.worker_id for w in await lookup] == ["d0"]
        assert len(registry.waiting) == 1
        await directory.known("decode")  # known now: no second lookup
        assert len(registry.waiting) == 1
    asyncio.run(run())


def test_an_older_lookup_answering_late_does_not_overwrite_a_newer_view():
    async def run():
        registry = Registry()
        directory = Directory(registry)
        periodic = asyncio.create_task(directory.refresh())  # started before the decode registered
        await asyncio.sleep(0)
        on_event = asyncio.create_task(directory.refresh())  # started by its "joined" event
        await asyncio.sleep(0)
        registry.answer(1, [info("p0", "prefill"), info("d0", "decode")])
        await on_event
        registry.answer(0, [info("p0", "prefill")])
        await periodic
        assert sorted(directory.workers) == ["d0", "p0"]
    asyncio.run(run())


def test_a_worker_that_leaves_drops_out_of_the_prefix_record_at_once():
    async def run():
        registry = Registry()
        directory = Directory(registry)
        refresh = asyncio.create_task(directory.refresh())
        await asyncio.sleep(0)
        registry.answer(0, [info("p0", "prefill"), info("p1", "prefill")])
        await refresh
        prompt = list(range(64))
        directory.affinity.record(prompt, "p0")
        directory.affinity.record(list(range(100, 132)), "p1")
        assert directory.affinity.overlap(prompt + [7]) == {"p0": 64}
        refresh = asyncio.create_task(directory.refresh())  # the registry no longer lists p0
        await asyncio.sleep(0)
        registry.answer(1, [info("p1", "prefill")])
        await refresh
        assert directory.affinity.overlap(prompt + [7]) == {} and len(directory.affinity) == 2
    asyncio.run(run())
