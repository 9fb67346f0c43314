"""Prefill's prefix cache: a prompt that starts from a cached prompt end leaves exactly the state a
full prefill does (target KV, sliding rows, hidden rows, the draft window) and decodes to the same
greedy tokens, in ring and paged mode; random conversations keep pins, pages and the index
consistent, never free a page a request holds, and never hand out a stale page."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.proto.internal import CachedPrefix, PrefixEvents
from baton.services.router.affinity import PrefixAffinity
from baton.shared.engine.runner import ModelRunner, SpecConfig
from baton.shared.engine.sequence import Sequence
from baton.shared.kv.allocator import OutOfCapacity
from baton.shared.kv.budget import prefix_cache_bytes
from baton.shared.kv.prefix_cache import PrefixCache
from baton.shared.kv.routing import FULL
from baton.shared.kv.store import KVStore
from baton.shared.model.dense_attention import DenseAttention
from tiny_model import tiny_model

pytestmark = pytest.mark.unit
W, K, PS, VOCAB = 8, 3, 4, 61


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, window=W)


def parts(model, mode: str, cache: int, pages: int = 300, chunk: int = 5):
    store = KVStore(model.cfg, mode=mode, num_pages=pages, page_size=PS, num_slots=8, max_draft_tokens=K)
    runner = ModelRunner(model, store, SpecConfig(True, K, "transfer"), prefill_chunk=chunk)
    return store, runner, PrefixCache(store, cache, model.cfg.hidden_size) if cache else None


def prefill(store, runner, cache, rid: str, prompt: list[int], reserve: int, boundaries: bool = False):
    """What the prefill service does: allocate (from the cache), prefill (caching chunk ends when
    `boundaries`), cache the end, draft window."""
    seq = Sequence(rid, list(prompt), 1)
    hit = None
    if cache is not None:
        hit = cache.allocate(rid, prompt, num_tokens=reserve)
    else:
        store.allocate(rid, reserve)

    def on_chunk(i, end, hidden):
        hidden, first = hit.joined(cache, hidden) if hit else (hidden, 0)
        cache.insert(rid, prompt[:end], hidden, first, boundary=True)
    [out] = runner.prefill([seq], [hit.start if hit else 0], on_chunk if boundaries and cache is not None else None)
    if hit:
        out.hidden, out.hidden_start = hit.joined(cache, out.hidden)
    if cache is not None:
        cache.insert(rid, prompt, out.hidden, out.hidden_start, hit)
    runner.fill_draft_windows([seq], [out])
    return seq, out, hit


def state(store, rid: str, L: int) -> dict:
    """What a WRITE sends decode: every FULL row below L, the sliding rows storage keeps."""
    got = {}
    for key in store.keys:
        for layer in store.routing.layers_of(key):
            lo = 0 if key.kind == FULL else max(0, L - (W - 1)) if key.owner == "target" else max(1, L - W + 1)
            pos = torch.arange(lo, L)
            got[(key.name, layer)] = store.kv_rows(layer)[store.rows(rid, layer, pos)].clone()
    return got


@torch.no_grad()
def dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        h = model.forward_hidden(torch.tensor(seq), torch.arange(len(seq)), DenseAttention(model.cfg, 1, len(seq)))
        seq.append(int(model.logits(h[-1:]).argmax()))
    return seq[len(prompt):]


def conversation(seed: int) -> list[list[int]]:
    """Turn prompts: each the last plus new tokens (more or fewer than the window), then the same
    prompt again, then one cut a token short, then a diverging one."""
    rng = random.Random(seed)
    turns = [[rng.randrange(1, VOCAB) for _ in range(3 * W + 1)]]
    for extra in (2, W + 3, 1, 4 * W):
        turns.append(turns[-1] + [rng.randrange(1, VOCAB) for _ in range(extra)])
    turns += [list(turns[-1]), turns[-1][:-1], turns[2][:-3] + [rng.randrange(1, VOCAB) for _ in range(W)]]
    return turns


def same_as_a_full_prefill(model, cached, cold, rid: str, prompt: list[int], boundaries: bool = False) -> int:
    """Prefill `prompt` through the cache and cold: the same first token, hidden rows the draft
    window and aux rows read, and state; then the same greedy tokens as the dense reference.
    Returns where the cached one started."""
    L = len(prompt)
    seq, out, hit = prefill(*cached, rid, prompt, L + 20, boundaries)
    ref_seq, ref, _ = prefill(*cold, rid, prompt, L + 20)
    assert out.first_token == ref.first_token
    torch.testing.assert_close(out.hidden[-W:], ref.hidden[-W:], rtol=1e-5, atol=1e-5)
    got, want = state(cached[0], rid, L), state(cold[0], rid, L)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{rid} {name}")
    for (store, runner, _), s, o in ((cached, seq, out), (cold, ref_seq, ref)):
        s.max_tokens = 9
        runner.start_decode(s, o.first_token, o.hidden[-1:], "transfer")
        while s.finish_reason is None:
            runner.step([s])
        store.free(rid)
        store.check_integrity()
    assert seq.output == ref_seq.output == dense_greedy(model, prompt, 9)
    cached[2].check_integrity()
    return hit.start if hit else 0


@pytest.mark.parametrize("mode", ["ring", "paged"])
def test_a_prompt_started_from_the_cache_leaves_the_state_of_a_full_prefill(model, mode):
    cached, cold = parts(model, mode, cache=16), parts(model, mode, cache=0)
    starts = []
    for t, prompt in enumerate(conversation(1)):
        starts.append(same_as_a_full_prefill(model, cached, cold, f"t{t}", prompt))
    lengths = [len(p) for p in conversation(1)]
    # turn 0 misses; each extension starts from the previous turn's end; the same prompt again and
    # one cut a token short start one position before its end; the diverging one starts from the
    # longest turn it still extends
    assert starts == [0, *lengths[:4], lengths[5] - 1, lengths[6] - 1, lengths[1]], starts


@pytest.mark.parametrize("mode", ["ring", "paged"])
def test_a_prompt_sharing_only_the_first_chunks_of_another_starts_at_their_end(model, mode):
    """Two conversations with the same long system prompt: the second starts at the last chunk
    boundary of the first that it shares, and ends in the state of a full prefill."""
    cached, cold = parts(model, mode, cache=16, chunk=16), parts(model, mode, cache=0, chunk=16)
    rng = random.Random(9)
    system = [rng.randrange(1, VOCAB) for _ in range(35)]
    first, second = (system + [rng.randrange(1, VOCAB) for _ in range(n)] for n in (12, 20))
    for rid, prompt, start in (("a", first, 0), ("b", second, 32)):  # chunks of 16: boundaries 16, 32
        assert same_as_a_full_prefill(model, cached, cold, rid, prompt, boundaries=True) == start
    assert sorted(len(e.tokens) for e in cached[2]._lru.values()) == [16, 32, len(first), 48, len(second)]


def test_the_snapshot_pool_is_what_the_budget_counts(model):
    store, _, cache = parts(model, "paged", cache=5)
    assert cache.nbytes() == prefix_cache_bytes(model.cfg, 5, K, store.dtype)


def test_prompt_logprobs_need_the_whole_prompt(model):
    store, runner, cache = parts(model, "ring", cache=4)
    prompt = conversation(2)[0]
    prefill(store, runner, cache, "a", prompt, len(prompt))
    assert cache.allocate("b", prompt + [5, 6], use=False) is None
    assert store.length("b") == 0


def test_eviction_makes_room_and_keeps_what_requests_hold(model):
    store, runner, cache = parts(model, "ring", cache=8, pages=24)
    turns = conversation(3)[:3]  # 25, 27, 38 tokens: 7, 7, 10 pages
    prefill(store, runner, cache, "a", turns[0], len(turns[0]))
    store.free("a")
    b_seq, _, hit = prefill(store, runner, cache, "b", turns[1], len(turns[1]))
    assert hit is not None and hit.start == len(turns[0])
    # "b" is still held (its WRITE in flight): it shares a's first 3 pages and copied the next 4,
    # so 13 pages are free and a's last 4 are held by the cache alone (reclaimable)
    assert (store.pages.num_free, store.free_capacity().pages) == (13, 17)
    with pytest.raises(OutOfCapacity):  # 18 pages: more than evicting everything could give
        cache.allocate("c", list(range(1, 73)))
    assert len(cache) == 2  # so nothing was evicted for nothing
    cache.check_integrity()
    store.free("b")
    assert cache.allocate("c", list(range(1, 73))) is None  # now the cache gives its pages up
    assert len(cache) == 0 and cache.evictions == 2
    cache.check_integrity()
    store.free("c")
    assert store.pages.num_free == 24 == store.free_capacity().pages
    cache.check_integrity()


# --- random conversations against the bookkeeping alone ------------------------------------------
def _mark(store, rid: str, prompt: list[int], lo: int) -> None:
    """Stand-in for computing positions lo..L-1: every row of position p holds token p + p/1000."""
    L = len(prompt)
    store.extend(rid, L)
    for key in store.keys:
        for layer in store.routing.layers_of(key):
            first = max(lo, store.first_resident(rid, layer))
            pos = torch.arange(first, L)
            vals = torch.tensor([prompt[p] + p / 1000 for p in range(first, L)])
            store.kv_rows(layer)[store.rows(rid, layer, pos)] = vals[:, None, None, None]


def _check_content(store, rid: str, prompt: list[int], upto: int) -> None:
    """Rows the request may read below `upto` hold its own tokens: nothing stale was handed out."""
    for key in store.keys:
        if key.owner != "target":
            continue
        for layer in store.routing.layers_of(key):
            first = 0 if key.kind == FULL else max(store.first_resident(rid, layer), upto - W + 1, 0)
            pos = torch.arange(first, upto)
            want = torch.tensor([prompt[p] + p / 1000 for p in range(first, upto)])
            got = store.kv_rows(layer)[store.rows(rid, layer, pos)][:, 0, 0, 0]
            assert torch.equal(got, want), (key.name, layer)


class RouterView:
    """A router's index fed the cache's changes as the prefill service sends them (a message per
    batch, a snapshot when asked); after each message it must hold exactly what the cache holds."""

    def __init__(self) -> None:
        self.index = PrefixAffinity()

    def tell(self, cache: PrefixCache, snapshot: bool, batch_ends: bool) -> None:
        if snapshot or not self.index.knows("w", "i"):
            seq, held = cache.snapshot()
            assert self.index.apply(PrefixEvents(worker_id="w", instance_id="i", seq=seq, block=PS, snapshot=True,
                                                 added=[CachedPrefix(**vars(e)) for e in held]))
        elif batch_ends and (changes := cache.take_changes()) is not None:
            seq, added, evicted = changes
            assert self.index.apply(PrefixEvents(worker_id="w", instance_id="i", seq=seq, block=PS,
                                                 added=[CachedPrefix(**vars(e)) for e in added],
                                                 evicted=[CachedPrefix(**vars(e)) for e in evicted]))
        else:
            return  # the batch goes on: changes stay pending
        view = self.index._views["w"]
        told = sorted((blocks, digest, t) for (blocks, digest), ends in view.ends.items() for t in ends.elements())
        held = sorted((e.blocks, e.digest, e.tokens) for e in cache.snapshot()[1])
        assert told == held


turns_st = st.lists(st.tuples(st.sampled_from(["extend", "repeat", "diverge", "new"]), st.integers(1, 3 * W),
                              st.booleans()), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=turns_st, mode=st.sampled_from(["ring", "paged"]), entries=st.integers(1, 5), seed=st.integers(0, 99))
def test_random_conversations_keep_the_cache_consistent(model, ops, mode, entries, seed):
    rng = random.Random(seed)
    store = KVStore(model.cfg, mode=mode, num_pages=40, page_size=PS, num_slots=4, max_draft_tokens=K)
    cache = PrefixCache(store, entries, model.cfg.hidden_size)
    told = RouterView()
    hidden = torch.zeros(200, model.cfg.hidden_size)
    history, live = [[1, 2, 3]], []
    for n, (op, extra, keep) in enumerate(ops):
        base = rng.choice(history)
        prompt = {"extend": base + [rng.randrange(1, VOCAB) for _ in range(extra)], "repeat": list(base),
                  "diverge": base[:max(1, len(base) - extra)] + [rng.randrange(1, VOCAB) for _ in range(extra)],
                  "new": [rng.randrange(1, VOCAB) for _ in range(extra + 1)]}[op][:120]
        rid = f"r{n}"
        if len(live) == 4 or (live and not keep):
            store.free(live.pop(0))
        try:
            hit = cache.allocate(rid, prompt)
        except OutOfCapacity:
            cache.check_integrity()
            continue
        start = hit.start if hit else 0
        assert start < len(prompt)
        if hit:
            assert tuple(prompt[:start]) == hit.entry.tokens[:start]
        _check_content(store, rid, prompt, start)  # what it starts from is its own prefix
        _mark(store, rid, prompt, start)
        cache.insert(rid, prompt, hidden[:len(prompt)], 0, hit)
        live.append(rid)
        history.append(prompt)
        cache.check_integrity()
        told.tell(cache, snapshot=rng.random() < 0.1, batch_ends=keep)
    for rid in live:
        store.free(rid)
    cache.reclaim()
    cache.check_integrity()
    told.tell(cache, snapshot=False, batch_ends=True)
    assert store.pages.num_free == 40 and store.free_capacity().pages == 40 and len(told.index) == 0


def test_a_turn_whose_next_turn_is_cached_goes_first_when_slots_run_out(model):
    store, runner, cache = parts(model, "ring", cache=2)
    one, two = conversation(4), conversation(5)
    for rid, prompt in (("a1", one[0]), ("b1", two[0]), ("a2", one[1])):  # a2 extends a1: a1 goes, not b1
        prefill(store, runner, cache, rid, prompt, len(prompt))
        store.free(rid)
    assert sorted(len(e.tokens) for e in cache._lru.values()) == sorted([len(two[0]), len(one[1])])
    _, _, hit = prefill(store, runner, cache, "b2", two[1], len(two[1]))
    assert hit is not None and hit.start == len(two[0])
    store.free("b2")
    cache.check_integrity()
