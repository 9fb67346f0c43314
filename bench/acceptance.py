"""MTP draft acceptance on held-out prompts, through the engine's own step loop (in-process).

    python bench/acceptance.py --prompts 32 --prompt-len 128 --max-tokens 128 --ks 1,3,5 \
        --baseline-rev HEAD~1 --json out/acceptance.json

Acceptance length tau = tokens committed per target verify forward (accepted drafts + 1), over the
whole request and over its first 16 generated tokens (tau@16). acc@j = share of verify steps whose
first j drafts were all accepted. Greedy verification; prompts are slices of the held-out plays
(bench/heldout.txt). For every k the draft starts from its transferred window ("transfer"); at the
middle k also from nothing ("cold"), which shows how much the draft leans on the transferred state.
With --baseline-rev the checkpoint as it was at that git revision is measured in the same run,
interleaved, on the same prompts. Every configuration's output must equal speculation off.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def checkpoint_at(rev: str, model_dir: Path, into: Path) -> Path:
    """Write the checkpoint in `model_dir` as it was at git revision `rev` into `into`."""
    relative = model_dir.resolve().relative_to(ROOT)
    for name in CHECKPOINT_FILES:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{relative / name}"],
                              check=True, capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into


def summarize(seqs, k: int) -> dict:
    steps = sum(s.stats.verify_steps for s in seqs)
    accepted = sum(s.stats.accepted for s in seqs)
    per_pos = [sum(s.stats.accepted_at[j] for s in seqs if len(s.stats.accepted_at) > j) / steps for j in range(k)]
    return {"verify_steps": steps, "accepted": accepted, "acceptance_length": (accepted + steps) / steps,
            "acceptance_length_first16": sum(s.stats.acceptance_length(16) for s in seqs) / len(seqs),
            "per_position_acceptance": per_pos}


def run(model, prompts, max_tokens: int, spec: SpecConfig, batch: int) -> tuple[list, float]:
    engine = LocalEngine(model, spec)
    seqs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs += engine.generate(prompts[i:i + batch], max_tokens)
    return seqs, time.perf_counter() - t0


def configurations(ks: list[int]) -> list[tuple[int, str]]:
    return [(k, "transfer") for k in ks] + [(ks[len(ks) // 2], "cold")]


def measure(model, prompts, args, ks: list[int]) -> list[dict]:
    off, t_off = run(model, prompts, args.max_tokens, SpecConfig(enabled=False), args.batch)
    rows = []
    for k, mode in configurations(ks):
        on, t_on = run(model, prompts, args.max_tokens, SpecConfig(True, k, mode), args.batch)
        assert [s.output for s in on] == [s.output for s in off], f"k={k} {mode}: speculation changed greedy output"
        tokens = sum(len(s.output) for s in on)
        rows.append({"k": k, "mode": mode, **summarize(on, k), "tokens": tokens,
                     "tok_s_spec": tokens / t_on, "tok_s_off": tokens / t_off})
    return rows


def print_table(results: dict[str, list[dict]], width: int) -> None:
    print(f"{'model':<10} {'k':>2} {'mode':<9} {'tau':>6} {'tau@16':>7} "
          + " ".join(f"{'acc@' + str(j + 1):>6}" for j in range(width)) + f" {'tok/s spec':>11} {'tok/s off':>10}")
    for name, rows in results.items():
        for r in rows:
            acc = [f"{a:>6.3f}" for a in r["per_position_acceptance"]] + [f"{'':>6}"] * (width - r["k"])
            print(f"{name:<10} {r['k']:>2} {r['mode']:<9} {r['acceptance_length']:>6.3f} "
                  f"{r['acceptance_length_first16']:>7.3f} " + " ".join(acc)
                  + f" {r['tok_s_spec']:>11.1f} {r['tok_s_off']:>10.1f}")
    for name, rows in results.items():
        c = next(r for r in rows if r["mode"] == "cold")
        t = next(r for r in rows if r["mode"] == "transfer" and r["k"] == c["k"])
        print(f"{name}: transfer vs cold at k={c['k']}: tau@16 "
              f"{100 * (t['acceptance_length_first16'] / c['acceptance_length_first16'] - 1):+.1f}%, "
              f"whole request {100 * (t['acceptance_length'] / c['acceptance_length'] - 1):+.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--baseline-rev", help="also measure the checkpoint as it was at this git revision")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,3,5", help="draft lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        models = {"current": args.model}
        if args.baseline_rev:
            models = {f"@{args.baseline_rev}": checkpoint_at(args.baseline_rev, args.model, Path(tmp)), **models}
        prompts = heldout_prompts(TextTokenizer.load(args.model), args.prompts, args.prompt_len)
        results = {name: measure(load_model(path), prompts, args, ks) for name, path in models.items()}
    print(f"{args.prompts} held-out prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens, "
          f"greedy, batch {args.batch}")
    print_table(results, max(ks))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "model": str(args.model)},
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
