"""Token sampling and the speculative accept rule, vectorised over a batch.

Temperature 0 is greedy (argmax). Otherwise the target distribution is p = top_p(softmax(l / T)),
with T and top_p per row. Sampling from p uses the exponential race (gpt-fast's
`multinomial_sample_one_no_sync`): argmax(p / E) with E ~ Exp(1) i.i.d. per token is distributed
exactly as p, needs no normalisation and no host sync. Each sampled sequence draws its noise from
its own generator, so a seeded request is reproducible whatever else is in the batch.

Speculative verification of a chain of drafts x_1..x_k sampled from q_1..q_k (gpt-fast style):

    for j in 1..k:  accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
                    on rejection: emit a token from normalise(max(0, p_j - q_j)) and stop
    all accepted:   emit a bonus token from p_{k+1}

which leaves the emitted tokens distributed exactly as sampling from p one token at a time.
Under greedy both p and q are one-hot, so this reduces to "accept the longest prefix of drafts
equal to the target's argmax, then emit the target's argmax". Here all rows and positions are
decided at once: accepted = number of leading accepts (a cumulative product), and the emitted
token is drawn at that position from max(0, p - q) with q = 0 past the drafts (the bonus).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.kernels.cpu_fused import argmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # penalties.py
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, wire, seed: int | None) -> "SamplingParams":
        """From the protocol's SamplingParams (proto/internal.py), with the seed this side draws from."""
        return cls(wire.temperature, wire.top_p, seed, wire.presence_penalty, wire.frequency_penalty,
                   wire.repetition_penalty)

    @property
    def penalised(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor | float,
                 top_p: torch.Tensor | float) -> torch.Tensor:
    """logits [N, V], temperature and top_p [N, 1] (or scalars) -> probabilities [N, V] after
    temperature and top-p (the smallest prefix of the sorted distribution reaching top_p)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if isinstance(top_p, float) and top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)
    return out / out.sum(-1, keepdim=True)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [..., V], noise [..., V] ~ Exp(1) -> tokens [...] distributed as probs (unnormalised ok)."""
    return argmax(probs / noise)


def accept(drafts: torch.Tensor, ks: torch.Tensor, q: torch.Tensor, p: torch.Tensor, uniform: torch.Tensor,
           noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept rule for N chains at once.

    drafts [N, K] (row n drafted ks[n] <= K tokens; the rest is padding), q [N, K, V] the draft
    distributions (zero past ks[n]), p [N, K+1, V] the target's at the verified positions,
    uniform [N, K] ~ U(0, 1), noise [N, V] ~ Exp(1) for the emitted token
    -> (accepted [N], emitted token [N])."""
    N, K = drafts.shape
    drafted = torch.arange(K, device=drafts.device) < ks[:, None]  # [N, K]
    q = q * drafted[:, :, None]
    x = drafts[:, :, None]  # [N, K, 1]
    p_x, q_x = p[:, :K].gather(-1, x)[..., 0], q.gather(-1, x)[..., 0]  # [N, K]
    ok = (uniform * q_x < p_x) & drafted  # u < p/q without dividing
    accepted = ok.long().cumprod(-1).sum(-1)  # [N] leading accepts
    rows = torch.arange(N, device=drafts.device)
    p_at = p[rows, accepted]  # [N, V] target at the first rejected position (or the bonus)
    q_at = torch.cat((q, q.new_zeros(N, 1, q.shape[-1])), dim=1)[rows, accepted]  # [N, V] zero for the bonus
    residual = (p_at - q_at).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)  # p == q: fall back to p
    return accepted, race(residual, noise)


class BatchSampling:
    """Per step: which rows of a batch sample (the rest are greedy), their temperature and top-p,
    and the randomness each sampled row draws from its own generator for the step.

    drafts[b]: how many tokens sequence b drafts this step (K = the most of any row). Row b draws
    (k_b + 1) * V + k_b uniforms in one call, laid out [emission V | V per draft | one per draft
    for the accept test], so a step without drafts draws exactly what a plain decode step draws;
    the draw is then padded to K drafts (padding is never used: drafts past k_b are not verified)."""

    def __init__(self, seqs, vocab: int, drafts: list[int] | None = None,
                 device: torch.device | str = "cpu") -> None:
        drafts = drafts or [0] * len(seqs)
        V, K = vocab, max(drafts, default=0)
        self.rows = [b for b, s in enumerate(seqs) if not s.params.greedy]  # host ints
        if not self.rows:
            return
        picked, ks = [seqs[b] for b in self.rows], [drafts[b] for b in self.rows]
        self.index = torch.tensor(self.rows, device=device)
        self.ks = torch.tensor(ks, device=device)  # [Ns]
        self.temperature = torch.tensor([[s.params.temperature] for s in picked], device=device)  # [Ns, 1]
        # [Ns, 1], or 1.0 when no row truncates: target_probs then skips the sort over V
        self.top_p = (torch.tensor([[s.params.top_p] for s in picked], device=device)
                      if any(s.params.top_p < 1.0 for s in picked) else 1.0)
        raw = torch.stack([_padded(torch.rand((k + 1) * V + k, generator=s.gen, device=s.gen.device), V, k, K)
                           for s, k in zip(picked, ks)]).to(device)  # [Ns, (K+1)V + K]
        noise = -raw[:, :(K + 1) * V].clamp_min(1e-30).log()  # Exp(1)
        self.emission_noise = noise[:, :V]  # [Ns, V]
        self.draft_noise = noise[:, V:].view(len(picked), K, V)  # [Ns, K, V]
        self.uniform = raw[:, (K + 1) * V:]  # [Ns, K]

    @property
    def any(self) -> bool:
        return bool(self.rows)

    def probs(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """logits [n, J, V] of the sampled rows (all, or those `rows` of them) -> p [n, J, V],
        each row with its own temperature and top-p."""
        n, J, V = logits.shape
        t, top_p = self.temperature if rows is None else self.temperature[rows], self.top_p
        if isinstance(top_p, torch.Tensor):
            top_p = (top_p if rows is None else top_p[rows]).repeat_interleave(J, 0)
        return target_probs(logits.reshape(n * J, V), t.repeat_interleave(J, 0), top_p).view(n, J, V)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> next token [B]: argmax for greedy rows, a draw from p for the others."""
        tokens = argmax(logits)
        if self.rows:
            p = self.probs(logits[self.index][:, None])[:, 0]  # [Ns, V]
            tokens[self.index] = race(p, self.emission_noise)
        return tokens


def _padded(draw: torch.Tensor, V: int, k: int, K: int) -> torch.Tensor:
    """One row's draw for k drafts, padded to K drafts (0.5: any value in (0, 1) will do)."""
    pad = torch.full(((K - k) * V,), 0.5, device=draw.device)
    return torch.cat((draw[:(k + 1) * V], pad, draw[(k + 1) * V:], pad[:K - k]))
