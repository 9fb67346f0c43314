"""Presence, frequency and repetition penalties in the step loop: greedy output with speculation
on equals plain decoding and a dense reference that penalises step by step; penalised sampling
with speculation follows the penalised target distribution (chi-square); a continuation counts
the tokens already sent as output."""
import pytest
import torch

from baton.shared.config import WorkerSection
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.config import FULL, SLIDING
from baton.shared.model.dense_attention import DenseAttention
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from test_engine_sampling import chi_square, chi_square_limit, exact_second_token, sample_second_tokens
from tiny_model import tiny_model

pytestmark = pytest.mark.unit
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3)


def penalise(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
             repetition: float) -> torch.Tensor:
    """The reference rule on one position's logits [V] (vLLM's order: repetition, then the others)."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


@torch.no_grad()
def next_logits(model, seq: list[int]) -> torch.Tensor:
    h = model.forward_hidden(torch.tensor(seq), torch.arange(len(seq)), DenseAttention(model.cfg, 1, len(seq)))
    return model.logits(h[-1:])[0]


def dense_penalised_greedy(model, prompt: list[int], n: int, **penalties) -> list[int]:
    out = []
    for _ in range(n):
        logits = penalise(next_logits(model, prompt + out), prompt, out, penalties["presence_penalty"],
                          penalties["frequency_penalty"], penalties["repetition_penalty"])
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def prompts(model):
    W, tok = model.cfg.sliding_window, TextTokenizer.load(DEFAULT_MODEL_DIR)
    return [heldout_prompts(tok, 1, n, seed=n)[0] for n in (5, W, 2 * W + 3)]


def greedy(model, spec: SpecConfig, prompts, n: int, mode: str = "ring", **penalties) -> list[Sequence]:
    engine = LocalEngine(model, spec, WorkerSection(num_pages=400, page_size=16, num_slots=8, kv_mode=mode),
                         prefill_chunk=64)
    seqs = engine.run([Sequence(f"r{i}", p, n, SamplingParams(**penalties)) for i, p in enumerate(prompts)])
    engine.store.check_integrity()
    return seqs


@pytest.mark.parametrize("spec, mode", [
    (SpecConfig(enabled=False), "ring"),
    (SpecConfig(True, 3, "transfer"), "ring"),
    (SpecConfig(True, 5, "rebuild"), "paged"),
])
def test_penalised_greedy_equals_a_dense_reference_with_speculation_on_and_off(model, prompts, spec, mode):
    seqs = greedy(model, spec, prompts, 24, mode, **PENALTIES)
    plain = greedy(model, SpecConfig(enabled=False), prompts, 24)
    for seq, unpenalised in zip(seqs, plain):
        assert seq.output == dense_penalised_greedy(model, seq.prompt, 24, **PENALTIES)
        assert seq.output != unpenalised.output  # the penalties change this output: the check has teeth
    if spec.enabled:  # verify blocks committed several (penalised) tokens at once
        assert sum(s.stats.accepted for s in seqs) > len(seqs)


def test_each_penalty_alone_is_applied(model, prompts):
    for penalties in (dict(presence_penalty=1.5), dict(frequency_penalty=0.8), dict(repetition_penalty=2.0)):
        full = {**dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0), **penalties}
        for seq in greedy(model, SpecConfig(True, 3, "transfer"), prompts[1:2], 16, **penalties):
            assert seq.output == dense_penalised_greedy(model, seq.prompt, 16, **full), penalties


def test_a_continuation_counts_the_tokens_already_sent(model, prompts):
    whole, = greedy(model, SpecConfig(True, 3, "transfer"), prompts[1:2], 20, **PENALTIES)
    sent = whole.output[:7]
    engine = LocalEngine(model, SpecConfig(True, 3, "transfer"), WorkerSection(num_pages=400, page_size=16))
    rest, = engine.run([Sequence("c", prompts[1] + sent, 13, SamplingParams(**PENALTIES), output_in_prompt=len(sent))])
    assert sent + rest.output == whole.output


# --- sampling: the distribution ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_model(24, (SLIDING, FULL), window=4, seed=3, std=0.5)


def test_penalised_sampling_with_speculation_follows_the_penalised_target(tiny):
    prompt, temperature = [1, 5, 7, 2, 9, 3], 0.9
    exact = exact_second_token(tiny, prompt, temperature, lambda logits, out: penalise(
        logits, prompt, out, PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"],
        PENALTIES["repetition_penalty"]))
    stat, dof = chi_square(sample_second_tokens(tiny, prompt, 2000, temperature, **PENALTIES), exact)
    assert stat < chi_square_limit(dof), (stat, dof)
    unpenalised = sample_second_tokens(tiny, prompt, 2000, temperature)
    assert chi_square(unpenalised, exact)[0] > chi_square_limit(dof)  # the check tells the two apart
