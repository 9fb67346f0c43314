"""The CPU kernels a decode step runs, each against its alternative, on this machine.

    python bench/cpu_ops.py --threads 1 --json out/cpu_ops.json

Projections: every projection of the shipped model (QKV, o, gate/up, down, MTP eh_proj, LM
head) through each kernel `Linear.pack` can run (oneDNN's prepacked GEMM, BLAS mm over the
transposed weight), in turn, so that the weights are as cold as in a step; us per projection,
best of 5, at 1, 16 and 96 rows (a draft forward at batch 1 and 16, a verify at batch 16, k = 5).
Fused ops: each of kernels/cpu_fused.py's ops against its torch reference (argmax: torch.argmax
over 2048-wide logits rows), us per call, best of
5, at the row counts of a step. `load_model`'s own choice (`projection=auto`) is printed too.
Attention: `paged_attention` against its reference (gather the rows, then SDPA) for one layer call
of the shipped model's shapes (4 query heads, 2 KV heads, head_dim 64): B sequences of Q queries
over S rows each (a draft: Q = 1 over a sliding layer's ~70 rows; a k = 5 verify: Q = 6 over a
sliding layer's ~80 or a full layer's ~330 or ~440), each sequence's rows its pages of 16 rows as the
store hands them out after requests came and went (scattered over a cache four times the batch's
rows), the keys past its length masked.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from baton.kernels import cpu_fused
from baton.loadtest import write_json
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.layers import PROJECTION_KERNELS, Linear, onednn_packs


def best_us(fn, calls: int, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def projections(model, rows: list[int]) -> dict:
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kernels = [k for k in PROJECTION_KERNELS if k != "onednn" or onednn_packs(torch.float32)]
    out = {}
    for kernel in kernels:
        for m in linears:
            m.pack(kernel)
        for r in rows:
            xs = [torch.randn(r, m.in_features) for m in linears]
            out[f"{kernel}@{r}"] = best_us(lambda: [m.forward(x) for m, x in zip(linears, xs)], len(linears))
    model.pack(model.projection)  # back to load_model's choice
    return out


def fused_ops(rows: list[int]) -> dict:
    ext, out = cpu_fused.extension(), {}
    if ext is None:
        return out
    for r in rows:
        x, d, w = torch.randn(r, 256), torch.randn(r, 256), torch.randn(256)
        qkv, wq, cos, sin = torch.randn(r, 8, 64), torch.randn(6, 64), torch.randn(r, 1, 64), torch.randn(r, 1, 64)
        logits = torch.randn(r, 2048)  # the shipped model's vocabulary
        cases = {"rms_norm": ((x, w, 1e-6), cpu_fused.rms_norm_reference, ext.rms_norm),
                 "argmax": ((logits,), lambda t: t.argmax(-1), ext.argmax),
                 "add_rms_norm": ((x, d, w, 1e-6), cpu_fused.add_rms_norm_reference, ext.add_rms_norm),
                 "qk_norm_rope": ((qkv, wq, cos, sin, 1e-6), cpu_fused.qk_norm_rope_reference, ext.qk_norm_rope)}
        for name, (args, reference, fused) in cases.items():
            out[f"{name}@{r}"] = {"reference": best_us(lambda: [reference(*args) for _ in range(200)], 200),
                                  "fused": best_us(lambda: [fused(*args) for _ in range(200)], 200)}
    return out


PAGE = 16  # worker.page_size's default


def attention_ops(shapes: list[tuple[int, int, int]]) -> dict:
    ext, out = cpu_fused.extension(), {}
    if ext is None:
        return out
    for B, Q, S in shapes:
        pages = -(-S // PAGE)  # per sequence
        cache = torch.randn(4 * B * pages * PAGE, 2, 2, 64)
        q = torch.randn(B, Q, 4, 64)
        page_ids = torch.randperm(4 * B * pages)[:B * pages].view(B, pages, 1)  # scattered, as after churn
        rows = (page_ids * PAGE + torch.arange(PAGE)).view(B, -1)[:, :S].contiguous()  # [B, S]
        length = torch.linspace(S // 2, S, B).long().view(B, 1)  # keys past a sequence's length: not readable
        q_pos = (length - Q + torch.arange(Q)).contiguous()  # [B, Q]: the last Q readable rows are the chunk's own
        key_pos = torch.where(torch.arange(S) < length, torch.arange(S), -1)  # [B, S]
        args = (q, cache, rows, key_pos, q_pos, None)
        out[f"B{B} Q{Q} S{S}"] = {"reference": best_us(lambda: [cpu_fused.paged_attention_reference(*args)
                                                                 for _ in range(20)], 20),
                                  "fused": best_us(lambda: [ext.paged_attention(*args[:5], 0) for _ in range(20)], 20)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(DEFAULT_MODEL_DIR)
    with torch.inference_mode():
        result = {"threads": args.threads, "auto_choice": model.projection,
                  "projections_us": projections(model, [1, 16, 96]), "fused_us": fused_ops([1, 6, 16, 96]),
                  "attention_us": attention_ops([(1, 1, 70), (1, 6, 80), (1, 6, 330), (16, 1, 70), (16, 6, 80),
                                                 (16, 6, 330), (16, 6, 440)])}
    print(f"projections, us each (load_model chose {model.projection}):")
    for key, us in result["projections_us"].items():
        print(f"  {key:<12} {us:8.1f}")
    print("fused ops, us per call: torch reference / fused")
    for key, r in result["fused_us"].items():
        print(f"  {key:<18} {r['reference']:8.1f} / {r['fused']:6.1f}")
    print("attention of one layer call, us: gather + SDPA / paged_attention")
    for key, r in result["attention_us"].items():
        print(f"  {key:<18} {r['reference']:8.1f} / {r['fused']:6.1f}")
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
