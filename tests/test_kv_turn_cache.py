"""Decode's turn cache (shared/kv/turn_cache.py): a follow-up prompt shares the full-attention pages
of the finished prompt it repeats, only below its own sliding window; the allocation says how
much is reused and the transfer plan then sends FULL only from there; eviction under pressure
never frees a page a request holds; what routers are told matches what is held."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from baton.proto.internal import CachedPrefix, PrefixEvents
from baton.services.router.affinity import PrefixAffinity
from baton.shared.kv.allocator import OutOfCapacity
from baton.shared.kv.plan import make_plan
from baton.shared.kv.routing import FULL
from baton.shared.kv.store import KVStore
from baton.shared.kv.turn_cache import TurnCache
from tiny_model import tiny_model

pytestmark = pytest.mark.unit
W, K, PS = 8, 3, 4
SPAN = W + K  # sliding positions storage keeps


@pytest.fixture(scope="module")
def cfg():
    return tiny_model(61, window=W).cfg


def store_of(cfg, mode="ring", pages=64, role="decode") -> KVStore:
    return KVStore(cfg, mode=mode, num_pages=pages, page_size=PS, num_slots=8, max_draft_tokens=K,
                   draft_enabled=role == "decode")


def served(store, turns, rid, prompt, extra=6) -> int:
    """Reserve as decode does (the prompt counts as written), finish, keep; returns the reuse."""
    reused = turns.allocate(rid, prompt, len(prompt) + extra)
    store.extend(rid, len(prompt))
    turns.keep(rid, prompt)
    store.free(rid)
    turns.check_integrity()
    return reused


@pytest.mark.parametrize("mode", ["ring", "paged"])
def test_a_follow_up_shares_the_whole_pages_of_the_prompt_it_repeats_below_its_window(cfg, mode):
    store = store_of(cfg, mode)
    turns = TurnCache(store, 4)
    first = list(range(1, 31))  # 30 tokens: 7 whole pages kept
    assert served(store, turns, "t1", first) == 0
    follow_up = first + [7] * 20  # 50 tokens: its window starts at 39, pages below: 9
    reused = turns.allocate("t2", follow_up, 60)
    assert reused == 28 and store.allocation("t2").reused == 28
    assert store.allocation("t2").page_ids[:7] == tuple(turns._lru[next(iter(turns._lru))].pages)
    turns.check_integrity()
    store.free("t2")
    assert turns.allocate("t3", first + [5, 5], 40) == 20  # window from 21: only 5 pages below it
    store.free("t3")
    assert turns.allocate("t4", first[:17] + [9] * 30, 60) == 16  # diverges in page 5: 4 pages shared
    store.free("t4")
    assert turns.allocate("t5", [2] + first[1:] + [7] * 20, 60) == 0  # the first page differs
    store.free("t5")
    turns.check_integrity()


def test_a_plan_sends_full_attention_kv_only_from_what_decode_holds(cfg):
    prefill, decode = store_of(cfg, role="prefill"), store_of(cfg)
    plan = make_plan(prefill.manifest("p", "fp", "prefill"), decode.manifest("d", "fp", "decode"))
    turns = TurnCache(decode, 4)
    first = list(range(1, 31))
    served(decode, turns, "t1", first)
    prompt = first + [7] * 20
    prefill.allocate("r", len(prompt))
    prefill.extend("r", len(prompt))
    turns.allocate("r", prompt, 60)
    decode.extend("r", len(prompt))
    full = lambda descs: sum(d.nbytes for d in descs if d.component_key.endswith(FULL))  # noqa: E731
    with_reuse = plan.descriptors(len(prompt), prefill.allocation("r"), decode.allocation("r"))
    without = plan.descriptors(len(prompt), prefill.allocation("r"), replace(decode.allocation("r"), reused=0))
    page_bytes = sum(p.src.geometry.item_bytes for p in plan.pairs if p.src.ident.kind == FULL)
    assert full(without) - full(with_reuse) == 7 * page_bytes > 0
    assert {d.component_key for d in with_reuse} == {d.component_key for d in without}  # sliding and aux still go


def test_eviction_under_pressure_never_frees_a_page_a_request_holds(cfg):
    store = store_of(cfg, pages=20)
    turns = TurnCache(store, 8)
    first = list(range(1, 31))
    served(store, turns, "t1", first)
    assert turns.allocate("live", first + [3] * 20, 56) == 28  # shares turn 1's 7 pages, holds 7 more
    served(store, turns, "t2", [40 + i for i in range(8)], extra=0)  # 2 more pages, pinned only
    assert store.pages.num_free == 4 and store.free_capacity().pages == 6  # pin-only pages count as free
    with pytest.raises(OutOfCapacity):  # 20 pages: evicting everything still leaves only 6
        turns.allocate("big", [50] * 80, 80)
    assert len(turns) == 2  # nothing was evicted for a request that could not fit anyway
    turns.allocate("fits", [50] * 24, 24)  # 6 pages: t1 goes (its pages stay with live), then t2
    assert len(turns) == 0 and turns.evictions == 2
    turns.check_integrity()
    assert set(store.allocation("live").page_ids) <= store.pages.used  # its shared pages survived
    for rid in ("fits", "live"):
        store.free(rid)
    assert store.pages.num_free == 20


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["extend", "repeat", "diverge", "new"]), st.integers(1, 30)),
                    min_size=1, max_size=20), mode=st.sampled_from(["ring", "paged"]), entries=st.integers(1, 4),
       seed=st.integers(0, 99))
def test_random_conversations_keep_pins_and_the_routers_view_consistent(cfg, ops, mode, entries, seed):
    rng = random.Random(seed)
    store = store_of(cfg, mode, pages=40)
    turns = TurnCache(store, entries)
    index = PrefixAffinity()
    history = [[1, 2, 3]]
    for n, (op, extra) in enumerate(ops):
        base = rng.choice(history)
        prompt = {"extend": base + [rng.randrange(1, 61) for _ in range(extra)], "repeat": list(base),
                  "diverge": base[:max(1, len(base) - extra)] + [rng.randrange(1, 61) for _ in range(extra)],
                  "new": [rng.randrange(1, 61) for _ in range(extra + 1)]}[op][:100]
        try:
            reused = served(store, turns, f"r{n}", prompt)
        except OutOfCapacity:
            continue
        assert reused % PS == 0 and reused <= max(0, len(prompt) - SPAN)
        history.append(prompt)
        if rng.random() < 0.2 or not index.knows("d", "i"):
            seq, held = turns.snapshot()
            assert index.apply(PrefixEvents(worker_id="d", instance_id="i", seq=seq, block=PS, snapshot=True,
                                            added=[CachedPrefix(**vars(e)) for e in held]))
        elif (changes := turns.take_changes()) is not None:
            seq, added, evicted = changes
            assert index.apply(PrefixEvents(worker_id="d", instance_id="i", seq=seq, block=PS,
                                            added=[CachedPrefix(**vars(e)) for e in added],
                                            evicted=[CachedPrefix(**vars(e)) for e in evicted]))
        held = sorted((e.blocks, e.digest, e.tokens) for e in turns.snapshot()[1])
        told = sorted((b, d, t) for (b, d), ends in index._views["d"].ends.items() for t in ends.elements())
        assert told == held
    turns.reclaim()
    turns.check_integrity()
    assert store.pages.num_free == 40
