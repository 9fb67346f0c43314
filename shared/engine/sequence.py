"""One request as the engine sees it: tokens, KV progress, draft state and statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.proto.public import Logprobs

from .sampling import SamplingParams

DECODE_SEED_SALT = 0x5BD1E995  # decode draws from a different stream than prefill's first token


@dataclass
class SpecStats:
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted count per draft position
    per_step: list[int] = field(default_factory=list)  # drafts accepted at each verify step, in order

    def record(self, k: int, accepted: int) -> None:
        self.per_step.append(accepted)
        self.verify_steps += 1
        self.drafted += k
        self.accepted += accepted
        if len(self.accepted_at) < k:
            self.accepted_at.extend([0] * (k - len(self.accepted_at)))
        for j in range(accepted):
            self.accepted_at[j] += 1

    def acceptance_length(self, first_tokens: int | None = None) -> float:
        """Tokens committed per verify step, over the whole request or over the verify steps
        that produced its first `first_tokens` decode tokens."""
        steps, committed = 0, 0
        for accepted in self.per_step:
            if first_tokens is not None and committed >= first_tokens:
                break
            steps, committed = steps + 1, committed + accepted + 1
        return committed / steps if steps else 0.0

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "drafted": self.drafted, "accepted": self.accepted}


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    draft_tokens: int | None = None  # a cap on the deployment's K for this request (0: no drafts)
    min_tokens: int = 0  # a stop token among the first this many is generated past, not stopped at
    logprobs: int | None = None  # report each output token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # prefill reports the same for the prompt's tokens
    output: list[int] = field(default_factory=list)  # generated tokens, the first one included
    length: int = 0  # target KV positions 0..length-1 are committed
    draft_len: int = 0  # draft entries below this position are valid
    draft_floor: int = 0  # lowest draft position that holds an entry
    pending_hidden: torch.Tensor | None = None  # [length - draft_len + 1, d]: h_{draft_len-1..length-1}
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    gen: torch.Generator | None = None
    device: torch.device | str = "cpu"  # the engine's: where `gen` lives and penalty counts are made
    output_logprobs: Logprobs | None = None  # aligned with `output`, when `logprobs` is asked for
    output_counts: torch.Tensor | None = None  # [V] float: times each token is in `output` (penalties.py)
    prompt_seen: torch.Tensor | None = None  # [V] bool: the prompt's tokens (repetition penalty)
    output_in_prompt: int = 0  # the prompt's last this many tokens were output (a continuation's): penalties count them

    def __post_init__(self) -> None:
        if self.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = Logprobs()
        if self.gen is None and not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, (), device="cpu"))
            self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def token_span(self, lo: int, hi: int) -> list[int]:
        """tokens[lo:hi] without building the whole list."""
        P = len(self.prompt)
        if lo >= P:
            return self.output[lo - P:hi - P]
        return self.prompt[lo:hi] + self.output[:max(0, hi - P)]

    @property
    def last_token(self) -> int:
        return self.output[-1]

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)

    def emit(self, tokens: list[int]) -> list[int]:
        """Append generated tokens up to max_tokens or a stop token after the first min_tokens;
        returns what was appended."""
        taken = []
        for t in tokens:
            if self.finish_reason:
                break
            taken.append(t)
            self.output.append(t)
            if self.output_counts is not None:
                self.output_counts[t] += 1
            if t in self.stop_token_ids and len(self.output) > self.min_tokens:
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        return taken
