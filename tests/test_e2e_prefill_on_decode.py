"""Conditional disaggregation end to end (real nats-server, separate processes, real NIXL): a
short prompt that no worker holds a prefix of is prefilled by its decode worker when nothing else
runs there, and the reply is the one the hand-off gives: greedy equal to `transformers` at every
length around the sliding window, a seeded sampled reply equal to the same request's through
prefill, logprobs included; the next turn of a conversation starts from prefill's prefix cache,
which computed the first turn off its path. Decode refuses to prefill while it holds another
request."""
import asyncio
import functools

import pytest

from baton.proto import subjects
from baton.proto.internal import Ack, ReleaseRequest, ReserveReply, ReserveRequest, SamplingParams
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.config import WorkerSection
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import Reference, running_cluster, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
W = load_model().cfg.sliding_window
LIMIT = 3 * W + 8  # router.prefill_on_decode_tokens in this module's cluster
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(nats_server):
    with running_cluster(nats_server, env={"BATON_ROUTER_PREFILL_ON_DECODE_TOKENS": str(LIMIT)}) as c:
        yield c


@functools.lru_cache(maxsize=1)
def reference() -> Reference:
    return Reference()


def prompt(n: int, seed: int = 0) -> list[int]:
    """A held-out prompt of n tokens; no two (n, seed) share a beginning (a cached prefix)."""
    return heldout_prompts(TextTokenizer.load(DEFAULT_MODEL_DIR), 1, n, seed=1000 + n + 10_000 * seed)[0]


async def generate(bus: Bus, **fields) -> GenerateReply:
    return await bus.request(subjects.GENERATE, GenerateRequest(**fields), GenerateReply, timeout=300)


def check_greedy(lengths: list[int], replies: list[GenerateReply], k: int | None) -> None:
    """Each reply equals transformers' greedy generate whole, finish reason included; k drafts a
    verify step (None: speculation off)."""
    for n, reply in zip(lengths, replies):
        want = reference().greedy(prompt(n), MAX_TOKENS)
        assert reply.token_ids == want, reference().explain(prompt(n), reply.token_ids, want)
        assert reply.finish_reason == ("stop" if len(want) < MAX_TOKENS else "length")
        if k is None:
            assert reply.spec.verify_steps == reply.spec.drafted == 0
        else:
            assert reply.spec.drafted == k * reply.spec.verify_steps > 0


def prefilled_by_prefill(loads: dict) -> int:
    """Requests the prefill workers took, from `wait_all_free`'s (fresh) loads."""
    return sum(row[6] for row in loads.values() if row[0] == "prefill")


def prefilled_here(cluster) -> float:
    """decode's count of the prompts it computed itself."""
    from test_e2e_generate import scrape
    return sum(scrape(m["port"]).get("baton_decode_prefilled_here_total", 0.0)
               for m in cluster.metrics if m["role"] == "decode")


async def taken(url: str) -> tuple[int, int]:
    """(requests the decodes took, of them through prefill), once every worker is free again."""
    loads = await wait_all_free(url)
    return sum(row[6] for row in loads.values() if row[0] == "decode"), prefilled_by_prefill(loads)


def test_short_prompts_on_an_idle_decode_skip_prefill_and_stay_exact(cluster):
    """One at a time (decode idle each time): greedy replies equal transformers' whole, finish
    reason included, and prefill takes only the prompt over the limit."""
    lengths = [3, W - 1, W, W + 1, 2 * W + 3, LIMIT]

    counted = prefilled_here(cluster)

    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            before = await taken(cluster.nats_url)
            replies = [await generate(bus, token_ids=prompt(n), max_tokens=MAX_TOKENS) for n in lengths]
            between = await taken(cluster.nats_url)
            long = await generate(bus, token_ids=prompt(LIMIT + 1), max_tokens=MAX_TOKENS)
            after = await taken(cluster.nats_url)
        return replies, long, before, between, after
    replies, long, before, between, after = asyncio.run(run())
    check_greedy(lengths + [LIMIT + 1], replies + [long], WorkerSection().draft_tokens)
    assert between == (before[0] + len(lengths), before[1]), (before, between)  # none through prefill
    assert after == (between[0] + 1, between[1] + 1), (between, after)  # the long one through prefill
    assert prefilled_here(cluster) == counted + len(lengths)


def test_a_seeded_sampled_reply_is_the_same_prefilled_on_decode_or_through_prefill(cluster):
    """The same seeded request twice: first decode prefills it (and prefill keeps a copy in its
    prefix cache), then the router sends it through prefill, which now holds its prefix. The
    same tokens and logprobs both times."""
    p = prompt(W + 5, seed=1)
    fields = dict(token_ids=p, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, logprobs=2,
                  ignore_eos=True)

    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            before = await taken(cluster.nats_url)
            alone = await generate(bus, **fields)
            mid = await taken(cluster.nats_url)  # prefill's copy is computed and kept (its routers told)
            again = await generate(bus, **fields)
            after = await taken(cluster.nats_url)
        return alone, again, before, mid, after
    alone, again, before, mid, after = asyncio.run(run())
    assert mid == (before[0] + 1, before[1])  # prefilled on decode
    assert after == (mid[0] + 1, mid[1] + 1)  # through prefill
    assert again.usage.cached_tokens > 0
    assert again.token_ids == alone.token_ids and again.finish_reason == alone.finish_reason == "length"
    assert again.logprobs.token_ids == alone.logprobs.token_ids == alone.token_ids
    assert again.logprobs.top_ids == alone.logprobs.top_ids
    assert again.logprobs.logprobs == pytest.approx(alone.logprobs.logprobs, abs=1e-5)


def test_the_next_turn_after_one_prefilled_on_decode_starts_from_prefills_cache(cluster):
    """Prefill computed the first turn too, off its path, for its prefix cache: the next turn
    (the prompt, the reply and new tokens, over the limit) starts there from the first turn's
    end, and both replies equal transformers'."""
    first = prompt(W + 3, seed=3)

    async def run():
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            counted = prefilled_here(cluster)
            one = await generate(bus, token_ids=first, max_tokens=MAX_TOKENS)
            assert prefilled_here(cluster) == counted + 1
            await wait_all_free(cluster.nats_url)  # prefill's copy is computed and kept (its routers told)
            second = first + one.token_ids + prompt(LIMIT, seed=4)
            return one, second, await generate(bus, token_ids=second, max_tokens=MAX_TOKENS)
    one, second, two = asyncio.run(run())
    assert one.usage.cached_tokens == 0 and two.usage.cached_tokens == len(first)
    for p, reply in ((first, one), (second, two)):
        want = reference().greedy(p, MAX_TOKENS)
        assert reply.token_ids == want, reference().explain(p, reply.token_ids, want)


def test_decode_does_not_prefill_while_it_holds_another_request(cluster):
    """A reservation that asks decode to prefill, made while another is held there (reserved and
    waiting for a transfer, which no speed of decoding can end), is an ordinary one: it waits for
    prefill's transfer too (both released here)."""
    async def run():
        loads = await wait_all_free(cluster.nats_url)
        decode_id = next(w for w, row in loads.items() if row[0] == "decode")
        prefill_id = next(w for w, row in loads.items() if row[0] == "prefill")
        async with await Bus.connect(cluster.nats_url, "test") as bus:
            inbox = bus.connection.new_inbox()
            await bus.connection.subscribe(inbox)  # someone reads the chunks: decode keeps streaming

            def reserve(request_id: str, prefill_here: bool) -> ReserveRequest:
                return ReserveRequest(request_id=request_id, token_ids=prompt(10), max_tokens=400,
                                      sampling=SamplingParams(), stream_subject=inbox,
                                      prefill_worker_id=prefill_id, components=[], draft_state="transfer",
                                      prefill_here=prefill_here)
            subject = subjects.decode_reserve(decode_id)
            held = await bus.request(subject, reserve("held-first", False), ReserveReply)  # waits for a WRITE
            second = await bus.request(subject, reserve("asked-second", True), ReserveReply)
            for rid in ("asked-second", "held-first"):
                await bus.request(subjects.decode_release(decode_id), ReleaseRequest(request_id=rid), Ack)
        await wait_all_free(cluster.nats_url)
        return held, second
    held, second = asyncio.run(run())
    assert not held.prefilled_here and not second.prefilled_here


@pytest.mark.parametrize("worker_args, k", [
    (["--draft-state", "rebuild", "--draft-tokens", "1", "--kv-mode", "paged"], 1),
    (["--draft-state", "cold", "--draft-tokens", "3"], 3),
    (["--spec", "off"], None),
])
def test_prefilled_on_decode_stays_exact_in_every_draft_state_mode(worker_args, k):
    """Decode builds the draft window as the mode says (rebuilt from the prompt's hidden states,
    cold, none), in ring and paged storage: greedy replies equal transformers', one at a time."""
    lengths = [3, W, W + 1, 2 * W + 3]
    env = {"BATON_ROUTER_PREFILL_ON_DECODE_TOKENS": str(LIMIT)}
    with running_cluster(worker_args=worker_args, env=env) as cluster:
        counted = prefilled_here(cluster)

        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                return [await generate(bus, token_ids=prompt(n), max_tokens=MAX_TOKENS) for n in lengths]
        replies = asyncio.run(run())
        assert prefilled_here(cluster) == counted + len(lengths)
    check_greedy(lengths, replies, k)
