"""The router's waiting queue end to end: real nats-server, real service processes, NIXL. Beyond
what the decode workers hold at once, requests wait (first in first out) instead of being refused,
and come out exactly as when served one at a time; a full queue answers busy (HTTP 429 with
Retry-After, naming no worker); a cancelled waiting request never reaches a worker."""
from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import CancelReply, CancelRequest, GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from baton.shared.bus.server import free_port
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import running_cluster, wait_all_free, worker_loads

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
TOK = TextTokenizer.load(DEFAULT_MODEL_DIR)


def cluster_of(worker_args: list[str], env: dict[str, str] = {}, http_port: int | None = None):
    """One prefill and one decode of the given sizes, on a nats-server of their own."""
    return running_cluster(worker_args=worker_args, env=env, http_port=http_port)


@pytest.fixture(scope="module")
def default_sized():
    """The worker sizes `baton up` uses by default (64 slots, 2048 pages per worker)."""
    with cluster_of(["--num-slots", "64", "--num-pages", "2048"]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def small():
    """Two decode slots and a queue of two, behind the HTTP frontend; yields (cluster, OpenAI base URL)."""
    port = free_port()
    with cluster_of(["--num-slots", "2", "--num-pages", "512"], {"BATON_ROUTER_MAX_QUEUED": "2"}, port) as cluster:
        yield cluster, f"http://127.0.0.1:{port}/v1"


async def router_metric(cluster, name: str) -> float:
    port = next(m["port"] for m in cluster.metrics if m["role"] == "router")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    assert values, f"the router has no metric {name}"
    return values[0]


async def until_queued(cluster, n: int) -> None:
    async with asyncio.timeout(60):
        while await router_metric(cluster, "baton_queue_depth") != n:
            await asyncio.sleep(0.05)


def same(reply: GenerateReply) -> tuple:
    """What must not depend on how the request was served: the whole reply but its id, timing, spec
    and how many prompt tokens prefill found in its prefix cache (a repeated prompt finds them)."""
    return reply.token_ids, reply.text, reply.finish_reason, msgspec.structs.replace(reply.usage, cached_tokens=0)


class Blockers:
    """Long streaming requests that hold every decode slot until `cancel()` (or the block's end)."""

    def __init__(self, bus: Bus, n: int) -> None:
        self.bus, self.ids = bus, [f"blocker-{i}" for i in range(n)]
        self.finished: list[str] = []  # ids that ended by themselves (they must not, while in use)
        self._streaming = [asyncio.Event() for _ in self.ids]
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Blockers":
        self._tasks = [asyncio.create_task(self._run(rid, ev)) for rid, ev in zip(self.ids, self._streaming)]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, request_id: str, streaming: asyncio.Event) -> None:
        prompt = heldout_prompts(TOK, 1, 16, seed=1)[0]
        request = GenerateRequest(token_ids=prompt, max_tokens=1500, ignore_eos=True, stream=True, request_id=request_id)
        async with self.bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
            async for chunk in chunks:
                streaming.set()
                if chunk.finished:
                    if chunk.finish_reason != "abort":
                        self.finished.append(request_id)
                    return

    async def streaming(self) -> None:
        async with asyncio.timeout(120):
            await asyncio.gather(*(e.wait() for e in self._streaming))

    async def cancel(self) -> None:
        for rid in self.ids:
            await self.bus.request(subjects.CANCEL, CancelRequest(request_id=rid), CancelReply, timeout=10)
        async with asyncio.timeout(60):
            await asyncio.gather(*self._tasks)


def test_200_concurrent_requests_all_succeed_queued_and_exact(default_sized):
    prompts = heldout_prompts(TOK, 20, 24, seed=24)

    async def run():
        async with await Bus.connect(default_sized.nats_url, "test-queue") as bus:
            def generate(prompt):
                return bus.request(subjects.GENERATE, GenerateRequest(token_ids=prompt, max_tokens=32), GenerateReply,
                                   timeout=600)
            alone = [await generate(p) for p in prompts]
            together = await asyncio.gather(*(generate(prompts[i % 20]) for i in range(200)))
            waited = await router_metric(default_sized, "baton_queue_wait_seconds_count")
        return alone, together, waited
    alone, together, waited = asyncio.run(run())
    assert [same(r) for r in together] == [same(alone[i % 20]) for i in range(200)]
    assert waited >= 200 - 64  # beyond the 64 decode slots, requests waited in the queue


def test_a_full_queue_answers_429_with_retry_after_and_names_no_worker(small):
    cluster, base = small
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    queued_request = GenerateRequest(prompt="To be, or not to be", max_tokens=8)

    async def run():
        async with await Bus.connect(cluster.nats_url, "test-queue") as bus, Blockers(bus, 2) as blockers:
            await blockers.streaming()
            queued = [asyncio.create_task(bus.request(subjects.GENERATE, queued_request, GenerateReply, timeout=300))
                      for _ in range(2)]
            await until_queued(cluster, 2)
            with pytest.raises(openai.RateLimitError) as http_refused:
                await client.completions.create(model="baton-tiny", prompt="Who is there?", max_tokens=4)
            with pytest.raises(BatonError) as nats_refused:
                await bus.request(subjects.GENERATE, queued_request, GenerateReply, timeout=60)
            assert blockers.finished == []  # the slots were held throughout
            await blockers.cancel()
            served = await asyncio.gather(*queued)
            alone = await bus.request(subjects.GENERATE, queued_request, GenerateReply, timeout=60)
        return http_refused.value, nats_refused.value, served, alone
    http_refused, nats_refused, served, alone = asyncio.run(run())
    assert http_refused.status_code == 429 and http_refused.response.headers["Retry-After"] == "1"
    assert nats_refused.code is ErrorCode.BUSY and "queue is full" in nats_refused.message
    workers = asyncio.run(worker_loads(cluster.nats_url))
    assert not any(w in str(http_refused.body) or w in nats_refused.message for w in workers)
    assert [same(r) for r in served] == [same(alone)] * 2


def test_a_cancelled_queued_request_never_reaches_a_worker(small):
    cluster, _ = small

    async def run():
        before = await wait_all_free(cluster.nats_url)
        async with await Bus.connect(cluster.nats_url, "test-queue") as bus, Blockers(bus, 2) as blockers:
            await blockers.streaming()
            request = GenerateRequest(prompt="To be, or not to be", max_tokens=8, request_id="queued-then-cancelled")
            waiting = asyncio.create_task(bus.request(subjects.GENERATE, request, GenerateReply, timeout=300))
            await until_queued(cluster, 1)
            cancel = await bus.request(subjects.CANCEL, CancelRequest(request_id=request.request_id), CancelReply,
                                       timeout=10)
            reply = await asyncio.wait_for(waiting, 10)
            assert await router_metric(cluster, "baton_queue_depth") == 0
            await blockers.cancel()
        after = await wait_all_free(cluster.nats_url, min_requests=requests_total(before, "decode") + 2)
        return before, after, cancel, reply
    before, after, cancel, reply = asyncio.run(run())
    assert cancel.cancelled and (reply.finish_reason, reply.token_ids, reply.text) == ("abort", [], "")
    for role in ("prefill", "decode"):  # the two blockers, and nothing more
        assert requests_total(after, role) == requests_total(before, role) + 2, role


def requests_total(loads: dict, role: str) -> int:
    return sum(v[6] for v in loads.values() if v[0] == role)
