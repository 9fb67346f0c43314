"""The training-time-test unroll sees what decode's chained draft sees: its logits at every level
equal the engine's own chained draft logits for the same context."""
import torch

from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sequence import Sequence
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.dense_attention import DenseAttention
from baton.shared.model.draft_training import ChainAttention, unroll_draft
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from tiny_model import tiny_model

K = 3


def engine_draft_logits(model, engine, seq) -> list[torch.Tensor]:
    """One decode step of `seq`; returns the draft's logits of its K chained steps, [V] each."""
    calls, logits = [], model.logits
    model.logits = lambda h: calls.append(out := logits(h)) or out
    try:
        engine.runner.step([seq])
    finally:
        del model.logits
    return [c[0] for c in calls[:K]]  # the chain's K draft calls come before the verify call


def unrolled_logits(model, ids: list[int], at: int) -> list[torch.Tensor]:
    """The unroll over `ids`; level j's logits at draft position at + j (draft index at + j - 1)."""
    L = len(ids)
    with torch.no_grad():
        h = model.forward_hidden(torch.tensor(ids), torch.arange(L), DenseAttention(model.cfg, 1, L))
        levels = unroll_draft(model, h.view(1, L, -1), torch.tensor([ids]), K)
        return [model.logits(g[0, at + j - 1]) for j, g in enumerate(levels)]


def test_unroll_equals_the_engines_chained_drafts():
    model = tiny_model(vocab=97, window=8, seed=3)
    engine = LocalEngine(model, SpecConfig(True, K, "transfer"))
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = Sequence("r", prompt, max_tokens=12)
    engine.store.allocate("r", engine.reservation(seq))
    with torch.inference_mode():
        outputs = engine.runner.prefill([seq])
        engine.runner.fill_draft_windows([seq], [outputs[0]])
        engine.runner.start_decode(seq, outputs[0].first_token, outputs[0].hidden[-1:], "transfer")
    for _ in range(4):  # later steps start their chain after a catch-up over rejected positions
        committed, last = seq.prompt + seq.output, seq.length
        with torch.inference_mode():
            drafted = engine_draft_logits(model, engine, seq)
        ids = committed + [int(d.argmax()) for d in drafted[:-1]]  # the chain's own tokens
        for j, (want, got) in enumerate(zip(drafted, unrolled_logits(model, ids, last))):
            assert torch.allclose(got, want, atol=1e-4), f"level {j} at position {last + j}"


def test_chain_mask_matches_decode_visibility():
    model = tiny_model(vocab=31, window=4)
    mask = ChainAttention(model.cfg, 1, 10).mask(2)  # [S, 3S]
    p = 7
    committed = [x for x in range(10) if mask[p, x]]
    chain = [(i, x) for i in (1, 2) for x in range(10) if mask[p, i * 10 + x]]
    assert committed == [4, 5]  # level 0 up to p-2, within the window of 4 (p-3..p)
    assert chain == [(1, 6), (2, 7)]  # the chain's own entries at p-1 (level 1) and p (level 2)


def test_greedy_output_does_not_depend_on_the_draft_weights():
    """Retraining the draft moves only acceptance: the real checkpoint's greedy output is the same
    with its trained draft, with a scrambled draft, and with speculation off."""
    prompts = heldout_prompts(TextTokenizer.load(DEFAULT_MODEL_DIR), 4, 80, seed=5)
    trained, scrambled = load_model(), load_model()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in scrambled.named_parameters():
            if name.startswith("mtp."):
                p.copy_(p[torch.randperm(p.shape[0], generator=gen)])  # same statistics, wrong rows
    scrambled.pack()
    off = LocalEngine(trained, SpecConfig(enabled=False)).generate(prompts, 40)
    runs = {name: LocalEngine(m, SpecConfig(True, K, "transfer")).generate(prompts, 40)
            for name, m in (("trained", trained), ("scrambled", scrambled))}
    for name, seqs in runs.items():
        assert [(s.output, s.finish_reason) for s in seqs] == [(s.output, s.finish_reason) for s in off], name
    accepted = {name: sum(s.stats.accepted for s in seqs) for name, seqs in runs.items()}
    assert accepted["scrambled"] < accepted["trained"] / 2, accepted  # the draft really differed
