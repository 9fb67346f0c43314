"""The aggregated baseline: one process serving the public API with prefill and decode together.
Greedy tokens equal `transformers` (and so the disaggregated system) with requests arriving while
others decode; the router's handling (stream chunks, stop strings, cancel, errors) is the same;
every KV page and slot comes back."""
import argparse
import asyncio
import contextlib

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import CancelReply, CancelRequest, GenerateReply, GenerateRequest, SpecStats, StreamChunk
from baton.services.aggregated.service import AggregatedService, close_service, open_service
from baton.services.worker import WorkerConfig
from baton.shared.bus import Bus, NatsServer
from baton.shared.config import WorkerSection
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import Reference, done_within, until, window_prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nats_url():
    with NatsServer(jetstream=False) as server:  # its own server: no router shares the queue group
        yield server.url


@pytest.fixture(scope="module")
def reference():
    return Reference()


@contextlib.asynccontextmanager
async def aggregated(url: str, **worker):
    """The service in-process (its own bus) and a client bus; yields (client, engine). `worker`:
    [worker] settings."""
    config = WorkerConfig("aggregated", worker=WorkerSection(threads=1, **worker))
    service = await open_service(await Bus.connect(url, "aggregated"), config)
    client = await Bus.connect(url, "test-client")
    try:
        yield client, service.engine
    finally:
        await client.close()
        await close_service(service)


async def assert_all_free(engine, timeout_s: float = 10.0) -> None:
    """Until the engine holds no request and every slot and page is free (replies can reach the
    client just before the engine frees the request), then the store's integrity check."""
    store, deadline = engine.store, asyncio.get_running_loop().time() + timeout_s
    while True:
        free = store.free_capacity()
        idle = not engine.running and not engine.waiting
        if idle and free.slots == engine.worker.num_slots and free.pages == engine.worker.num_pages:
            break
        assert asyncio.get_running_loop().time() < deadline, (free, engine.running, engine.waiting)
        await asyncio.sleep(0.02)
    store.check_integrity()


async def stream(client, **fields) -> tuple[list[int], str, StreamChunk]:
    ids, text, last = [], "", None
    async with client.stream_request(subjects.GENERATE, GenerateRequest(stream=True, **fields), StreamChunk,
                                     timeout_per_message=120) as chunks:
        async for chunk in chunks:
            ids += chunk.token_ids
            text += chunk.text
            last = chunk
    return ids, text, last


@pytest.mark.parametrize("spec", ["mtp", "off"])
def test_greedy_equals_transformers_with_staggered_arrivals(nats_url, reference, spec):
    """Requests arrive while others decode (continuous batching: prefill between decode steps)."""
    async def run():
        async with aggregated(nats_url, spec=spec) as (client, engine):
            async def one(delay: float, p: list[int]):
                await asyncio.sleep(delay)  # the arrival schedule itself: staggered, not a wait for anything
                return await client.request(subjects.GENERATE, GenerateRequest(token_ids=p, max_tokens=40),
                                            GenerateReply, timeout=300)
            replies = await asyncio.gather(*(one(0.15 * i, p) for i, p in enumerate(window_prompts())))
            await assert_all_free(engine)
            return replies
    replies = asyncio.run(run())
    for p, reply in zip(window_prompts(), replies):
        want = reference.greedy(p, 40)
        assert reply.token_ids == want, reference.explain(p, reply.token_ids, want)
        assert reply.usage.prompt_tokens == len(p) and reply.usage.completion_tokens == len(want)
        if spec == "mtp":
            assert reply.spec.verify_steps > 0 and 0 < reply.spec.accepted <= reply.spec.drafted
        else:
            assert reply.spec.verify_steps == reply.spec.drafted == 0


@pytest.mark.parametrize("draft_state", ["rebuild", "cold"])
def test_other_draft_states_are_lossless_too(nats_url, reference, draft_state):
    p = window_prompts()[2]
    async def run():
        async with aggregated(nats_url, draft_state=draft_state) as (client, engine):
            return await client.request(subjects.GENERATE, GenerateRequest(token_ids=p, max_tokens=24),
                                        GenerateReply, timeout=300)
    assert asyncio.run(run()).token_ids == reference.greedy(p, 24)


def test_draft_tokens_lowers_speculation_per_request_without_changing_tokens(nats_url, reference):
    p = window_prompts()[2]
    caps = [None, 0, 1]

    async def run():
        async with aggregated(nats_url) as (client, engine):
            replies = await asyncio.gather(*(client.request(subjects.GENERATE, GenerateRequest(
                token_ids=p, max_tokens=24, draft_tokens=cap), GenerateReply, timeout=300) for cap in caps))
            await assert_all_free(engine)
            return replies
    default, zero, one = asyncio.run(run())
    assert default.token_ids == zero.token_ids == one.token_ids == reference.greedy(p, 24)
    assert zero.spec == SpecStats()
    assert one.spec.drafted == one.spec.verify_steps > 0
    assert default.spec.drafted == WorkerSection().draft_tokens * default.spec.verify_steps > 0


def test_stream_equals_unary_and_stop_strings_apply(nats_url):
    async def run():
        async with aggregated(nats_url) as (client, engine):
            unary = await client.request(subjects.GENERATE, GenerateRequest(prompt="To be, or not to be", max_tokens=24),
                                         GenerateReply, timeout=120)
            streamed = await stream(client, prompt="To be, or not to be", max_tokens=24)
            stopped = await stream(client, prompt="To be, or not to be", max_tokens=24, stop=[" have"])
            await assert_all_free(engine)
            return unary, streamed, stopped
    unary, (ids, text, last), (_, stop_text, stop_last) = asyncio.run(run())
    assert ids == unary.token_ids and text == unary.text
    assert last.finished and last.finish_reason == unary.finish_reason and last.usage == unary.usage
    assert unary.text.find(" have") >= 0, "the stop string should occur in the unstopped text"
    assert stop_last.finish_reason == "stop" and stop_text == unary.text[:unary.text.find(" have")]


def test_cancel_mid_stream_frees_everything(nats_url):
    async def run():
        async with aggregated(nats_url) as (client, engine):
            request = GenerateRequest(token_ids=window_prompts()[2], max_tokens=2000, ignore_eos=True, stream=True,
                                      request_id="agg-cancel-1")  # seconds of decoding: the cancel comes first
            got = []
            async with client.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
                async for chunk in chunks:
                    got.append(chunk)
                    if len(got) == 3:
                        reply = await client.request(subjects.CANCEL, CancelRequest(request_id="agg-cancel-1"),
                                                     CancelReply)
                        assert reply.cancelled
            await assert_all_free(engine)
            unknown = await client.request(subjects.CANCEL, CancelRequest(request_id="never-was"), CancelReply,
                                           timeout=5)
            return got, unknown
    got, unknown = asyncio.run(run())
    assert got[-1].finished and got[-1].finish_reason == "abort" and got[-1].usage.completion_tokens < 2000
    assert not unknown.cancelled


def test_full_engine_answers_busy_and_recovers(nats_url):
    async def run():
        async with aggregated(nats_url, num_slots=1) as (client, engine):
            long = asyncio.create_task(stream(client, token_ids=window_prompts()[0], max_tokens=2000, ignore_eos=True,
                                              request_id="agg-long"))  # seconds of decoding: it holds the slot
            await until(lambda: engine.running, 60, "the long request running", every_s=0.01)
            with pytest.raises(BatonError) as info:
                await client.request(subjects.GENERATE, GenerateRequest(prompt="hello", max_tokens=4),
                                     GenerateReply, timeout=30)
            assert (await client.request(subjects.CANCEL, CancelRequest(request_id="agg-long"), CancelReply)).cancelled
            assert (await long)[2].finish_reason == "abort"
            after = await client.request(subjects.GENERATE, GenerateRequest(prompt="hello", max_tokens=4),
                                         GenerateReply, timeout=30)
            await assert_all_free(engine)
            return info.value, after
    error, after = asyncio.run(run())
    assert error.code.value == "busy"
    assert after.usage.completion_tokens == 4


@pytest.mark.parametrize("fields,code", [
    (dict(token_ids=[5, 999999], max_tokens=4), "bad_request"),
    (dict(prompt="hi", max_tokens=0), "bad_request"),
    (dict(token_ids=list(range(1000)) * 3, max_tokens=4000), "bad_request"),  # beyond the model's context
])
def test_bad_input_gets_the_routers_error_codes(nats_url, fields, code):
    import msgpack
    async def run():
        async with aggregated(nats_url) as (client, engine):
            msg = await client.connection.request(subjects.GENERATE, msgpack.packb({"v": 1, **fields}), timeout=30)
            ok = await client.request(subjects.GENERATE, GenerateRequest(prompt="still serving", max_tokens=3),
                                      GenerateReply, timeout=30)
            return msgpack.unpackb(msg.data), ok
    reply, ok = asyncio.run(run())
    assert reply["error"]["code"] == code, reply
    assert ok.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(nats_url):
    async def run():
        async with aggregated(nats_url) as (client, engine):
            req = GenerateRequest(prompt="To be, or not to be", max_tokens=24, temperature=0.9, seed=1234)
            a = await client.request(subjects.GENERATE, req, GenerateReply, timeout=60)
            b = await client.request(subjects.GENERATE, req, GenerateReply, timeout=60)
            return a, b
    a, b = asyncio.run(run())
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_config_from_serve_options():
    from baton.services.aggregated.__main__ import add_arguments, worker_config
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    w = worker_config(parser.parse_args(["--spec", "off", "--kv-mode", "paged", "--num-slots", "8",
                                         "--draft-tokens", "2", "--threads", "1"])).worker
    assert (w.spec, w.kv_mode, w.num_slots, w.draft_tokens, w.threads) == ("off", "paged", 8, 2, 1)
    from baton.shared import config as settings  # the typed config `baton serve` builds
    typed = WorkerConfig.of("aggregated", settings.load(None, flags={"worker.num_slots": 8, "worker.spec": "off"}))
    assert (typed.worker.num_slots, typed.worker.spec, typed.model) == (8, "off", DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError):
        WorkerConfig("aggregated", worker=WorkerSection(draft_state="teleport"))


def test_serve_entry_takes_serve_options_and_stops_cleanly(nats_url, monkeypatch):
    """`serve(stop, bus, config)` as `python -m baton.services.aggregated` calls it: the config
    from its options (unset ones default), a request in flight when stop is set still completes."""
    from baton.services.aggregated.__main__ import add_arguments, worker_config
    from baton.services.aggregated.service import serve
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = worker_config(parser.parse_args(["--spec", "off", "--num-pages", "256", "--num-slots", "4",
                                              "--threads", "1"]))

    opened = asyncio.Event()  # the service opened the request's flow: it is in flight
    open_flow = AggregatedService._open_flow

    async def opening(self, *flow_args):
        flow = await open_flow(self, *flow_args)
        opened.set()
        return flow
    monkeypatch.setattr(AggregatedService, "_open_flow", opening)

    async def run():
        stop = asyncio.Event()
        bus = await Bus.connect(nats_url, "aggregated-serve")
        task = asyncio.create_task(serve(stop, bus, config))
        client = await Bus.connect(nats_url, "test-client")
        try:
            await until(lambda: bus.endpoints, 300, "the service serving", every_s=0.02)
            pending = asyncio.create_task(client.request(
                subjects.GENERATE, GenerateRequest(token_ids=window_prompts()[0], max_tokens=64), GenerateReply, timeout=60))
            await done_within(opened.wait(), 30, "the request in flight in the service")
            assert not pending.done()
            stop.set()
            reply = await pending
            await asyncio.wait_for(task, 30)
            return reply, bus.connection.is_closed
        finally:
            await client.close()
    reply, closed = asyncio.run(run())
    assert reply.usage.completion_tokens == 64 and reply.spec.verify_steps == 0 and closed


def test_min_tokens_passes_early_stop_tokens_and_stop_strings(nats_url):
    """Through the router's handling: a stop token among the first min_tokens is generated past
    (kept in token_ids, no text), the next one stops; a stop string inside them is not matched."""
    prompt = "To be, or not to be"

    async def run():
        async with aggregated(nats_url) as (client, engine):
            def ask(**fields):
                return client.request(subjects.GENERATE, GenerateRequest(prompt=prompt, max_tokens=24, **fields),
                                      GenerateReply, timeout=120)
            free = await ask()
            by_token = await ask(stop_token_ids=[free.token_ids[0]], min_tokens=1)
            by_text = await ask(stop=[free.text[:3]], min_tokens=24)
            streamed = await stream(client, prompt=prompt, max_tokens=24, stop=[free.text[:3]], min_tokens=24)
            await assert_all_free(engine)
            return free, by_token, by_text, streamed
    free, by_token, by_text, (ids, text, last) = asyncio.run(run())
    stop_id, tok = free.token_ids[0], TextTokenizer.load(DEFAULT_MODEL_DIR)
    end = next((j + 1 for j, t in enumerate(free.token_ids) if t == stop_id and j > 0), None)
    want = free.token_ids[:end]
    assert (by_token.token_ids, by_token.finish_reason) == (want, "stop" if end else free.finish_reason)
    assert by_token.text == tok.decode([t for t in want if t not in (stop_id, tok.eos_token_id)])
    assert (by_text.token_ids, by_text.text, by_text.finish_reason) == (free.token_ids, free.text, free.finish_reason)
    assert (ids, text, last.finish_reason) == (free.token_ids, free.text, free.finish_reason)
