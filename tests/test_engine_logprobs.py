"""Logprobs from the step loop: the target's log-softmax at each emitted token's own position, the
same with speculation on (every k, every draft-state mode, ring and paged) as off, and equal to a
dense forward over the whole sequence; prompt logprobs likewise; cut where a stop ends a request.

The shipped checkpoint, on held-out text: its trained draft gets most drafts accepted, so verify
blocks commit several tokens and each one's logprob must come from its own row (a random draft
would have every draft rejected, and any row mix-up would go unseen)."""
import pytest
import torch

from baton.shared.config import WorkerSection
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.dense_attention import DenseAttention
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer

pytestmark = pytest.mark.unit
TOP = 4


@pytest.fixture(scope="module")
def model():
    return load_model()


def prompts_for(model) -> list[list[int]]:
    """Held-out prompts below, at and well past the sliding window."""
    W, tok = model.cfg.sliding_window, TextTokenizer.load(DEFAULT_MODEL_DIR)
    return [heldout_prompts(tok, 1, n, seed=n)[0] for n in (3, W, 3 * W + 5)]


@torch.no_grad()
def dense_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is log p(. | tokens[:p + 1]) by a plain dense forward."""
    L = len(tokens)
    h = model.forward_hidden(torch.tensor(tokens), torch.arange(L), DenseAttention(model.cfg, 1, L))
    return torch.log_softmax(model.logits(h).float(), -1)


def run(model, spec: SpecConfig, max_tokens: int = 24, mode: str = "ring", params=SamplingParams(), stop=()):
    engine = LocalEngine(model, spec, WorkerSection(num_pages=400, page_size=16, num_slots=8, kv_mode=mode),
                         prefill_chunk=64)
    seqs = [Sequence(f"r{i}", p, max_tokens, params if params.greedy else SamplingParams(1.0, 1.0, seed=i),
                     stop_token_ids=frozenset(stop), logprobs=TOP) for i, p in enumerate(prompts_for(model))]
    return engine.run(seqs)


@pytest.mark.parametrize("spec, mode", [
    (SpecConfig(enabled=False), "ring"),
    (SpecConfig(True, 1, "transfer"), "ring"),
    (SpecConfig(True, 3, "transfer"), "paged"),
    (SpecConfig(True, 3, "rebuild"), "ring"),
    (SpecConfig(True, 5, "cold"), "paged"),
])
def test_greedy_logprobs_are_the_targets_at_each_position(model, spec, mode):
    seqs = run(model, spec, mode=mode)
    if spec.enabled:  # verify blocks committed several tokens at once
        assert sum(s.stats.accepted for s in seqs) > len(seqs)
    for seq in seqs:
        lp = seq.output_logprobs
        assert lp.token_ids == seq.output and len(lp.logprobs) == len(seq.output)
        dense = dense_logprobs(model, seq.prompt + seq.output)[len(seq.prompt) - 1:-1]  # predicts output[i]
        want = dense.gather(-1, torch.tensor(seq.output)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp.logprobs), want, atol=1e-5)
        top_v, top_i = dense.topk(TOP, -1)
        assert lp.top_ids == top_i.tolist()
        assert torch.allclose(torch.tensor(lp.top_logprobs), top_v, atol=1e-5)
        assert lp.top_ids[0][0] == seq.output[0]  # greedy: the chosen token is the most likely


def test_speculation_reports_the_same_logprobs_as_plain_decoding(model):
    plain, spec = run(model, SpecConfig(enabled=False)), run(model, SpecConfig(True, 3, "transfer"))
    for a, b in zip(plain, spec):
        assert a.output == b.output and a.output_logprobs.top_ids == b.output_logprobs.top_ids
        assert torch.allclose(torch.tensor(a.output_logprobs.logprobs), torch.tensor(b.output_logprobs.logprobs),
                              atol=1e-5)


def test_sampled_tokens_get_their_raw_logprobs(model):
    """Raw: the log-softmax without temperature or top-p, whatever the sampling was."""
    for seq in run(model, SpecConfig(True, 3, "transfer"), params=SamplingParams(1.0, 1.0, seed=0)):
        dense = dense_logprobs(model, seq.prompt + seq.output)[len(seq.prompt) - 1:-1]
        want = dense.gather(-1, torch.tensor(seq.output)[:, None])[:, 0]
        assert seq.output_logprobs.token_ids == seq.output
        assert torch.allclose(torch.tensor(seq.output_logprobs.logprobs), want, atol=1e-5)


def test_a_stop_token_cuts_the_logprobs_with_the_tokens(model):
    greedy = run(model, SpecConfig(enabled=False))
    stop = greedy[2].output[5]  # ends the third request inside a verify block's worth of tokens
    for seq in run(model, SpecConfig(True, 3, "transfer"), stop=[stop]):
        assert seq.output_logprobs.token_ids == seq.output
        assert len(seq.output_logprobs.top_ids) == len(seq.output)


def test_prompt_logprobs_score_each_prompt_token_from_the_second(model):
    engine = LocalEngine(model, SpecConfig(True, 3, "transfer"), WorkerSection(num_pages=400, page_size=16,
                                                                               num_slots=8, kv_mode="paged"),
                         prefill_chunk=64)
    seqs = [Sequence(f"p{i}", p, 1, prompt_logprobs=2) for i, p in enumerate(prompts_for(model))]
    for seq in seqs:
        engine.store.allocate(seq.request_id, len(seq.prompt) + 1)
    outputs = engine.runner.prefill(seqs)
    for seq, out in zip(seqs, outputs):
        dense = dense_logprobs(model, seq.prompt)[:-1]  # row p - 1 predicts prompt[p]
        lp = out.prompt_logprobs
        assert lp.token_ids == seq.prompt[1:]
        want = dense.gather(-1, torch.tensor(seq.prompt[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp.logprobs), want, atol=1e-5)
        assert lp.top_ids == dense.topk(2, -1).indices.tolist()
        engine.store.free(seq.request_id)


def test_no_logprobs_unless_asked(model):
    engine = LocalEngine(model, SpecConfig(True, 3, "transfer"))
    seq, = engine.run([Sequence("r", prompts_for(model)[1], 6)])
    assert seq.output_logprobs is None
