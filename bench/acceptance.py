"""MTP draft acceptance on held-out prompts, through the engine's own step loop (in-process).

    python bench/acceptance.py --prompts 32 --prompt-len 128 --max-tokens 128 --k 3 --json out/acceptance.json

Acceptance length tau = tokens committed per target verify forward (accepted drafts + 1).
Greedy verification; prompts are slices of the held-out plays (bench/heldout.txt).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer


def summarize(seqs, k: int) -> dict:
    steps = sum(s.stats.verify_steps for s in seqs)
    accepted = sum(s.stats.accepted for s in seqs)
    per_pos = [sum(s.stats.accepted_at[j] for s in seqs if len(s.stats.accepted_at) > j) / steps for j in range(k)]
    return {"verify_steps": steps, "accepted": accepted, "acceptance_length": (accepted + steps) / steps,
            "per_position_acceptance": per_pos}


def run(model, prompts, max_tokens: int, spec: SpecConfig, batch: int) -> tuple[list, float]:
    engine = LocalEngine(model, spec)
    seqs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs += engine.generate(prompts[i:i + batch], max_tokens)
    return seqs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = load_model(args.model)
    prompts = heldout_prompts(TextTokenizer.load(args.model), args.prompts, args.prompt_len)
    off, t_off = run(model, prompts, args.max_tokens, SpecConfig(enabled=False), args.batch)
    on, t_on = run(model, prompts, args.max_tokens, SpecConfig(True, args.k, "transfer"), args.batch)
    assert [s.output for s in on] == [s.output for s in off], "speculation changed greedy output"
    result = summarize(on, args.k)
    tokens = sum(len(s.output) for s in on)
    result.update(k=args.k, prompts=args.prompts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                  batch=args.batch, tokens=tokens, tok_s_spec=tokens / t_on, tok_s_off=tokens / t_off)
    print(f"{'k':>3} {'tau':>6} " + " ".join(f"{'acc@' + str(j + 1):>7}" for j in range(args.k))
          + f" {'tok/s spec':>11} {'tok/s off':>10}")
    print(f"{args.k:>3} {result['acceptance_length']:>6.3f} "
          + " ".join(f"{a:>7.3f}" for a in result["per_position_acceptance"])
          + f" {result['tok_s_spec']:>11.1f} {result['tok_s_off']:>10.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
