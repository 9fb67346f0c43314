"""End to end: real nats-server, separate service processes, real NIXL. Greedy output equals
`transformers` generate token for token (with penalties too); logprobs equal its log-softmax;
streaming equals non-streaming; cancel frees everything; bad input gets the right error code and
the services keep serving."""
import asyncio
import json
import time
from pathlib import Path

import msgpack
import pytest
import torch

from baton import cli
from baton.proto import subjects
from baton.proto.codec import decode as decode_message
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import WriteStarting
from baton.proto.public import (CancelReply, CancelRequest, GenerateReply, GenerateRequest, Logprobs, SpecStats,
                                StreamChunk)
from baton.shared.bus import Bus
from baton.shared.config import WorkerSection
from e2e_cluster import Reference, running_cluster, until, wait_all_free, window_prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(nats_server):
    # prefill batches of at most 96 prompt tokens: of window_prompts() (32, 64 and 261 tokens) sent
    # together, the 261-token one always runs alone (over the bound); every output stays exact
    with running_cluster(nats_server, worker_args=["--prefill-batch-tokens", "96"]) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return Reference()


async def generate(url: str, **fields) -> GenerateReply:
    async with await Bus.connect(url, "test") as bus:
        return await bus.request(subjects.GENERATE, GenerateRequest(**fields), GenerateReply, timeout=300)


def test_greedy_equals_transformers_concurrently(cluster, reference):
    async def run():
        return await asyncio.gather(*(generate(cluster.nats_url, token_ids=p, max_tokens=40) for p in window_prompts()))
    replies = asyncio.run(run())
    for p, reply in zip(window_prompts(), replies):
        want = reference.greedy(p, 40)
        assert reply.token_ids == want, reference.explain(p, reply.token_ids, want)
        assert reply.usage.prompt_tokens == len(p) and reply.usage.completion_tokens == len(want)
        assert reply.spec.verify_steps > 0 and reply.spec.accepted <= reply.spec.drafted
    asyncio.run(wait_all_free(cluster.nats_url))


def test_draft_tokens_lowers_speculation_per_request_without_changing_tokens(cluster, reference):
    """The deployment drafts its default K; requests batched together on decode ask for 0, 1, the
    default and more than K (which counts as K): same greedy tokens, different speculation."""
    p = window_prompts()[2]
    caps = [None, 0, 1, 9]

    async def run():
        return await asyncio.gather(*(generate(cluster.nats_url, token_ids=p, max_tokens=32, draft_tokens=cap)
                                      for cap in caps))
    default, zero, one, above = asyncio.run(run())
    want = reference.greedy(p, 32)
    for cap, reply in zip(caps, (default, zero, one, above)):
        assert reply.token_ids == want, (cap, reference.explain(p, reply.token_ids, want))
    assert zero.spec == SpecStats()  # no speculation: every counter zero
    assert one.spec.drafted == one.spec.verify_steps > 0
    K = WorkerSection().draft_tokens
    assert default.spec.drafted == K * default.spec.verify_steps > 0
    assert above.spec.drafted == K * above.spec.verify_steps > 0
    asyncio.run(wait_all_free(cluster.nats_url))


def test_stream_equals_unary_and_text_prompts_work(cluster):
    async def run():
        unary = await generate(cluster.nats_url, prompt="To be, or not to be", max_tokens=24)
        bus = await Bus.connect(cluster.nats_url, "test")
        ids, text, last = [], "", None
        try:
            async with bus.stream_request(subjects.GENERATE, GenerateRequest(prompt="To be, or not to be",
                                          max_tokens=24, stream=True), StreamChunk, timeout_per_message=120) as chunks:
                async for chunk in chunks:
                    ids += chunk.token_ids
                    text += chunk.text
                    last = chunk
        finally:
            await bus.close()
        return unary, ids, text, last
    unary, ids, text, last = asyncio.run(run())
    assert ids == unary.token_ids and text == unary.text
    assert last.finished and last.finish_reason == unary.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_baton_generate_prints_the_reply_as_json(cluster, capsys, stream):
    """`baton generate --json` (and with --stream, one JSON object per chunk): the whole reply
    as the protocol has it, the same tokens streamed or not."""
    assert cli.main(["generate", "To be, or not to be", "--max-tokens", "6", "--json", "--nats-url", cluster.nats_url,
                     *(["--stream"] if stream else [])]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    last = objects[-1]
    assert last["finish_reason"] in ("length", "stop") and last["usage"]["completion_tokens"] == len(
        [t for o in objects for t in o["token_ids"]]) and last["spec"]["verify_steps"] >= 1
    assert len(objects) == 1 or (stream and all(not o["finished"] for o in objects[:-1]) and last["finished"])


def test_cancel_mid_stream_frees_everything(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            request = GenerateRequest(token_ids=window_prompts()[2], max_tokens=2000, ignore_eos=True, stream=True,
                                      request_id="cancel-me-1")  # seconds of decoding: the cancel comes first
            got = []
            async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
                async for chunk in chunks:
                    got.append(chunk)
                    if len(got) == 3:
                        reply = await bus.request(subjects.CANCEL, CancelRequest(request_id="cancel-me-1"), CancelReply)
                        assert reply.cancelled
            assert got[-1].finished and got[-1].finish_reason == "abort"
            assert got[-1].usage.completion_tokens < 2000
        await wait_all_free(cluster.nats_url)
    asyncio.run(run())


@pytest.mark.parametrize("payload,code", [
    (msgpack.packb({"v": 1, "token_ids": [5, 999999], "max_tokens": 4}), "bad_request"),
    (msgpack.packb({"v": 1, "prompt": "hi", "max_tokens": 0}), "bad_request"),
    (msgpack.packb({"v": 1, "prompt": "hi", "max_tokens": 10**9}), "bad_request"),
    (msgpack.packb({"v": 1, "prompt": "hi", "draft_tokens": 17}), "bad_request"),
    (msgpack.packb({"v": 1, "prompt": "hi", "draft_tokens": -1}), "bad_request"),
    (msgpack.packb({"v": 1, "max_tokens": 4}), "bad_request"),
    (b"\xc1 not msgpack", "bad_request"),
    (msgpack.packb({"v": 2, "prompt": "hi"}), "bad_request"),
    (msgpack.packb({"v": 1, "token_ids": list(range(1000)) * 3, "max_tokens": 4000}), "bad_request"),  # > context
])
def test_bad_input_gets_error_code(cluster, payload, code):
    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            msg = await bus.connection.request(subjects.GENERATE, payload, timeout=30)
            return msgpack.unpackb(msg.data)
    reply = asyncio.run(run())
    assert reply["error"]["code"] == code, reply


def test_oversized_request_is_refused_before_sending(cluster):
    async def run():
        with pytest.raises(BatonError) as info:
            await generate(cluster.nats_url, prompt="x" * (2 << 20), max_tokens=4)
        return info.value
    assert asyncio.run(run()).code.value == "too_large"
    assert asyncio.run(generate(cluster.nats_url, prompt="still serving", max_tokens=4)).finish_reason in ("length", "stop")


def scrape(port: int) -> dict[str, float]:
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_service_exposes_metrics_that_move(cluster):
    before = {m["role"]: scrape(m["port"]) for m in cluster.metrics}
    reply = asyncio.run(generate(cluster.nats_url, prompt="Metrics, my lord", max_tokens=12))
    asyncio.run(wait_all_free(cluster.nats_url))  # a heartbeat later, gauges are current too
    after = {m["role"]: scrape(m["port"]) for m in cluster.metrics}
    assert set(after) == {"registry", "router", "prefill", "decode"}
    outcome = f"baton_requests_total[('outcome', '{reply.finish_reason}')]"
    assert after["router"][outcome] == before["router"].get(outcome, 0) + 1
    assert after["router"]["baton_ttft_seconds_count"] > before["router"]["baton_ttft_seconds_count"]
    assert after["prefill"]["baton_transfer_bytes_total"] > before["prefill"]["baton_transfer_bytes_total"]
    assert after["decode"]["baton_generated_tokens_total"] >= before["decode"]["baton_generated_tokens_total"] + 11
    assert after["decode"]["baton_spec_verify_steps_total"] > before["decode"]["baton_spec_verify_steps_total"]
    assert after["decode"]["baton_free_slots"] == 16 and after["registry"]["baton_workers[('role', 'decode')]"] == 1


def test_client_that_stops_listening_is_cancelled(cluster):
    """A streaming client that unsubscribes mid-stream: the router notices (NATS answers the
    chunks' probe with "no responders"), cancels the request and everything is freed long before
    the 4,000 tokens it asked for would have been generated."""
    router = next(m["port"] for m in cluster.metrics if m["role"] == "router")
    before = scrape(router).get("baton_requests_total[('outcome', 'disconnected')]", 0)

    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            stream = bus.stream_request(subjects.GENERATE, GenerateRequest(token_ids=window_prompts()[0], max_tokens=4000,
                                                                           stream=True), StreamChunk, 60)
            async for _ in stream:
                break  # one chunk, then stop listening
            await stream.close()
            await until(noticed, 30, "the router noticing the client leave (its chunks' probe finds no one)",
                        every_s=0.05)
        await wait_all_free(cluster.nats_url, timeout_s=10)

    def disconnected() -> float:
        return scrape(router).get("baton_requests_total[('outcome', 'disconnected')]", 0)

    async def noticed() -> bool:
        return disconnected() != before
    asyncio.run(run())
    assert disconnected() == before + 1
    later = asyncio.run(generate(cluster.nats_url, token_ids=window_prompts()[1], max_tokens=12))
    want = Reference().greedy(window_prompts()[1], 12)
    assert (later.token_ids, later.finish_reason) == (want, "length" if len(want) == 12 else "stop")


def test_a_stop_token_ends_the_reply_without_its_text(cluster):
    """`stop_token_ids` (and end of text, the same path) end the reply on that token: its id is
    reported, its text is not, unary or streamed (as vLLM)."""
    from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
    from baton.shared.model.tokenizer import TextTokenizer
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)

    async def run():
        free = await generate(cluster.nats_url, prompt="To be, or not to be", max_tokens=24)
        ids = free.token_ids
        i = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
        stopped = await generate(cluster.nats_url, prompt="To be, or not to be", max_tokens=24,
                                 stop_token_ids=[ids[i]])
        pieces = []
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            request = GenerateRequest(prompt="To be, or not to be", max_tokens=24, stop_token_ids=[ids[i]], stream=True)
            async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
                pieces = [chunk.text async for chunk in chunks]
        return ids[:i + 1], tok.decode(ids[:i]), stopped, pieces
    want_ids, want_text, stopped, pieces = asyncio.run(run())
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == (want_ids, want_text, "stop")
    assert "".join(pieces) == want_text


def test_a_reply_ended_by_a_stop_string_reports_its_speculation(cluster):
    """The router ends the request when a stop string matches; decode's counts still come back."""
    async def run():
        free = await generate(cluster.nats_url, prompt="To be, or not to be", max_tokens=48)
        stop = free.text[len(free.text) // 2:][:5]
        return await generate(cluster.nats_url, prompt="To be, or not to be", max_tokens=48, stop=[stop]), stop
    stopped, stop = asyncio.run(run())
    assert stopped.finish_reason == "stop" and stop not in stopped.text and stopped.usage.completion_tokens > 1
    spec = stopped.spec  # every token after the first (prefill's) came from a verify step
    assert spec.drafted == WorkerSection().draft_tokens * spec.verify_steps and spec.accepted + spec.verify_steps >= stopped.usage.completion_tokens - 1


def test_ignore_eos_runs_every_request_to_max_tokens(cluster):
    """What aiperf asks with `--extra-inputs ignore_eos:true`: sampled requests never end early."""
    async def run():
        return await asyncio.gather(*(generate(cluster.nats_url, prompt="To be, or not to be", max_tokens=64,
                                               temperature=1.5, seed=seed, ignore_eos=True) for seed in range(8)))
    for reply in asyncio.run(run()):
        assert (len(reply.token_ids), reply.usage.completion_tokens, reply.finish_reason) == (64, 64, "length")


def test_prompts_far_over_the_context_are_refused_untokenized_while_others_are_served(cluster):
    """64 prompts at the character limit (each ~100k tokens) against a small request sent among
    them: each huge one is refused as too_large by the cheap bound (no tokenizing), and
    the small one is answered exactly as when it runs alone."""
    huge = ("To be, or not to be, that is the question. " * 12_000)[:1 << 19]
    small = dict(prompt="Good morrow, my lord.", max_tokens=8)

    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            async def refused() -> BatonError:
                with pytest.raises(BatonError) as info:
                    await bus.request(subjects.GENERATE, GenerateRequest(prompt=huge, max_tokens=4), GenerateReply,
                                      timeout=60)
                return info.value
            started = asyncio.get_running_loop().time()
            *errors, reply = await asyncio.gather(*(refused() for _ in range(64)),
                                                  bus.request(subjects.GENERATE, GenerateRequest(**small),
                                                              GenerateReply, timeout=60))
            print(f"64 huge prompts refused and one small request served in "
                  f"{asyncio.get_running_loop().time() - started:.2f} s")
            return errors, reply
    errors, reply = asyncio.run(run())
    assert {(e.code.value, "at least" in str(e)) for e in errors} == {("too_large", True)}
    alone = asyncio.run(generate(cluster.nats_url, **small))
    assert (reply.token_ids, reply.text, reply.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)


def test_penalised_greedy_equals_transformers_penalised_step_by_step(cluster, reference):
    """Presence, frequency and repetition penalties through the whole system (speculation on):
    the tokens equal transformers' logits penalised per step by the reference rule."""
    from test_engine_penalties import PENALTIES, penalise
    p = window_prompts()[1]
    reply = asyncio.run(generate(cluster.nats_url, token_ids=p, max_tokens=24, ignore_eos=True, **PENALTIES))
    want = []
    with torch.no_grad():
        for _ in range(24):
            logits = reference.model(torch.tensor([p + want])).logits[0, -1]
            want.append(int(penalise(logits, p, want, PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"],
                                     PENALTIES["repetition_penalty"]).argmax()))
    assert reply.token_ids == want and reply.finish_reason == "length"
    assert reply.token_ids != reference.greedy(p, 24)  # the penalties changed the output
    assert reply.spec.accepted > 0


def test_prefill_logs_each_transfer_with_its_descriptor_count(cluster):
    """The per-request line of prefill carries the WRITE's descriptor count (item-major storage:
    one per run of pages, one per ring slot, the aux row) next to its bytes and time."""
    reply = asyncio.run(generate(cluster.nats_url, token_ids=window_prompts()[0], max_tokens=2))

    def logged() -> list[dict]:
        lines = [line for path in Path(cluster.log_dir).glob("prefill-*.log")
                 for line in path.read_text().splitlines() if "baton.requests: " in line]
        rows = [json.loads(line.split("baton.requests: ", 1)[1]) for line in lines]
        return [r for r in rows if r["request_id"] == reply.request_id]

    deadline = time.monotonic() + 60
    while not logged():  # the line is written once the WRITE ends, maybe after the reply
        assert time.monotonic() < deadline, "prefill logged no line for the request"
        time.sleep(0.05)
    (row,) = logged()
    assert row["outcome"] == "done" and row["transfer_bytes"] > 0
    assert 4 <= row["descriptors"] <= 8  # FULL run(s), target and draft ring slots, the aux row


def test_prefill_tells_decode_as_each_write_starts(cluster, reference):
    """Prefill publishes WriteStarting to the decode it writes to, once per request, before the
    state lands (decode then polls for it closely); the reply is unchanged."""
    prompt = window_prompts()[1]

    async def run():
        seen: list[tuple[str, WriteStarting]] = []

        async def on_hint(msg) -> None:
            seen.append((msg.subject, decode_message(msg.data, WriteStarting)))
        async with await Bus.connect(cluster.nats_url, "test-hints") as watcher:
            await watcher.subscribe(f"{subjects.INTERNAL}.decode.*.incoming", on_hint)  # every decode's
            reply = await generate(cluster.nats_url, token_ids=prompt, max_tokens=24)
            await until(lambda: any(h.request_id.startswith(reply.request_id) for _, h in seen), 10,
                        "a WriteStarting for the request")
        return reply, [(subject, h) for subject, h in seen if h.request_id.startswith(reply.request_id)]
    reply, hints = asyncio.run(run())
    want = reference.greedy(prompt, 24)
    assert (reply.token_ids, reply.finish_reason) == (want, "length" if len(want) == 24 else "stop")
    assert len(hints) == 1 and hints[0][0].endswith(".incoming") and ".decode." in hints[0][0]


# --- logprobs: generated tokens' and the prompt's equal transformers' log-softmax at the same
# positions, with speculation on and off (per request, draft_tokens 0); a stream carries the same
# values as the unary reply; logprobs that could not fit in a message are refused up front.
LOGPROB_TOP = 5
LOGPROB_ATOL = 1e-4  # fp32, Baton's fused kernels against transformers' eager ones


async def stream(url: str, **fields) -> tuple[list[StreamChunk], Logprobs]:
    async with await Bus.connect(url, "test") as bus:
        async with bus.stream_request(subjects.GENERATE, GenerateRequest(stream=True, **fields), StreamChunk,
                                      timeout_per_message=120) as chunks:
            got = [c async for c in chunks]
    logprobs = Logprobs()
    for chunk in got:
        assert (chunk.logprobs is None) == (not chunk.token_ids)
        if chunk.logprobs is not None:
            assert chunk.logprobs.token_ids == chunk.token_ids
            logprobs = logprobs + chunk.logprobs
    return got, logprobs


@torch.no_grad()
def reference_logprobs(reference: Reference, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is transformers' log p(. | tokens[:p + 1])."""
    return torch.log_softmax(reference.model(torch.tensor([tokens])).logits[0].float(), -1)


def assert_matches(logprobs: Logprobs, dense: torch.Tensor, tokens: list[int], top: int) -> None:
    """logprobs of `tokens`, scored by dense rows [len(tokens), V]."""
    assert logprobs.token_ids == tokens
    want = dense.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs.logprobs), want, atol=LOGPROB_ATOL)
    top_v, top_i = dense.topk(top, -1)
    assert torch.allclose(torch.tensor(logprobs.top_logprobs), top_v, atol=LOGPROB_ATOL)
    near_ties = ((top_v[:, :-1] - top_v[:, 1:]) < 1e-3).any(-1)  # order among near-equals may swap
    assert [ids for ids, tie in zip(logprobs.top_ids, near_ties) if not tie] == \
        [ids for ids, tie in zip(top_i.tolist(), near_ties) if not tie]


def test_greedy_logprobs_equal_transformers_with_speculation_on_and_off(cluster, reference):
    prompts = window_prompts()

    async def run():
        return await asyncio.gather(*(generate(cluster.nats_url, token_ids=p, max_tokens=32, logprobs=LOGPROB_TOP,
                                               prompt_logprobs=2, draft_tokens=cap)
                                      for p in prompts for cap in (None, 0)))
    replies = asyncio.run(run())
    for i, p in enumerate(prompts):
        spec, plain = replies[2 * i], replies[2 * i + 1]
        assert spec.token_ids == plain.token_ids == reference.greedy(p, 32)
        assert spec.finish_reason == plain.finish_reason == "length"
        assert spec.spec.accepted > 0 and plain.spec.verify_steps == 0
        dense = reference_logprobs(reference, p + spec.token_ids)
        for reply in (spec, plain):
            assert_matches(reply.logprobs, dense[len(p) - 1:-1], reply.token_ids, LOGPROB_TOP)
            assert_matches(reply.prompt_logprobs, dense[:len(p) - 1], p[1:], 2)
            assert reply.prompt_token_ids == p
        assert torch.allclose(torch.tensor(spec.logprobs.logprobs), torch.tensor(plain.logprobs.logprobs), atol=1e-5)
    asyncio.run(wait_all_free(cluster.nats_url))


def test_a_stream_carries_the_unary_replys_logprobs(cluster):
    p = window_prompts()[1]
    fields = dict(token_ids=p, max_tokens=24, logprobs=3, prompt_logprobs=0)
    unary = asyncio.run(generate(cluster.nats_url, **fields))
    chunks, streamed = asyncio.run(stream(cluster.nats_url, **fields))
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids and chunks[-1].finish_reason == "length"
    assert streamed.token_ids == unary.logprobs.token_ids and streamed.top_ids == unary.logprobs.top_ids
    assert torch.allclose(torch.tensor(streamed.logprobs), torch.tensor(unary.logprobs.logprobs), atol=1e-5)
    with_prompt = [c for c in chunks if c.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is next(c for c in chunks if c.token_ids)
    assert with_prompt[0].prompt_logprobs.token_ids == p[1:] and with_prompt[0].prompt_token_ids == p


def test_sampled_tokens_report_their_raw_logprobs(cluster, reference):
    p = window_prompts()[0]
    reply = asyncio.run(generate(cluster.nats_url, token_ids=p, max_tokens=24, temperature=0.8, seed=7,
                                 logprobs=0, ignore_eos=True))
    dense = reference_logprobs(reference, p + reply.token_ids)
    assert_matches(reply.logprobs, dense[len(p) - 1:-1], reply.token_ids, 0)


def test_logprobs_that_could_not_fit_in_a_message_are_refused(cluster):
    with pytest.raises(BatonError) as exc:
        asyncio.run(generate(cluster.nats_url, token_ids=[5] * 3200, max_tokens=16, prompt_logprobs=20))
    assert exc.value.code == ErrorCode.TOO_LARGE and "logprobs" in exc.value.message
    reply = asyncio.run(generate(cluster.nats_url, prompt="To be", max_tokens=4, logprobs=20))
    assert len(reply.logprobs.top_ids[0]) == 20 and reply.finish_reason == "length"
