"""Speculative decoding end to end (real nats-server, separate processes, real NIXL): greedy
output equals transformers generate in every draft-state mode for k = 1, 3, 5 and with
speculation off, with many requests batched together, and turn after turn of a conversation
whose prompts prefill starts from its prefix cache; several prefill and decode workers share
the load and stay exact."""
import asyncio
import functools

import pytest

from baton.proto import subjects
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.config import WorkerSection
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import Reference, running_cluster, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
W = load_model().cfg.sliding_window
MAX_TOKENS = 24


@functools.lru_cache(maxsize=1)
def reference() -> Reference:
    return Reference()


@functools.lru_cache(maxsize=None)
def expected(prompt: tuple[int, ...]) -> list[int]:
    return reference().greedy(list(prompt), MAX_TOKENS)


def prompts(n: int = 6) -> list[list[int]]:
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    lengths = [3, W - 1, W, W + 1, 3 * W, 6 * W + 7, 2 * W, 17][:n]
    return [heldout_prompts(tok, 1, L, seed=100 + L)[0] for L in lengths]


async def generate_all(url: str, batch: list[list[int]]) -> list[GenerateReply]:
    async with await Bus.connect(url, "test") as bus:
        return await asyncio.gather(*(bus.request(subjects.GENERATE, GenerateRequest(token_ids=p, max_tokens=MAX_TOKENS),
                                                  GenerateReply, timeout=300) for p in batch))


async def converse(url: str, turns: int = 3) -> list[tuple[list[int], GenerateReply]]:
    """One conversation: each turn's prompt is the last one, its reply and new held-out tokens."""
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    said = heldout_prompts(tok, turns, 40, seed=7)
    prompt, history = prompts()[4], []
    async with await Bus.connect(url, "test") as bus:
        for t in range(turns):
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=prompt, max_tokens=MAX_TOKENS),
                                      GenerateReply, timeout=300)
            history.append((prompt, reply))
            prompt = prompt + reply.token_ids + said[t]
    return history


def check_conversation(history, k: int | None) -> None:
    """Every turn exact; from the second on, prefill started at the end of the previous prompt."""
    check_exact([p for p, _ in history], [r for _, r in history], k)
    for (before, _), (_, reply) in zip(history, history[1:]):
        assert reply.usage.cached_tokens == len(before), (reply.usage, len(before))


def reused_by_decodes(cluster) -> float:
    """Prompt positions the decodes' turn caches gave reservations, over every decode worker."""
    from test_e2e_generate import scrape
    return sum(scrape(m["port"]).get("baton_turn_cache_reused_tokens_total", 0.0)
               for m in cluster.metrics if m["role"] == "decode")


def check_exact(batch, replies, k: int | None) -> None:
    for p, reply in zip(batch, replies):
        want = expected(tuple(p))
        assert reply.token_ids == want, reference().explain(p, reply.token_ids, want)
        if k is None:
            assert reply.spec.verify_steps == reply.spec.drafted == 0
        else:
            assert reply.spec.drafted == k * reply.spec.verify_steps > 0


@pytest.mark.parametrize(("mode", "k"), [("transfer", 5), ("rebuild", 1), ("cold", 3)])
def test_greedy_exact_in_every_draft_state_mode(k, mode):
    """The whole system, each draft-state mode once, each k once (k sets the ring's rows, so the
    transfer's geometry): the full k x mode grid runs in process (test_engine_runner.py), where a
    combination costs no cluster start-up."""
    with running_cluster(worker_args=["--draft-tokens", str(k), "--draft-state", mode]) as cluster:
        batch = prompts()
        check_exact(batch, asyncio.run(generate_all(cluster.nats_url, batch)), k)
        check_conversation(asyncio.run(converse(cluster.nats_url)), k)
        asyncio.run(wait_all_free(cluster.nats_url))


def test_greedy_exact_with_speculation_off():
    with running_cluster(worker_args=["--spec", "off"]) as cluster:
        batch = prompts()
        check_exact(batch, asyncio.run(generate_all(cluster.nats_url, batch)), None)
        check_conversation(asyncio.run(converse(cluster.nats_url)), None)


def test_several_prefill_and_decode_workers_share_requests_exactly():
    # prefill copies each WRITE on two extra threads here (the default is none): the same tokens
    with running_cluster(prefill=2, decode=2, worker_args=["--kv-mode", "paged", "--transfer-threads", "2"]) as cluster:
        batch = prompts(8) * 2
        K = WorkerSection().draft_tokens  # the deployment default these workers run with
        check_exact(batch, asyncio.run(generate_all(cluster.nats_url, batch)), K)
        before = reused_by_decodes(cluster)
        history = asyncio.run(converse(cluster.nats_url))
        check_conversation(history, K)  # each turn finds the prefill holding the last
        span = W + K  # sliding positions decode keeps: the pages below a prompt's window may be shared
        # each turn repeats the last (the first repeats a prompt of the batch): its pages below its window
        repeated = [history[0][0]] + [p for p, _ in history[:-1]]
        want = sum(min(len(prev) // 16, max(0, len(p) - span) // 16) * 16 for prev, (p, _) in zip(repeated, history))
        assert reused_by_decodes(cluster) - before == want > 0  # each turn went to the decode holding the last
        loads = asyncio.run(wait_all_free(cluster.nats_url, min_requests=len(batch) + 1))  # + the warm-up
        served = {role: [v[6] for v in loads.values() if v[0] == role] for role in ("prefill", "decode")}
        assert len(served["decode"]) == 2 and all(n > 0 for n in served["decode"]), served
        assert len(served["prefill"]) == 2 and all(n > 0 for n in served["prefill"]), served
