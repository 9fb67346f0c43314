"""The step loop: greedy output is exact with speculation on or off, in every draft-state mode,
with sequences of different lengths batched together; pools end empty."""
import pytest
import torch

from baton.shared.engine.local import LocalCapacity, LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sequence import Sequence
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


def run_aggregated(model, spec: SpecConfig, prompts, max_tokens: int, mode: str = "ring", stop=()):
    engine = LocalEngine(model, spec, LocalCapacity(num_pages=200, page_size=4, num_slots=8, mode=mode),
                         prefill_chunk=5)
    seqs = engine.run([Sequence(f"r{i}", p, max_tokens, stop_token_ids=frozenset(stop))
                       for i, p in enumerate(prompts)])
    engine.store.check_integrity()
    free = engine.store.free_capacity()
    assert (free.pages, free.slots) == (200, 8)
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


def test_transfer_and_rebuild_accept_identically(model):
    """transfer and rebuild put the same draft state in place, so acceptance matches exactly."""
    t = run_aggregated(model, SpecConfig(True, 3, "transfer"), PROMPTS, 17)
    r = run_aggregated(model, SpecConfig(True, 3, "rebuild"), PROMPTS, 17)
    assert [s.stats.accepted_at for s in t] == [s.stats.accepted_at for s in r]
