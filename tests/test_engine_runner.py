"""The step loop: greedy output is exact with speculation on or off, in every draft-state mode,
with sequences of different lengths batched together, and with each request drafting its own
number of tokens (draft_tokens); pools end empty."""
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from baton.proto.public import MAX_DRAFT_TOKENS
from baton.shared.engine.attention import Chunk, StoreAttention
from baton.shared.config import WorkerSection
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence
from baton.shared.kv.store import KVStore
from baton.shared.model.config import FULL, SLIDING
from baton.shared.model.dense_attention import DenseAttention
from tiny_model import tiny_model

pytestmark = pytest.mark.unit
W = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model(61, window=W)


@torch.no_grad()
def dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        L = len(seq)
        h = model.forward_hidden(torch.tensor(seq), torch.arange(L), DenseAttention(model.cfg, 1, L))
        seq.append(int(model.logits(h[-1:]).argmax()))
    return seq[len(prompt):]


def run_aggregated(model, spec: SpecConfig, prompts, max_tokens: int, mode: str = "ring", stop=(), caps=None,
                   params=SamplingParams(), seed: int = 0, pages: int = 200, slots: int = 8, min_tokens: int = 0):
    """caps: each sequence's draft_tokens (None: all use the deployment's K); sampled sequences
    get seeds seed, seed+1, ..."""
    engine = LocalEngine(model, spec, WorkerSection(num_pages=pages, page_size=4, num_slots=slots, kv_mode=mode),
                         prefill_chunk=5)
    caps = caps or [None] * len(prompts)
    seqs = engine.run([Sequence(f"r{i}", p, max_tokens, replace(params, seed=seed + i) if not params.greedy else params,
                                stop_token_ids=frozenset(stop), draft_tokens=cap, min_tokens=min_tokens)
                       for i, (p, cap) in enumerate(zip(prompts, caps))])
    engine.store.check_integrity()
    free = engine.store.free_capacity()
    assert (free.pages, free.slots) == (pages, slots)
    return seqs


PROMPTS = [[3, 1, 4], list(range(1, W + 1)), [(7 * i) % 61 for i in range(5 * W + 3)]]


@pytest.mark.parametrize("spec", [
    SpecConfig(enabled=False),
    *[SpecConfig(True, k, mode) for k in (1, 3, 5) for mode in ("transfer", "rebuild", "cold")],
], ids=lambda s: f"k{s.draft_tokens}-{s.draft_state}" if s.enabled else "off")
def test_greedy_exact(model, spec):
    seqs = run_aggregated(model, spec, PROMPTS, max_tokens=17)
    for s, p in zip(seqs, PROMPTS):
        assert s.output == dense_greedy(model, p, 17)
        assert s.finish_reason == "length" and len(s.output) == 17
        if spec.enabled:
            assert s.stats.verify_steps > 0 and s.stats.drafted == s.stats.verify_steps * spec.draft_tokens


def test_paged_swa_mode_exact(model):
    seqs = run_aggregated(model, SpecConfig(True, 3, "transfer"), PROMPTS, 11, mode="paged")
    assert [s.output for s in seqs] == [dense_greedy(model, p, 11) for p in PROMPTS]


def test_stop_token_mid_chain_emits_nothing_after(model):
    ref = dense_greedy(model, PROMPTS[2], 12)
    stop = ref[4]
    [s] = run_aggregated(model, SpecConfig(True, 5, "rebuild"), [PROMPTS[2]], 12, stop=[stop])
    assert s.output == ref[:ref.index(stop) + 1] and s.finish_reason == "stop"


def test_first_token_can_finish_a_request(model):
    ref = dense_greedy(model, PROMPTS[0], 1)
    for stop in ([], ref):
        [s] = run_aggregated(model, SpecConfig(True, 3, "transfer"), [PROMPTS[0]], 1 if not stop else 5, stop=stop)
        assert s.output == ref and s.finish_reason == ("stop" if stop else "length")


@pytest.mark.parametrize("spec", [SpecConfig(enabled=False), SpecConfig(True, 3, "transfer"),
                                  SpecConfig(True, 5, "rebuild")], ids=["off", "k3", "k5"])
def test_min_tokens_generates_past_stop_tokens_exactly(model, spec):
    """A stop token among the first min_tokens is generated past (it stays in the output), the
    first one after them stops the request; greedy output is the same with speculation on and off."""
    ref = dense_greedy(model, PROMPTS[2], 16)
    stop = ref[0]
    for min_tokens in (0, 1, 3, 16):
        end = next((j + 1 for j, t in enumerate(ref) if t == stop and j + 1 > min_tokens), None)
        [s] = run_aggregated(model, spec, [PROMPTS[2]], 16, stop=[stop], min_tokens=min_tokens)
        assert (s.output, s.finish_reason) == ((ref[:end], "stop") if end else (ref, "length")), min_tokens


def test_prefill_and_start_hands_out_the_first_tokens_before_the_draft_windows(model, monkeypatch):
    """`on_sampled` gets each prompt's first token as soon as it is drawn (decode and the
    aggregated baseline stream it from there), before the draft windows are computed."""
    engine = LocalEngine(model, SpecConfig(True, 3, "transfer"),
                         WorkerSection(num_pages=200, page_size=4, num_slots=8, kv_mode="ring"), prefill_chunk=5)
    seqs = [Sequence(f"r{i}", p, 4) for i, p in enumerate(PROMPTS)]
    for s in seqs:
        engine.store.allocate(s.request_id, engine.reservation(s))
    order = []
    fill = engine.runner.fill_draft_windows
    monkeypatch.setattr(engine.runner, "fill_draft_windows", lambda *a: (order.append("draft windows"), fill(*a)))
    outputs = engine.runner.prefill_and_start(seqs, "transfer", on_sampled=lambda outs: order.append(
        [o.first_token for o in outs]))
    firsts = [dense_greedy(model, p, 1)[0] for p in PROMPTS]
    assert order == [firsts, "draft windows"]
    assert [o.first_token for o in outputs] == [s.output[0] for s in seqs] == firsts


def test_transfer_and_rebuild_accept_identically(model):
    """transfer and rebuild put the same draft state in place, so acceptance matches exactly."""
    t = run_aggregated(model, SpecConfig(True, 3, "transfer"), PROMPTS, 17)
    r = run_aggregated(model, SpecConfig(True, 3, "rebuild"), PROMPTS, 17)
    assert [s.stats.accepted_at for s in t] == [s.stats.accepted_at for s in r]


K = 3
CAPS = [None, 0, 1, 2, K + 4]  # per request: the deployment's K, none, fewer, and more than K (= K)
MIXED = [*PROMPTS, [(5 * i + 2) % 61 for i in range(2 * W + 1)], [9, 9, 9, 9]]


@pytest.mark.parametrize("draft_state", ["transfer", "rebuild", "cold"])
@pytest.mark.parametrize("shift", [0, 2], ids=["caps", "caps-rotated"])
def test_per_request_draft_tokens_keep_greedy_exact(model, draft_state, shift):
    caps = CAPS[shift:] + CAPS[:shift]  # each prompt meets more than one cap
    seqs = run_aggregated(model, SpecConfig(True, K, draft_state), MIXED, 17, caps=caps)
    off = run_aggregated(model, SpecConfig(enabled=False), MIXED, 17, caps=caps)  # no effect with spec off
    for s, o, p, cap in zip(seqs, off, MIXED, caps):
        assert s.output == o.output == dense_greedy(model, p, 17), cap
        assert o.stats.as_dict() == {"verify_steps": 0, "drafted": 0, "accepted": 0}
        k = K if cap is None else min(K, cap)
        if k == 0:
            assert s.stats.as_dict() == {"verify_steps": 0, "drafted": 0, "accepted": 0} and s.stats.per_step == []
        else:
            assert s.stats.verify_steps > 0 and s.stats.drafted == k * s.stats.verify_steps
            assert len(s.stats.accepted_at) == k


def test_per_request_draft_tokens_sample_with_mixed_k(model):
    params = SamplingParams(temperature=0.9, top_p=0.95)
    seqs = run_aggregated(model, SpecConfig(True, K, "transfer"), MIXED, 17, caps=CAPS, params=params, seed=40)
    for s, cap in zip(seqs, CAPS):
        k = K if cap is None else min(K, cap)
        assert s.finish_reason == "length" and len(s.output) == 17
        assert s.stats.drafted == k * s.stats.verify_steps and (s.stats.verify_steps > 0) == (k > 0)
        assert s.stats.accepted <= s.stats.drafted


def test_draft_tokens_zero_decodes_exactly_as_speculation_off_when_sampling(model):
    """With k = 0 for every request the verify forward is the plain decode forward and the accept
    rule draws the bonus token from p as `choose` would: seeded tokens are the same."""
    params = SamplingParams(temperature=1.1)
    zero = run_aggregated(model, SpecConfig(True, K, "transfer"), MIXED, 17, caps=[0] * len(MIXED),
                          params=params, seed=7)
    off = run_aggregated(model, SpecConfig(enabled=False), MIXED, 17, params=params, seed=7)
    assert [s.output for s in zero] == [s.output for s in off]
    assert all(s.stats.verify_steps == 0 for s in zero)


def test_request_bound_is_the_engine_bound():
    """GenerateRequest.draft_tokens is checked against the same 16 the deployment's K is."""
    SpecConfig(True, MAX_DRAFT_TOKENS)
    with pytest.raises(ValueError):
        SpecConfig(True, MAX_DRAFT_TOKENS + 1)


LENGTHS = [1, 3, W - 1, W, W + 1, 2 * W + 3, 5 * W + 3]  # below, at and far above the window


@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("batch", [1, 7, 33])
def test_batches_of_mixed_lengths_and_draft_tokens_are_exact(model, batch, mode):
    """One batch of `batch` sequences, prompt lengths around the window and every k in 0..K (and a
    cap above K), decoded together: each equals the dense reference, token for token."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, 61, (LENGTHS[(i * 3) % len(LENGTHS)],), generator=gen).tolist() for i in range(batch)]
    caps = [None if batch == 1 else i % (K + 2) for i in range(batch)]
    seqs = run_aggregated(model, SpecConfig(True, K, "transfer"), prompts, 13, mode=mode, caps=caps,
                          pages=1024, slots=40)
    for s, p, cap in zip(seqs, prompts, caps):
        assert s.output == dense_greedy(model, p, 13), (len(p), cap)
        assert s.finish_reason == "length"


class DispatchCounter(TorchDispatchMode):
    """Counts tensor ops, and host reads of tensor values (item/int/float/bool, and tolist)."""

    def __enter__(self):
        self.ops, self.syncs, tolist = 0, 0, torch.Tensor.tolist

        def counted(t):
            self.syncs += 1
            return tolist(t)
        self._restore = lambda: setattr(torch.Tensor, "tolist", tolist)
        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_a_decode_step_reads_the_device_once(model, params):
    """Draft -> verify -> accept for a mixed batch reads results back to the host exactly once."""
    engine = LocalEngine(model, SpecConfig(True, K, "transfer"), WorkerSection(num_pages=200, page_size=4, num_slots=8))
    seqs = [Sequence(f"s{i}", p, 40, replace(params, seed=i), draft_tokens=cap)
            for i, (p, cap) in enumerate(zip(MIXED, CAPS))]
    engine.admit(seqs)
    for _ in range(3):
        with DispatchCounter() as counter:
            engine.runner.step(seqs)
        assert counter.syncs == 1


def test_step_metadata_does_not_grow_with_the_number_of_layers(monkeypatch):
    """A forward builds its attention metadata once per pool, whatever the number of layers: a
    2-layer and a 10-layer model with the same two pools build the same metadata, twice (read and
    write rows per pool), and do the same number of tensor ops doing it."""
    builds = []
    for name in ("_read_meta", "_writes"):
        original = getattr(StoreAttention, name)
        monkeypatch.setattr(StoreAttention, name,
                            lambda self, key, *a, _f=original, _n=name: builds.append((_n, key)) or _f(self, key, *a))
    seen = []
    for layers in ((SLIDING, FULL), (SLIDING, FULL) * 5):
        model = tiny_model(61, layers, window=W)
        store = KVStore(model.cfg, mode="ring", num_pages=64, page_size=4, num_slots=4, max_draft_tokens=K)
        for i, n in enumerate((5, 2 * W + 1)):
            store.allocate(f"r{i}", 60)
            store.extend(f"r{i}", n)
        builds.clear()
        with DispatchCounter() as counter:
            StoreAttention(store, [Chunk("r0", 5, K + 1), Chunk("r1", 2 * W + 1, 1)], list(range(len(layers))))
        seen.append((sorted(builds), counter.ops))
    assert seen[0] == seen[1] and len(seen[0][0]) == 4  # 2 pools x (read, write)
