"""A queue group spreads requests over its members."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from baton.proto.public import CancelReply, CancelRequest
from baton.shared.bus import Bus

pytestmark = pytest.mark.integration


def test_queue_group_spreads_load(nats_server):
    async def scenario(url):
        served = Counter()
        members = [await Bus.connect(url, f"router-{i}") for i in range(3)]
        for i, member in enumerate(members):
            async def handler(request, member_id=i):
                served[member_id] += 1
                return CancelReply(request_id=request.request_id, cancelled=True)

            await member.serve("test.queue.generate", CancelRequest, handler, queue="routers")
        async with await Bus.connect(url, "client") as client:
            replies = await asyncio.gather(*(
                client.request("test.queue.generate", CancelRequest(request_id=f"r{n}"), CancelReply, timeout=2)
                for n in range(90)))
        assert [r.request_id for r in replies] == [f"r{n}" for n in range(90)]
        assert sum(served.values()) == 90  # each request handled once
        assert len(served) == 3 and min(served.values()) >= 10  # random spread, every member busy
        for member in members:
            await member.close()
    asyncio.run(asyncio.wait_for(scenario(nats_server), 10))
