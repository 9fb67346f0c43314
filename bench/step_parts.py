"""Where one decode step's time goes, in process: the engine's own step at a batch size, with
its parts timed by wrapping them (a perf_counter around each call; the wrapping costs ~1 us a call).

    python bench/step_parts.py --batch 15 --json out/step_parts.json

`LocalEngine` (the decode service's `ModelRunner` and store), greedy, speculation on with the
worker's default k, over held-out prompts of `--prompt-len` tokens; after `--warmup` steps the
sequences have grown (each step adds ~tau tokens), so a full layer reads prompt + warm-up tokens.
Per step: the whole step, then each part's total and its calls; parts nest (`draft_first` holds
its layer's fused ops), so they do not add up to the step. `draft_first` is the draft forward over
the tokens the last verify accepted, `draft_chain` each of the chain's one-token forwards.
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from baton.kernels import cpu_fused
from baton.loadtest import write_json
from baton.shared.config import WorkerSection
from baton.shared.engine.attention import StoreAttention
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sequence import Sequence
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.model import BatonLM
from baton.shared.model.tokenizer import TextTokenizer

FUSED_OPS = ("paged_attention", "attention_input", "attention_output_mlp")


class Parts:
    """Seconds and calls per part, from wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, part=None) -> None:
        """Time owner.name; `part(args)` names the part per call (default: the function's name)."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            label = part(args) if part else name
            self.seconds[label] += time.perf_counter() - start
            self.calls[label] += 1
            return result

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=15)
    ap.add_argument("--k", type=int, default=WorkerSection().draft_tokens)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=40, help="steps before timing")
    ap.add_argument("--steps", type=int, default=20, help="steps timed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(DEFAULT_MODEL_DIR)
    prompts = heldout_prompts(TextTokenizer.load(DEFAULT_MODEL_DIR), args.batch, args.prompt_len, seed=7)
    parts = Parts()
    for op in FUSED_OPS:
        parts.wrap(cpu_fused, op)
    parts.wrap(BatonLM, "logits")
    batch = args.batch
    parts.wrap(BatonLM, "draft_hidden", lambda a: "draft_first" if a[1].shape[0] > batch else "draft_chain")
    parts.wrap(StoreAttention, "__init__", lambda a: "attention metadata")
    engine = LocalEngine(model, SpecConfig(True, args.k, "transfer"))
    room = model.cfg.max_position_embeddings - args.prompt_len - 2 * (args.k + 1)  # more than the steps emit
    seqs = [Sequence(f"r{i}", p, room) for i, p in enumerate(prompts)]
    engine.admit(seqs)
    with torch.inference_mode():
        for _ in range(args.warmup):
            engine.runner.step(seqs)
        parts.clear()
        emitted = sum(len(s.output) for s in seqs)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.runner.step(seqs)
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
    tokens = (sum(len(s.output) for s in seqs) - emitted) / args.steps
    result = {"batch": batch, "k": args.k, "threads": args.threads, "length": seqs[0].length,
              "step_ms": step_ms, "tokens_per_step": tokens,
              "parts": {p: {"ms_per_step": s / args.steps * 1e3, "calls_per_step": parts.calls[p] / args.steps}
                        for p, s in sorted(parts.seconds.items(), key=lambda kv: -kv[1])}}
    print(f"batch {batch}, k {args.k}, a sequence at {result['length']} positions: step {step_ms:.2f} ms, "
          f"{tokens:.1f} tokens a step")
    for part, r in result["parts"].items():
        print(f"  {part:<22} {r['ms_per_step']:6.2f} ms/step  {r['calls_per_step']:4.1f} calls")
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
