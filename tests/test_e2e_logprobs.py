"""Logprobs end to end (real nats-server, service processes, NIXL): generated tokens' logprobs and
the prompt's equal `transformers`' log-softmax at the same positions, with speculation on and off
(per request, draft_tokens 0, in the same deployment); a stream carries the same values as the
unary reply; a request whose logprobs could not fit in a message is refused up front."""
import asyncio

import pytest
import torch

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import GenerateReply, GenerateRequest, Logprobs, StreamChunk
from baton.shared.bus import Bus
from e2e_cluster import Reference, running_cluster, wait_all_free, window_prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
TOP = 5
ATOL = 1e-4  # fp32, Baton's fused kernels against transformers' eager ones


@pytest.fixture(scope="module")
def cluster(nats_server):
    with running_cluster(nats_server) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return Reference()


async def generate(url: str, **fields) -> GenerateReply:
    async with await Bus.connect(url, "test") as bus:
        return await bus.request(subjects.GENERATE, GenerateRequest(**fields), GenerateReply, timeout=300)


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
    assert torch.allclose(torch.tensor(logprobs.logprobs), want, atol=ATOL)
    top_v, top_i = dense.topk(top, -1)
    assert torch.allclose(torch.tensor(logprobs.top_logprobs), top_v, atol=ATOL)
    near_ties = ((top_v[:, :-1] - top_v[:, 1:]) < 1e-3).any(-1)  # order among near-equals may swap
    assert [ids for ids, tie in zip(logprobs.top_ids, near_ties) if not tie] == \
        [ids for ids, tie in zip(top_i.tolist(), near_ties) if not tie]


def test_greedy_logprobs_equal_transformers_with_speculation_on_and_off(cluster, reference):
    prompts = window_prompts()

    async def run():
        return await asyncio.gather(*(generate(cluster.nats_url, token_ids=p, max_tokens=32, logprobs=TOP,
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
            assert_matches(reply.logprobs, dense[len(p) - 1:-1], reply.token_ids, TOP)
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
