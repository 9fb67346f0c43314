"""Token sampling and the speculative accept rule.

Temperature 0 is greedy (argmax). Otherwise the target distribution is p = top_p(softmax(l / T)).
Speculative verification of a chain of drafts x_1..x_k sampled from q_1..q_k (gpt-fast style):

    for j in 1..k:  accept x_j with probability min(1, p_j(x_j) / q_j(x_j))
                    on rejection: emit a token from normalise(max(0, p_j - q_j)) and stop
    all accepted:   emit a bonus token from p_{k+1}

which leaves the emitted tokens distributed exactly as sampling from p one token at a time.
Under greedy both p and q are one-hot, so this reduces to "accept the longest prefix of drafts
equal to the target's argmax, then emit the target's argmax".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature and top-p (not for greedy)."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
    keep = (sorted_p.cumsum(-1) - sorted_p) < params.top_p  # smallest prefix reaching top_p
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=gen))


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Next token from logits [V]; also returns the distribution it came from (None if greedy)."""
    if params.greedy:
        return int(logits.argmax()), None
    probs = target_probs(logits[None], params)[0]
    return draw(probs, gen), probs


def accept_drafts(drafts: list[int], draft_probs: list[torch.Tensor | None], target_logits: torch.Tensor,
                  params: SamplingParams, gen: torch.Generator | None) -> tuple[int, int]:
    """drafts x_1..x_k, their q_j [V] (None if greedy), target_logits [k+1, V] at the verified
    positions -> (number of drafts accepted, the token emitted after them)."""
    if params.greedy:
        best = target_logits.argmax(-1).tolist()  # [k+1]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == best[accepted]:
            accepted += 1
        return accepted, best[accepted]
    p = target_probs(target_logits, params)  # [k+1, V]
    for j, (x, q) in enumerate(zip(drafts, draft_probs)):
        if float(torch.rand((), generator=gen)) * q[x] < p[j, x]:  # u < p/q without dividing
            continue
        residual = (p[j] - q).clamp_min(0)
        if residual.sum() <= 0:  # p == q: any rejection is measure-zero; fall back to p
            residual = p[j]
        return j, draw(residual / residual.sum(), gen)
    return len(drafts), draw(p[len(drafts)], gen)
