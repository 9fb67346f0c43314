"""Trust in the control plane, with real processes (issue 31): the registry holds a bounded number
of JetStream consumers, refuses a second live instance of a worker id, and does not declare the
living dead after its own pause."""
import asyncio

import pytest

from baton.proto import subjects
from baton.services.registry.service import BUCKET
from baton.shared.bus import Bus
from e2e_cluster import running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


async def consumers(bus: Bus) -> int:
    return (await bus.connection.jetstream().stream_info(f"KV_{BUCKET}")).state.consumer_count


async def seen(bus: Bus, subject: str, count: int) -> asyncio.Event:
    """Set once `count` messages were published on `subject` (watched, not answered)."""
    done, n = asyncio.Event(), 0

    async def on_message(msg) -> None:
        nonlocal n
        n += 1
        if n >= count:
            done.set()
    await bus.subscribe(subject, on_message)
    return done


def test_an_idle_cluster_keeps_the_consumer_count_flat():
    """The router's refreshes and the workers' health probes look the registry up several times a
    second; each lookup used to leave a JetStream consumer behind for 5 minutes."""
    with running_cluster(prefill=1, decode=1, warm_up=False) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                before = await consumers(bus)
                lookups = await seen(bus, subjects.LOOKUP, 60)
                await asyncio.wait_for(lookups.wait(), 120)
                after = await consumers(bus)
                print(f"consumers on the workers' bucket: {before} before, {after} after 60 lookups")
                assert after <= before <= 1
        asyncio.run(run())
