"""A decode step with glibc's malloc on transparent huge pages (`shared/process.py` child_env,
what `baton up` gives its services) against the default malloc, in paired processes.

    .venv/bin/python bench/malloc_pages.py --pairs 3 --batch 1,8 --seconds 15 --json out/malloc_pages.json
    .venv/bin/python bench/malloc_pages.py --control --pairs 3 --batch 1 --seconds 15   # default vs default

On this shared VM the two vCPUs' speeds differ by up to 12%, and which one is faster changes from
one minute to the next (docs/benchmarks.md, stop 53): more than the effect measured. So the two
variants run as a pair at the same time, each pinned to a core of its own, and again with the cores
swapped; a pair is compared with itself. `--control` runs the default malloc in both processes of
a pair (an A/A test): how far two identical processes differ here. Each process loads the shipped
model into `LocalEngine` (greedy, the worker's default k, one torch thread) and steps `--batch`
held-out 128-token prompts for `--seconds`, afresh every SEQUENCE_STEPS steps; it reports the
median CPU time of a step (the thread's own CPU time: time on the core taken by anything else does
not count), its RSS and its huge pages.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from baton.loadtest import write_json
from baton.shared.config import WorkerSection
from baton.shared.process import child_env

SEQUENCE_STEPS = 40
K = WorkerSection().draft_tokens  # the worker's default k
VARIANTS = ("hugepages", "default")


def worker(cpu: int, seconds: float, batch: int) -> dict:
    """One process: pinned to `cpu`, steps for `seconds`; the median CPU ms of a step. A step
    emits at most k + 1 tokens, so no sequence ends within its SEQUENCE_STEPS."""
    os.sched_setaffinity(0, {cpu})
    import torch

    from baton.shared.engine.local import LocalEngine
    from baton.shared.engine.runner import SpecConfig
    from baton.shared.engine.sequence import Sequence
    from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
    from baton.shared.model.heldout import heldout_prompts
    from baton.shared.model.tokenizer import TextTokenizer

    torch.set_num_threads(1)
    model = load_model(DEFAULT_MODEL_DIR)
    prompts = heldout_prompts(TextTokenizer.load(DEFAULT_MODEL_DIR), batch, 128, seed=7)
    step_ms, end = [], time.monotonic() + seconds
    with torch.inference_mode():
        while time.monotonic() < end:
            engine = LocalEngine(model, SpecConfig(True, K, "transfer"))
            seqs = [Sequence(f"r{i}", p, (K + 1) * SEQUENCE_STEPS) for i, p in enumerate(prompts)]
            engine.admit(seqs)
            for _ in range(SEQUENCE_STEPS):
                start = time.thread_time()
                engine.runner.step(seqs)
                step_ms.append((time.thread_time() - start) * 1e3)
    return {"cpu": cpu, "step_ms": statistics.median(step_ms), "steps": len(step_ms),
            "rss_mib": _kib("/proc/self/status", "VmRSS:") / 1024,
            "anon_huge_mib": _kib("/proc/self/smaps_rollup", "AnonHugePages:") / 1024}


def _kib(path: str, key: str) -> float:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return float(line.split()[1])
    return 0.0


def variant_env(name: str, control: bool) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return child_env(base) if name == "hugepages" and not control else base


def pair(cpus: tuple[int, int], seconds: float, batch: int, control: bool) -> dict[str, dict]:
    """Both variants at once, the first on cpus[0]."""
    procs = {name: subprocess.Popen([sys.executable, __file__, "--worker", str(cpu), str(seconds), str(batch)],
                                    env=variant_env(name, control), stdout=subprocess.PIPE, text=True)
             for name, cpu in zip(VARIANTS, cpus)}
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=seconds + 300)
        if proc.returncode:
            raise SystemExit(f"the {name} process failed ({proc.returncode})")
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        print(json.dumps(worker(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="pairs per batch size, each also run with the cores swapped")
    ap.add_argument("--batch", default="1,8", help="sequences per step, comma-separated")
    ap.add_argument("--seconds", type=float, default=15.0, help="stepping time of one process")
    ap.add_argument("--control", action="store_true", help="the default malloc in both (an A/A test)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the variants of a pair run at the same time")
    rows = []
    if args.control:
        print("control: the default malloc in both columns")
    print(f"{'batch':>5} {'pair':>4} {'cores h/d':>9} {'hugepages ms':>12} {'default ms':>10} {'ratio':>6} "
          f"{'huge MiB h/d':>12} {'RSS MiB h/d':>11}")
    for batch in [int(b) for b in args.batch.split(",")]:
        for i in range(args.pairs):
            for cpus in ((cores[0], cores[1]), (cores[1], cores[0])):
                r = pair(cpus, args.seconds, batch, args.control)
                h, d = r["hugepages"], r["default"]
                rows.append({"batch": batch, "pair": i, **{f"{n}_{k}": v for n in VARIANTS for k, v in r[n].items()}})
                print(f"{batch:>5} {i:>4} {h['cpu']:>4}/{d['cpu']:<4} {h['step_ms']:>12.2f} {d['step_ms']:>10.2f} "
                      f"{h['step_ms'] / d['step_ms']:>6.3f} {h['anon_huge_mib']:>5.0f}/{d['anon_huge_mib']:<6.0f} "
                      f"{h['rss_mib']:>5.0f}/{d['rss_mib']:<5.0f}")
    summary = {}
    for batch in sorted({r["batch"] for r in rows}):
        ratios = [r["hugepages_step_ms"] / r["default_step_ms"] for r in rows if r["batch"] == batch]
        summary[batch] = {"median_ratio": statistics.median(ratios), "hugepages_faster": sum(x < 1 for x in ratios),
                          "pairs": len(ratios)}
        first, second = ("first", "second") if args.control else VARIANTS
        print(f"batch {batch}: {first} / {second} step time, median {summary[batch]['median_ratio']:.3f}; "
              f"{first} faster in {summary[batch]['hugepages_faster']} of {len(ratios)}")
    if args.json:
        write_json({"control": args.control, "rows": rows, "summary": summary}, args.json)


if __name__ == "__main__":
    main()
