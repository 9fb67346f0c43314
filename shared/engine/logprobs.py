"""Log-probabilities of tokens under the target model, as OpenAI-compatible servers report them.

Values are the log-softmax of the target's raw logits (no temperature, no top-p: vLLM's default,
`raw_logprobs`), so they do not depend on how a token was chosen. With speculation a generated
token's logprob comes from the verify forward at that token's own position, i.e. from the same
target distribution a plain decode step computes there: speculation on and off report the same
values (up to float rounding of a different batch shape). The first generated token's come from
the prompt's last hidden state, which decode has in the aux row (no extra message from prefill).
"""
from __future__ import annotations

import torch

from baton.proto.public import Logprobs

PROMPT_ROWS_PER_PASS = 256  # prompt positions per log-softmax: bounds the [rows, V] float32 buffer


def logprobs_of(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> Logprobs:
    """logits [N, V] at N positions, the token taken at each, and how many most likely alternatives
    each position reports -> their Logprobs (one host read)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]  # [N]
    n = max(tops, default=0)
    if n:
        top_v, top_i = lp.topk(n, dim=-1)  # [N, n], most likely first
        values, ids = torch.cat((chosen[:, None], top_v), 1).tolist(), top_i.tolist()
    else:
        values, ids = chosen[:, None].tolist(), [[] for _ in tokens]
    return Logprobs(token_ids=list(tokens), logprobs=[v[0] for v in values],
                    top_ids=[i[:k] for i, k in zip(ids, tops)], top_logprobs=[v[1:k + 1] for v, k in zip(values, tops)])


def prompt_logprobs(logits_of, hidden: torch.Tensor, prompt: list[int], top: int) -> Logprobs:
    """hidden [L, d] of the prompt's positions -> Logprobs of prompt[1:] (position p's token under
    the distribution the model predicts at p - 1), in passes of PROMPT_ROWS_PER_PASS positions."""
    out = Logprobs()
    for lo in range(0, len(prompt) - 1, PROMPT_ROWS_PER_PASS):
        hi = min(lo + PROMPT_ROWS_PER_PASS, len(prompt) - 1)
        extend(out, logprobs_of(logits_of(hidden[lo:hi]), prompt[lo + 1:hi + 1], [top] * (hi - lo)))
    return out


def extend(log: Logprobs, more: Logprobs) -> None:
    """Append `more` to a sequence's running log in place (its lists grow; the log is engine-owned)."""
    log.token_ids.extend(more.token_ids)
    log.logprobs.extend(more.logprobs)
    log.top_ids.extend(more.top_ids)
    log.top_logprobs.extend(more.top_logprobs)
