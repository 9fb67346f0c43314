"""The router's view of the cluster (pure logic: the registry's lookup answers are fed by hand)."""
import asyncio

import msgspec
import pytest

from baton.proto import subjects
from baton.proto.codec import encode
from baton.proto.internal import CachedPrefix, LookupReply, PrefixEvents, WorkerInfo
from baton.services.router.directory import Directory
from baton.shared.kv.prefix_hash import digests
from proto_examples import LOAD, REGISTRATION

pytestmark = pytest.mark.unit


def info(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(registration=msgspec.structs.replace(REGISTRATION, worker_id=worker_id, role=role), load=LOAD)


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


def test_a_worker_that_leaves_drops_out_of_the_prefix_index_at_once():
    async def run():
        registry = Registry()
        directory = Directory(registry)
        refresh = asyncio.create_task(directory.refresh())
        await asyncio.sleep(0)
        registry.answer(0, [info("p0", "prefill"), info("p1", "prefill")])
        await refresh
        prompt = list(range(64))
        for worker, held in (("p0", prompt), ("p1", list(range(100, 132)))):
            directory.affinity.apply(snapshot(worker, [held]))
        assert directory.affinity.overlap(prompt + [7]) == {"p0": 64}
        refresh = asyncio.create_task(directory.refresh())  # the registry no longer lists p0
        await asyncio.sleep(0)
        registry.answer(1, [info("p1", "prefill")])
        await refresh
        assert directory.affinity.overlap(prompt + [7]) == {} and len(directory.affinity) == 1
    asyncio.run(run())


def snapshot(worker: str, held: list[list[int]], seq: int = 1) -> PrefixEvents:
    return PrefixEvents(worker_id=worker, instance_id=REGISTRATION.instance_id, seq=seq, block=16, snapshot=True,
                        added=[CachedPrefix(blocks=len(p) // 16, digest=digests(p, 16)[-1], tokens=len(p))
                               for p in held])


class Msg:
    def __init__(self, message) -> None:
        self.data = encode(message)


def test_prefix_events_with_a_gap_make_the_next_refresh_ask_that_worker_for_a_snapshot():
    async def run():
        asked: list[str] = []
        prompt = list(range(64))

        class Bus:
            async def request(self, subject, message, reply_cls, timeout):
                if reply_cls is LookupReply:
                    return LookupReply(workers=[info("p0", "prefill")])
                asked.append(subject)
                return snapshot("p0", [prompt], seq=9)
        directory = Directory(Bus())
        await directory.refresh()
        await directory.sync_prefixes()  # never seen: asked at once
        assert asked == [subjects.prefill_prefixes("p0")] and directory.affinity.overlap(prompt + [1]) == {"p0": 64}
        await directory.sync_prefixes()
        assert len(asked) == 1  # known and current: not asked again
        await directory._on_prefix_events(Msg(PrefixEvents(worker_id="p0", instance_id=REGISTRATION.instance_id,
                                                           seq=11, block=16)))  # 10 went missing
        await directory.sync_prefixes()
        assert len(asked) == 2
        await directory._on_prefix_events(Msg(PrefixEvents(worker_id="p9", instance_id="x", seq=1, block=16)))
        await directory.sync_prefixes()
        assert len(asked) == 2  # a worker the registry does not list is not asked
    asyncio.run(run())
