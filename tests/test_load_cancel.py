"""Load with random cancellations: every request gets exactly one answer (a reply or an error code),
nothing leaks, and the client's counts reconcile with the router's metrics.

    BATON_LOAD_REQUESTS=200 BATON_LOAD_CONCURRENCY=16 pytest tests/test_load_cancel.py   # a quicker run
"""
import asyncio
import collections
import os
import random

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import CancelReply, CancelRequest, GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import running_cluster, wait_all_free
from test_e2e_generate import scrape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]
REQUESTS = int(os.environ.get("BATON_LOAD_REQUESTS", "2000"))
CONCURRENCY = int(os.environ.get("BATON_LOAD_CONCURRENCY", "64"))


async def drive(url: str, prompts: list[list[int]]) -> collections.Counter:
    rng = random.Random(0)
    bus = await Bus.connect(url, "load")
    gate = asyncio.Semaphore(CONCURRENCY)
    outcomes: collections.Counter = collections.Counter()

    async def one(i: int) -> None:
        async with gate:
            rid = f"load-{i}"
            request = GenerateRequest(token_ids=rng.choice(prompts), max_tokens=rng.randint(1, 16), request_id=rid)
            call = asyncio.create_task(bus.request(subjects.GENERATE, request, GenerateReply, timeout=300))
            if rng.random() < 0.25:
                await asyncio.sleep(rng.random() * 0.2)  # a random moment to cancel at: the load's design
                await bus.request(subjects.CANCEL, CancelRequest(request_id=rid), CancelReply, timeout=10)
            try:
                outcomes[(await call).finish_reason] += 1
            except BatonError as exc:
                outcomes[exc.code.value] += 1
    try:
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    finally:
        await bus.close()
    return outcomes


def test_load_with_random_cancellations_loses_and_leaks_nothing():
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    prompts = [p for n in (5, 40, 90, 200) for p in heldout_prompts(tok, 4, n, seed=n)]
    with running_cluster(prefill=1, decode=1) as cluster:
        router = next(m["port"] for m in cluster.metrics if m["role"] == "router")
        before = scrape(router)
        outcomes = asyncio.run(drive(cluster.nats_url, prompts))
        asyncio.run(wait_all_free(cluster.nats_url, timeout_s=30))
        after = scrape(router)
    print(f"{REQUESTS} requests at concurrency {CONCURRENCY}: {dict(outcomes)}")
    assert sum(outcomes.values()) == REQUESTS, outcomes  # zero lost: one answer per request
    assert set(outcomes) <= {"length", "stop", "abort", "busy"}, outcomes  # no timeouts, no internal errors
    assert outcomes["abort"] > 0 and outcomes["length"] + outcomes["stop"] > 0, outcomes
    for outcome, n in outcomes.items():  # the router counted exactly what the client saw
        key = f"baton_requests_total[('outcome', '{outcome}')]"
        if outcome != "busy" or key in after:
            assert after.get(key, 0) - before.get(key, 0) == n, (outcome, n, after.get(key))
