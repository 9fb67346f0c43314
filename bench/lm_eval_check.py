"""lm-evaluation-harness against Baton's HTTP door, next to lm-eval's own `hf` backend on the same
checkpoint: the scores, every request's loglikelihood and every generation must agree.

    .venv/bin/python -m pip install "lm_eval[api,hf]==0.4.13"   # once; adds packages, upgrades none
    .venv/bin/python bench/lm_eval_check.py --docs 40 --json out/lm_eval.json

Two tasks, built from the held-out text (bench/heldout.txt, never trained on) into `--work`:

- `baton_heldout_choice` (multiple_choice, i.e. loglikelihood requests): a context of 96 tokens;
  choices are its true next 16 tokens and three 16-token spans from elsewhere in the text. Baton
  serves these as completions with `echo: true, logprobs: 1, max_tokens: 1` (lm-eval's
  `local-completions`): the prompt's logprobs.
- `baton_heldout_continuation` (generate_until): a context of 96 tokens, greedy until a blank
  line or 32 tokens; exact match against the true continuation.

Baton runs as a cluster with its HTTP door (`tests/e2e_cluster.running_cluster`, speculation on,
k = 3), lm-eval's `local-completions` sends token ids (`tokenized_requests`, its default) with
`num_concurrent` requests in flight. The `hf` backend runs the same tasks in-process in float32.
Both log every sample (`--log_samples`); the script pairs them by document and reports the
largest loglikelihood difference, how many is_greedy flags and generations differ, and both
backends' metrics.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR  # noqa: E402
from baton.shared.model.heldout import HELDOUT_TEXT  # noqa: E402
from baton.shared.model.tokenizer import TextTokenizer  # noqa: E402

CONTEXT, CHOICE, DISTRACTORS = 96, 16, 3
CHOICE_TASK, GEN_TASK = "baton_heldout_choice", "baton_heldout_continuation"


def build_tasks(work: Path, docs: int, seed: int) -> None:
    """Two JSONL datasets and their task YAMLs under `work` (lm-eval's --include_path)."""
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    ids = tok.encode(HELDOUT_TEXT.read_text())
    rng = random.Random(seed)
    span = CONTEXT + CHOICE
    choice_docs, gen_docs = [], []
    for _ in range(docs):
        at = rng.randrange(0, len(ids) - span)
        context, true = tok.decode(ids[at:at + CONTEXT]), tok.decode(ids[at + CONTEXT:at + span])
        others = [tok.decode(ids[o:o + CHOICE]) for o in rng.sample(range(0, len(ids) - CHOICE), DISTRACTORS)]
        choices = [true, *others]
        rng.shuffle(choices)
        choice_docs.append({"context": context, "choices": choices, "label": choices.index(true)})
        gen_docs.append({"context": context, "target": tok.decode(ids[at + CONTEXT:at + CONTEXT + 32])})
    work.mkdir(parents=True, exist_ok=True)
    for name, rows in ((CHOICE_TASK, choice_docs), (GEN_TASK, gen_docs)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{context}}\"\n"
    (work / f"{CHOICE_TASK}.yaml").write_text(
        f"task: {CHOICE_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {work / CHOICE_TASK}.jsonl\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n" + _metrics("acc", "acc_norm"))
    (work / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {work / GEN_TASK}.jsonl\n"
        "output_type: generate_until\ndoc_to_target: \"{{target}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 32\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n" + _metrics("exact_match"))


def _metrics(*names: str) -> str:
    return "".join(f"  - metric: {n}\n    aggregation: mean\n    higher_is_better: true\n" for n in names)


def run_lm_eval(model: str, model_args: str, work: Path, out: Path, extra: list[str]) -> dict:
    """One lm_eval CLI run over both tasks; returns {"results": ..., "samples": {task: [rows]}}."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--tasks", f"{CHOICE_TASK},{GEN_TASK}", "--include_path", str(work), "--output_path", str(out),
           "--log_samples", *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    samples = {}
    for task in (CHOICE_TASK, GEN_TASK):
        path = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return {"results": results["results"], "samples": samples}


def compare(baton: dict, hf: dict) -> dict:
    """Per document: loglikelihood differences (every choice), is_greedy and generation mismatches."""
    worst, greedy_diff, n_ll = 0.0, 0, 0
    for b, h in zip(baton["samples"][CHOICE_TASK], hf["samples"][CHOICE_TASK], strict=True):
        assert b["doc_id"] == h["doc_id"]
        for (b_ll, b_greedy), (h_ll, h_greedy) in zip((r[0] for r in b["resps"]), (r[0] for r in h["resps"]),
                                                      strict=True):
            worst = max(worst, abs(float(b_ll) - float(h_ll)))
            greedy_diff += bool(b_greedy) != bool(h_greedy)
            n_ll += 1
    gen_pairs = list(zip(baton["samples"][GEN_TASK], hf["samples"][GEN_TASK], strict=True))
    gen_diff = [b["doc_id"] for b, h in gen_pairs if b["resps"][0][0] != h["resps"][0][0]]
    return {"loglikelihoods": n_ll, "max_abs_ll_diff": worst, "is_greedy_mismatches": greedy_diff,
            "generations": len(gen_pairs), "generation_mismatches": gen_diff}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=40, help="documents per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent against Baton")
    ap.add_argument("--work", type=Path, default=Path("out/lm_eval"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        sys.exit("lm_eval is not installed: .venv/bin/python -m pip install \"lm_eval[api,hf]==0.4.13\"")
    from e2e_cluster import running_cluster

    tasks = args.work / "tasks"
    build_tasks(tasks, args.docs, args.seed)
    started = time.time()
    port = free_port()
    with running_cluster(http_port=port) as cluster:
        del cluster
        baton = run_lm_eval("local-completions",
                            f"model={DEFAULT_MODEL_DIR.name},base_url=http://127.0.0.1:{port}/v1/completions,"
                            f"tokenizer={DEFAULT_MODEL_DIR},tokenizer_backend=huggingface,"
                            f"num_concurrent={args.concurrent},max_length=4096",
                            tasks, args.work / "baton", [])
    baton_s = time.time() - started
    started = time.time()
    hf = run_lm_eval("hf", f"pretrained={DEFAULT_MODEL_DIR},dtype=float32", tasks, args.work / "hf",
                     ["--device", "cpu", "--batch_size", "1"])
    hf_s = time.time() - started
    diff = compare(baton, hf)
    metrics = {backend: {task: {k: v for k, v in r[task].items() if isinstance(v, (int, float))}
                         for task in (CHOICE_TASK, GEN_TASK)}
               for backend, r in (("baton", baton["results"]), ("hf", hf["results"]))}
    print(f"\n{'task':<28} {'metric':<14} {'baton':>10} {'hf':>10}")
    for task in (CHOICE_TASK, GEN_TASK):
        for metric, value in metrics["baton"][task].items():
            if "stderr" not in metric:
                print(f"{task:<28} {metric:<14} {value:>10.4f} {metrics['hf'][task].get(metric, float('nan')):>10.4f}")
    print(f"\nloglikelihoods compared: {diff['loglikelihoods']}, max |baton - hf| = {diff['max_abs_ll_diff']:.2e}, "
          f"is_greedy mismatches: {diff['is_greedy_mismatches']}")
    print(f"generations compared: {diff['generations']}, mismatches: {len(diff['generation_mismatches'])} "
          f"{diff['generation_mismatches'] or ''}")
    print(f"wall time: baton {baton_s:.0f} s (cluster start included), hf {hf_s:.0f} s")
    result = {"docs": args.docs, "seed": args.seed, "metrics": metrics, "comparison": diff,
              "wall_s": {"baton": baton_s, "hf": hf_s}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    ok = diff["max_abs_ll_diff"] <= 1e-4 and not diff["generation_mismatches"] and not diff["is_greedy_mismatches"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
