"""Micro-benchmark of kernels/: Triton chunk attention and row pack/unpack against torch.

    python bench/kernels.py --json out/kernels.json            # on a CUDA machine
    python bench/kernels.py --device cpu --small               # CPU: torch rows only (smoke)

Attention cases are verify steps (k+1 = 4 queries per request) and decode (1 query) over a paged
cache with shuffled page tables, GQA 32/8 heads x 128 dims, full attention and a sliding window.
Columns:
  ref ms        kernels.chunk_attention_reference (torch gather + cat + masked SDPA: the CPU path)
  sdpa ms       masked SDPA alone on K/V already gathered and contiguous (no gather: a floor for
                what torch can do, not a usable path)
  splits        ranges of cached keys the automatic split-K rule picks (1: one pass, no merge)
  triton ms     kernels.chunk_attention_triton as served (gathers rows itself; the automatic
                rule: one launch, or split + merge launches when splits > 1)
  1-split ms    the same forced to num_splits=1, only where the rule splits (what splitting gains)
  KV GB/s       K/V bytes the kernel must read / triton time
  max err       |triton - reference| on valid queries (fp32 reference)
Pack cases copy a request's window rows (ring wrap, all layers of a component) into a staging
buffer and back; GB/s = bytes moved one way / time, next to torch index_select / index_copy_.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.kernels.attention import chunk_attention_reference
from baton.kernels.pack import pack_rows_reference, unpack_rows_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timer(device: str, fn, warmup: int, iters: int) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def attention_case(B, Q, ctx, window, H, Hkv, D, dtype, device, page=16, seed=0):
    """A batch of B requests with `ctx` cached positions each, Q new queries, paged rows."""
    g = torch.Generator().manual_seed(seed)
    cached = ctx if window is None else min(ctx, window - 1)
    pages_per_req = -(-ctx // page)
    num_pages = B * pages_per_req
    data = torch.randn(num_pages * page, 2, Hkv, D, generator=g).to(dtype).to(device)
    table = torch.randperm(num_pages, generator=g).view(B, pages_per_req)  # shuffled pages
    pos = torch.arange(ctx - cached, ctx)
    old_rows = (table[:, pos // page] * page + pos % page).to(device)  # [B, M]
    old_pos = pos.expand(B, -1).contiguous().to(device)
    q_pos = torch.arange(ctx, ctx + Q).expand(B, -1).contiguous().to(device)
    q = torch.randn(B, Q, H, D, generator=g).to(dtype).to(device)
    k_new, v_new = (torch.randn(B, Q, Hkv, D, generator=g).to(dtype).to(device) for _ in range(2))
    return (q, q_pos, k_new, v_new, data[:, 0], data[:, 1], old_rows, old_pos, window)


def sdpa_only(args):
    """Masked SDPA on pre-gathered contiguous keys (no gather): torch's floor for this shape."""
    q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window = args
    H, Hkv = q.shape[2], k_new.shape[2]
    keys = torch.cat((k_cache[old_rows], k_new), 1).transpose(1, 2).repeat_interleave(H // Hkv, 1).contiguous()
    values = torch.cat((v_cache[old_rows], v_new), 1).transpose(1, 2).repeat_interleave(H // Hkv, 1).contiguous()
    k_pos = torch.cat((old_pos, q_pos), 1)
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    mask = (delta >= 0) if window is None else (delta >= 0) & (delta < window)
    qt = q.transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask[:, None])


def bench_attention(args, triton_ok: bool) -> list[dict]:
    rows = []
    H, Hkv, D = (8, 2, 32) if args.small else (32, 8, 128)
    batches = (2,) if args.small else (1, 16, 64)
    contexts = (64,) if args.small else (1024, 8192)
    dtype = DTYPES[args.dtype]
    if triton_ok:
        from baton.kernels.chunk_attention_triton import (auto_num_splits, chunk_attention_triton,
                                                           default_block_n)
    for window in (None, 16 if args.small else 4096):
        for ctx in contexts:
            for B in batches:
                for Q in (1, 4):
                    case = attention_case(B, Q, ctx, window, H, Hkv, D, dtype, args.device)
                    row = {"B": B, "Q": Q, "ctx": ctx, "window": window, "dtype": args.dtype}
                    row["ref_ms"] = timer(args.device, lambda: chunk_attention_reference(*case),
                                          args.warmup, args.iters)
                    row["sdpa_ms"] = timer(args.device, sdpa_only(case), args.warmup, args.iters)
                    if triton_ok:
                        M = case[6].shape[1]
                        row["splits"] = auto_num_splits(B, Q, H, Hkv, M, default_block_n())
                        row["triton_ms"] = timer(args.device, lambda: chunk_attention_triton(*case),
                                                 args.warmup, args.iters)
                        if row["splits"] > 1:
                            row["nosplit_ms"] = timer(
                                args.device, lambda: chunk_attention_triton(*case, num_splits=1),
                                args.warmup, args.iters)
                        kv_bytes = 2 * B * (M + Q) * Hkv * D * case[0].element_size()
                        row["kv_gbps"] = kv_bytes / row["triton_ms"] / 1e6
                        ref = chunk_attention_reference(*(a.float() if isinstance(a, torch.Tensor)
                                                          and a.is_floating_point() else a for a in case))
                        row["max_err"] = (chunk_attention_triton(*case).float() - ref).abs().max().item()
                    rows.append(row)
                    print(f"{B:4d} {Q:3d} {ctx:6d} {str(window):>6s} {row['ref_ms']:9.3f} "
                          f"{row['sdpa_ms']:9.3f} {row.get('splits', 0):6d} "
                          f"{row.get('triton_ms', float('nan')):9.3f} "
                          f"{row.get('nosplit_ms', float('nan')):10.3f} "
                          f"{row.get('kv_gbps', float('nan')):8.1f} {row.get('max_err', float('nan')):9.2e}",
                          flush=True)
    return rows


def bench_pack(args, triton_ok: bool) -> list[dict]:
    rows = []
    dtype = DTYPES[args.dtype]
    layers, Hkv, D = (2, 2, 32) if args.small else (32, 8, 128)
    windows = (16,) if args.small else (128, 4096)
    if triton_ok:
        from baton.kernels.pack_triton import pack_rows_triton, unpack_rows_triton
    for W in windows:
        ring, slots = W + 4, 4
        data = torch.randn(layers, slots * ring, 2 * Hkv * D).to(dtype).to(args.device)  # [L, R, E]
        pos = torch.arange(3 * ring + 5 - W + 1, 3 * ring + 5)  # wraps around the ring of slot 1
        idx = (1 * ring + pos % ring).to(args.device)
        staging = torch.empty(layers, len(idx), data.shape[-1], dtype=dtype, device=args.device)
        nbytes = staging.numel() * staging.element_size()
        row = {"layers": layers, "rows": len(idx), "row_bytes": data.shape[-1] * data.element_size(),
               "dtype": args.dtype}
        fns = {"torch_pack": lambda: pack_rows_reference(data, idx, staging),
               "torch_unpack": lambda: unpack_rows_reference(staging, data, idx)}
        if triton_ok:
            fns["triton_pack"] = lambda: pack_rows_triton(data, idx, staging)
            fns["triton_unpack"] = lambda: unpack_rows_triton(staging, data, idx)
        t = {name: timer(args.device, fn, args.warmup, args.iters) for name, fn in fns.items()}
        if triton_ok:
            assert torch.equal(pack_rows_triton(data, idx, staging), data[:, idx])
        row.update({f"{k}_gbps": nbytes / ms / 1e6 for k, ms in t.items()})
        rows.append(row)
        print(f"{layers:4d} {len(idx):6d} {nbytes / 2**20:9.2f} " + " ".join(
            f"{row.get(k + '_gbps', float('nan')):9.1f}"
            for k in ("torch_pack", "triton_pack", "torch_unpack", "triton_unpack")), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    triton_ok = args.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if not triton_ok:
        print("no CUDA device: torch columns only (Triton runs compiled on CUDA; bench/gpu_check.sh)")
    print(f"attention ({args.dtype}, device {args.device})\n"
          f"{'B':>4s} {'Q':>3s} {'ctx':>6s} {'window':>6s} {'ref ms':>9s} {'sdpa ms':>9s} "
          f"{'splits':>6s} {'triton ms':>9s} {'1-split ms':>10s} {'KV GB/s':>8s} {'max err':>9s}")
    attention = bench_attention(args, triton_ok)
    print(f"\npack/unpack ({args.dtype})\n{'L':>4s} {'rows':>6s} {'MiB':>9s} {'torch pk':>9s} "
          f"{'triton pk':>9s} {'torch up':>9s} {'triton up':>9s}   (GB/s)")
    pack = bench_pack(args, triton_ok)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "attention": attention, "pack": pack}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
