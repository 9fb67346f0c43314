"""Property tests: random allocate / extend / rollback / free against a naive reference.

The reference is a plain list per request: value[p] of the latest accepted write of position p.
After every operation: the store's integrity holds; no page, SWA page, slot or physical row is
assigned to two requests; every position the store claims resident reads back the reference
value, and the window of the next query (the last W-1 positions) is always resident. At the
end every request is freed and the capacity is back to full.
"""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from baton.shared.kv import KVError, KVStore, OutOfCapacity
from baton.shared.model.config import FULL as F, SLIDING as S, ModelConfig

pytestmark = pytest.mark.unit
W, PS, K = 6, 4, 2
CFG = ModelConfig(vocab_size=64, hidden_size=4, intermediate_size=8, num_attention_heads=1,
                  num_key_value_heads=1, head_dim=1, num_hidden_layers=3,
                  layer_types=(S, F, S), sliding_window=W, num_nextn_predict_layers=1,
                  mtp_layer_types=(S,))
LAYERS = range(4)


class Model:
    """The naive reference: per request the list of values of positions 0..length-1."""

    def __init__(self, store: KVStore):
        self.store, self.values, self.safe = store, {}, {}
        self.counter = 0

    def write(self, rid: str, start: int, end: int) -> None:
        """Write fresh values for positions start..end-1 (only those the store keeps)."""
        new = [self.next() for _ in range(start, end)]
        self.values[rid] = self.values[rid][:start] + new
        for layer in LAYERS:
            lo = max(start, self.store.first_resident(rid, layer))
            if lo < end:
                rows = self.store.rows(rid, layer, torch.arange(lo, end))
                self.store.kv_buffer(layer)[0][rows] = torch.tensor(new[lo - start:])[:, None, None]

    def next(self) -> float:
        self.counter += 1
        return float(self.counter)

    def check(self) -> None:
        self.store.check_integrity()
        allocs = [self.store.allocation(rid) for rid in self.values]
        for ids in ([p for a in allocs for p in a.page_ids], [a.slot for a in allocs],
                    [s for a in allocs for s in a.swa_page_ids if s >= 0]):
            assert len(ids) == len(set(ids)), "an id is assigned to two requests"
        for layer in LAYERS:
            seen: set[int] = set()
            for rid, ref in self.values.items():
                n, lo = len(ref), self.store.first_resident(rid, layer)
                assert lo <= max(0, n - W + 1) or n == 0, "the query window is not resident"
                rows = self.store.rows(rid, layer, torch.arange(lo, n))
                assert not seen & set(rows.tolist()), f"layer {layer}: a row is shared"
                seen |= set(rows.tolist())
                stored = self.store.kv_buffer(layer)[0][rows][:, 0, 0].tolist()
                assert stored == ref[lo:], f"layer {layer} of {rid} differs from the reference"
                assert stored[-(W - 1):] == ref[-(W - 1):]  # naive: the last W-1 positions


step = st.tuples(st.just("step"), st.integers(0, 3), st.integers(1, K + 1), st.integers(0, K))
op = st.one_of(
    st.tuples(st.just("allocate"), st.integers(1, 48)),
    step, step, step,
    st.tuples(st.just("chunk"), st.integers(0, 3), st.integers(1, 24)),
    st.tuples(st.just("rollback"), st.integers(0, 3), st.integers(0, 12)),  # rewind by 0..12
    st.tuples(st.just("free"), st.integers(0, 3)),
)


@pytest.mark.parametrize("mode", ["ring", "paged"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.integers(24, 48), min_size=1, max_size=3),
       ops=st.lists(op, min_size=5, max_size=60))
def test_random_lifecycles_never_leak_or_share(mode, first, ops):
    run(mode, [("allocate", n) for n in first] + ops)


@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("seed", [0, 1])
def test_long_random_walk(mode, seed):
    """Hypothesis keeps sequences short; a seeded walk reaches long requests and many reuses."""
    rng = random.Random(seed)
    ops = []
    for _ in range(600):
        kind = rng.choices(["allocate", "step", "chunk", "rollback", "free"], [2, 12, 2, 3, 1])[0]
        args = {"allocate": lambda: [rng.randint(24, 48)],
                "step": lambda: [rng.randrange(4), rng.randint(1, K + 1), rng.randint(0, K)],
                "chunk": lambda: [rng.randrange(4), rng.randint(1, 24)],
                "rollback": lambda: [rng.randrange(4), rng.randint(0, 12)],
                "free": lambda: [rng.randrange(4)]}[kind]()
        ops.append((kind, *args))
    run(mode, ops)


def run(mode, ops):
    store = KVStore(CFG, mode=mode, num_pages=36, page_size=PS, num_slots=3, max_draft_tokens=K,
                    num_swa_pages=8)
    full = store.free_capacity()
    model, names = Model(store), iter(f"r{i}" for i in range(1000))
    for action, *args in ops:
        rids = sorted(model.values)
        if action == "allocate":
            rid, before = next(names), store.free_capacity()
            try:
                store.allocate(rid, args[0])
                model.values[rid], model.safe[rid] = [], 0
            except OutOfCapacity:
                assert store.free_capacity() == before
        elif rids and action in ("step", "chunk"):
            rid = rids[args[0] % len(rids)]
            n, size = store.length(rid), args[1]
            size = min(size, store.allocation(rid).num_tokens - n)
            store.extend(rid, n + size)
            model.write(rid, n, n + size)
            model.safe[rid] = n if size <= K + 1 else n + size
            if action == "step":  # verify k+1 tokens, accept some: a rewind, never a copy
                keep = n + min(size, args[2] + 1)
                store.rollback(rid, keep)
                model.values[rid] = model.values[rid][:keep]
                model.safe[rid] = keep
        elif rids and action == "rollback":
            rid = rids[args[0] % len(rids)]
            target = max(0, store.length(rid) - args[1])
            needed = max(0, target - W + 1)
            lowest = store.first_resident(rid, 0)  # layer 0 is sliding
            try:
                store.rollback(rid, target)
                model.values[rid] = model.values[rid][:target]
                model.safe[rid] = target
            except KVError:
                assert target > 0 and needed < lowest, "refused a rollback it could do"
                assert target < model.safe[rid], "refused a rollback within the last verify"
        elif rids and action == "free":
            rid = rids[args[0] % len(rids)]
            store.free(rid)
            del model.values[rid], model.safe[rid]
        model.check()
    for rid in list(model.values):
        store.free(rid)
    store.check_integrity()
    assert store.free_capacity() == full
