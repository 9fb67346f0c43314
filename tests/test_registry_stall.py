"""The registry tells a stalled worker from a dead one (issue 25): past its lease, a worker whose
subscriptions nats-server still holds (a paused process keeps its connection) stays registered
for `stall_grace_s` more; one that holds none is dropped at once."""
import asyncio

import pytest

from baton.proto import subjects
from baton.proto.internal import HeartbeatReply, RegisterReply
from baton.services.registry.service import RegistryConfig
from test_registry import beat, close_workers, events, registered, registration, registry  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CONFIG = RegistryConfig(lease_s=0.5, sweep_s=0.05, stall_grace_s=3.0, probe_s=0.1)


async def never_answer(msg) -> None:
    """A worker's subscription while its process is stopped: messages reach it, nothing answers."""


async def left(seen: asyncio.Queue, worker_id: str):
    while (event := await asyncio.wait_for(seen.get(), 30)).kind != "left" or event.worker_id != worker_id:
        pass
    return event


def test_a_stalled_worker_outlives_its_lease_and_a_gone_one_does_not():
    async def run():
        async with registry(CONFIG) as (reg, bus):
            seen = await events(bus)
            stalled = await bus.subscribe(subjects.decode_release("decode-stalled"), never_answer)
            for worker_id in ("decode-stalled", "decode-gone"):
                await bus.request(subjects.REGISTER, registration(worker_id), RegisterReply)
            assert (await left(seen, "decode-gone")).reason == "lease expired"
            assert [w for w, _ in await registered(bus)] == ["decode-stalled"]
            # it comes back within the grace: the same instance beats on as if nothing happened
            assert (await bus.request(subjects.HEARTBEAT, beat("decode-stalled"), HeartbeatReply)).registered
            # silent again, and now gone from NATS too: dropped without waiting for the grace
            await stalled.unsubscribe()
            assert (await left(seen, "decode-stalled")).reason == "lease expired"
    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_worker_stalled_past_the_grace_is_dropped():
    async def run():
        async with registry(CONFIG) as (reg, bus):
            seen = await events(bus)
            await bus.subscribe(subjects.decode_release("decode-stuck"), never_answer)
            await bus.request(subjects.REGISTER, registration("decode-stuck"), RegisterReply)
            assert (await left(seen, "decode-stuck")).reason == "lease expired"
            assert await registered(bus) == []
    asyncio.run(asyncio.wait_for(run(), 60))
