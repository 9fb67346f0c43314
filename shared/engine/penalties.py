"""Presence, frequency and repetition penalties (OpenAI's two, vLLM's third), applied to the
target's logits before temperature, top-p and the accept rule, and to the draft's the same way.

    repetition r:  a token seen in the prompt or the output so far: l -> l / r if l > 0, else l * r
    frequency f:   l -> l - f * (times the token is in the output so far)
    presence p:    l -> l - p * (1 if the token is in the output so far)

(vLLM's order: repetition first.) "So far" is per position: in a verify block, position j also
counts the drafts before it, which are output if position j's token is ever emitted; likewise at
each draft of a chain. So every position is penalised exactly as plain decoding would penalise it
there: greedy output is the same with speculation on or off, and sampled output keeps the
penalised target's distribution (the accept rule compares penalised p with the penalised q the
drafts were drawn from). Logprobs stay raw (vLLM's default): they are not penalised.
"""
from __future__ import annotations

import torch

from .sequence import Sequence


class Penalties:
    """The penalised rows of a batch: their counts and factors, for one step."""

    def __init__(self, seqs: list[Sequence], vocab: int, device: torch.device | str = "cpu") -> None:
        self.rows = [b for b, s in enumerate(seqs) if s.params.penalised]  # host ints
        if not self.rows:
            return
        picked = [seqs[b] for b in self.rows]
        for s in picked:
            _count(s, vocab)
        self.index = torch.tensor(self.rows, device=device)
        self.counts = torch.stack([s.output_counts for s in picked]).to(device)  # [Np, V] output so far
        self.in_prompt = torch.stack([s.prompt_seen for s in picked]).to(device)  # [Np, V] bool
        column = lambda name: torch.tensor([[getattr(s.params, name)] for s in picked], device=device)  # noqa: E731
        self.presence, self.frequency = column("presence_penalty"), column("frequency_penalty")  # [Np, 1]
        self.repetition = column("repetition_penalty")  # [Np, 1]

    @property
    def any(self) -> bool:
        return bool(self.rows)

    def at_positions(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """A verify block: logits [Np, J, V] of the penalised rows at J positions, drafts [Np, >= J-1]
        the tokens before positions 1..J-1 (position j counts drafts[:, :j] as output)."""
        Np, J, V = logits.shape
        counts = self.counts[:, None, :].expand(Np, J, V)
        if J > 1:
            seen = torch.nn.functional.one_hot(drafts[:, :J - 1], V).to(counts.dtype).cumsum(1)  # [Np, J-1, V]
            counts = counts + torch.cat((counts.new_zeros(Np, 1, V), seen), 1)
        return self._penalise(logits, counts, slice(None))

    def after(self, logits: torch.Tensor, rows: torch.Tensor, before: torch.Tensor | None) -> torch.Tensor:
        """A draft chain's next position: logits [n, V] of penalised rows `rows` (indices into
        this step's penalised rows), before [n, j] the chain's tokens so far (or None)."""
        counts = self.counts[rows]  # [n, V]
        if before is not None and before.shape[1]:
            counts = counts + torch.nn.functional.one_hot(before, counts.shape[-1]).to(counts.dtype).sum(1)
        return self._penalise(logits[:, None], counts[:, None], rows)[:, 0]

    def _penalise(self, logits: torch.Tensor, counts: torch.Tensor, rows) -> torch.Tensor:
        """logits, counts [n, J, V] -> penalised logits; rows: which penalised rows they are."""
        rep = self.repetition[rows][:, :, None]  # [n, 1, 1]
        seen = (counts > 0) | self.in_prompt[rows][:, None, :]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - self.frequency[rows][:, :, None] * counts - self.presence[rows][:, :, None] * (counts > 0)


def _count(seq: Sequence, vocab: int) -> None:
    """A penalised sequence's counts, made on first use; `Sequence.emit` keeps them up to date."""
    if seq.output_counts is None:
        output = seq.prompt[len(seq.prompt) - seq.output_in_prompt:] + seq.output
        with torch.inference_mode(False):  # emit updates it in place, also outside the step's inference mode
            device = seq.device
            seq.output_counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=device),
                                               minlength=vocab).float()
            seq.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seq.prompt_seen[torch.tensor(seq.prompt, dtype=torch.long, device=device)] = True
