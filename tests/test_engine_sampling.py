"""Speculative sampling keeps the target distribution: the accept rule against an analytic case,
and tokens generated through the whole draft -> verify loop against the exact target marginal.
Each test also runs a deliberately biased sampler to show the check would catch it."""
import math

import pytest
import torch

from baton.shared.engine import sampling
from baton.shared.config import WorkerSection
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sampling import BatchSampling, SamplingParams, accept, target_probs
from baton.shared.engine.sequence import Sequence
from baton.shared.model.config import FULL, SLIDING
from baton.shared.model.dense_attention import DenseAttention
from tiny_model import tiny_model

pytestmark = pytest.mark.unit


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over categories with expected count >= 5 (rest pooled), and its dof."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi_square_limit(dof: int, z: float = 4.0) -> float:
    """Upper quantile of chi-square(dof) at about z sigma (Wilson-Hilferty): a fair sampler
    exceeds it with probability ~3e-5."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def test_top_p_keeps_the_smallest_prefix():
    p = target_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 1.0, 0.7)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_top_p_and_temperature_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    p = target_probs(logits, torch.tensor([[1.0], [0.5]]), torch.tensor([[0.7], [1.0]]))
    sharpened = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2
    assert torch.allclose(p, torch.stack([torch.tensor([0.625, 0.375, 0.0, 0.0]), sharpened / sharpened.sum()]))


def one_draft_outputs(n: int, p: torch.Tensor, q: torch.Tensor, rule=accept) -> torch.Tensor:
    """n independent one-draft chains decided at once: draft x ~ q, verify against p."""
    gen = torch.Generator().manual_seed(0)
    V = len(p)
    x = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]  # [n, 1]
    noise = -torch.rand(n, V, generator=gen).log()  # Exp(1)
    accepted, emitted = rule(x, torch.ones(n, dtype=torch.long), q.expand(n, 1, V),
                             p.expand(n, 2, V), torch.rand(n, 1, generator=gen), noise)
    first = torch.where(accepted > 0, x[:, 0], emitted)  # the first token the chain emits
    return torch.bincount(first, minlength=V).float()


def test_accept_rule_matches_target_analytically():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])  # a poor draft: most mass on the wrong token
    counts = one_draft_outputs(20000, p, q)
    stat, dof = chi_square(counts, p)
    assert stat < chi_square_limit(dof), (counts / counts.sum(), p)

    def always_accept(drafts, ks, q, p, uniform, noise):
        return ks.clone(), torch.zeros_like(ks)
    biased = one_draft_outputs(20000, p, q, always_accept)
    assert chi_square(biased, p)[0] > chi_square_limit(dof)  # the check has teeth


def test_residual_and_bonus_draws_follow_the_target():
    """Two drafts, both from a poor q: every emitted position still follows p (chi-square on the
    second token too, which mixes residual draws and the bonus)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.05, 0.15, 0.3, 0.5])
    n, V = 20000, 4
    x = torch.multinomial(q, 2 * n, replacement=True, generator=gen).view(n, 2)
    accepted, emitted = accept(x, torch.full((n,), 2), q.expand(n, 2, V), p.expand(n, 3, V),
                               torch.rand(n, 2, generator=gen), -torch.rand(n, V, generator=gen).log())
    second = torch.where(accepted >= 2, x[:, 1], emitted)[accepted >= 1]  # token 2 of chains that got there
    stat, dof = chi_square(torch.bincount(second, minlength=V).float(), p)
    assert stat < chi_square_limit(dof)


def test_no_drafts_is_plain_sampling():
    """A request with draft_tokens=0 is verified with no drafts: the accept rule then emits the
    target's token at the one position, drawn exactly as `choose` draws it from the same seed."""
    V = 50
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))  # [k+1 = 1, V]
    params = SamplingParams(temperature=0.8, top_p=0.9)
    none = torch.zeros((1, 0), dtype=torch.long)
    for seed in range(20):
        seq = Sequence("a", [1], 4, params, gen=torch.Generator().manual_seed(seed))
        noise = BatchSampling([seq], V, [0])
        accepted, token = accept(none, noise.ks, torch.zeros(1, 0, V), noise.probs(logits[None]), noise.uniform,
                                 noise.emission_noise)
        plain = Sequence("b", [1], 4, params, gen=torch.Generator().manual_seed(seed))
        assert (int(accepted), int(token)) == (0, int(BatchSampling([plain], V).choose(logits)))
    greedy = Sequence("g", [1], 4)
    assert int(BatchSampling([greedy], V).choose(logits)) == int(logits[0].argmax())


def test_choose_draws_each_row_from_its_own_generator():
    """A seeded request draws the same token whatever else is in the batch."""
    V = 40
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=9)

    def seeded(name):
        return Sequence(name, [1], 4, params, gen=torch.Generator().manual_seed(9))
    alone = BatchSampling([seeded("a")], V).choose(logits[1:2])
    mixed = BatchSampling([Sequence("g", [1], 4), seeded("a"), Sequence("s", [1], 4, SamplingParams(1.3))],
                          V).choose(logits)
    assert int(mixed[1]) == int(alone[0]) and int(mixed[0]) == int(logits[0].argmax())


@pytest.fixture(scope="module")
def model():
    return tiny_model(24, (SLIDING, FULL), window=4, seed=3, std=0.5)


@torch.no_grad()
def exact_second_token(model, prompt: list[int], temperature: float, penalise=None) -> torch.Tensor:
    """P(token 2 | prompt) = sum_t1 P(t1 | prompt) P(t2 | prompt, t1), under the target alone;
    `penalise(logits, output)`, if given, turns each position's logits into the penalised ones."""
    def next_probs(out):
        seq = prompt + out
        h = model.forward_hidden(torch.tensor(seq), torch.arange(len(seq)), DenseAttention(model.cfg, 1, len(seq)))
        logits = model.logits(h[-1:])[0]
        return torch.softmax((logits if penalise is None else penalise(logits, out)) / temperature, -1)
    p1 = next_probs([])
    return sum(p1[t] * next_probs([t]) for t in range(len(p1)))


def sample_second_tokens(model, prompt, n, temperature, **penalties) -> torch.Tensor:
    engine = LocalEngine(model, SpecConfig(True, 3, "transfer"), WorkerSection(num_pages=4000, page_size=4, num_slots=500))
    counts = torch.zeros(model.cfg.vocab_size)
    for batch in range(n // 500):
        seqs = [Sequence(f"s{batch}-{i}", prompt, 3, SamplingParams(temperature, 1.0, seed=batch * 500 + i, **penalties))
                for i in range(500)]
        for s in engine.run(seqs):
            assert s.stats.verify_steps >= 1  # token 2 came out of a draft -> verify step
            counts[s.output[1]] += 1
    return counts


def test_speculative_tokens_follow_the_target_distribution(model, monkeypatch):
    prompt, temperature = [1, 5, 7, 2, 9, 3], 0.9
    exact = exact_second_token(model, prompt, temperature)
    counts = sample_second_tokens(model, prompt, 2000, temperature)
    stat, dof = chi_square(counts, exact)
    assert stat < chi_square_limit(dof), (stat, dof)

    original = sampling.accept

    def greedy_accept(drafts, ks, q, p, uniform, noise):  # biased: accepts every draft
        accepted, emitted = original(drafts, ks, q, p, uniform, noise)
        return ks.clone(), emitted
    monkeypatch.setattr("baton.shared.engine.sampling.accept", greedy_accept)
    biased = sample_second_tokens(model, prompt, 2000, temperature)
    assert chi_square(biased, exact)[0] > chi_square_limit(dof)
