"""NIXL WRITE bandwidth between two processes on one device, next to a same-run `torch` copy of
the same bytes on that device (issue 27).

    python bench/transfer_vram.py --device cuda --json out/gpu/transfer_vram.json
    python bench/transfer_vram.py --device cpu --sizes 1M,16M     # the harness, in DRAM

Each process holds a KV region on `--device` (VRAM on CUDA: registered with NIXL as VRAM and its
device id, as a GPU worker's KVStore is) and an aux region in host memory (DRAM, as the store keeps
it on every device). Each request is one contiguous KV run plus one aux row, sent with
`TransferAgent.write` (the sender's path in prefill); the receiver (a spawned child) only keeps
its agent alive. Columns, medians over `--iters` after `--warmup`, GB/s = 1e9 B/s:
  write   bytes / time of `write()` (post to every WRITE DONE: here a VRAM WRITE and a DRAM one)
  copy    `dst.copy_(src)` of the same bytes within one tensor pair on the device (synchronized)
UCX picks its transports (`UCX_TLS`; cuda_ipc within one GPU when UCX was built with CUDA).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from baton.shared.transfer import AUX_KEY, Descriptor, Region, TransferAgent

AUX_BYTES = 4096
KV = "target/FULL"


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else int(text)


def pools(device: torch.device, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, list[Region]]:
    kv = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # [nbytes] one KV region
    aux = torch.zeros(AUX_BYTES, dtype=torch.uint8, device="cpu", pin_memory=device.type == "cuda")
    kind, dev = ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)
    return kv, aux, [Region(KV, 0, kv.data_ptr(), nbytes, 1 << 20, kind, dev),
                     Region(AUX_KEY, 0, aux.data_ptr(), AUX_BYTES, AUX_BYTES)]


def receiver(conn, device: str, nbytes: int) -> None:
    logging.basicConfig(level=logging.ERROR)  # it ignores the WRITTEN notices of requests it never expected
    asyncio.run(_receive(conn, torch.device(device), nbytes))


async def _receive(conn, device: torch.device, nbytes: int) -> None:
    kv, aux, regions = pools(device, nbytes)
    async with TransferAgent("vram-recv", regions) as agent:
        conn.send((agent.metadata(), regions))
        sender_metadata, sender_regions = await asyncio.to_thread(conn.recv)
        await agent.add_peer("vram-send", sender_metadata, sender_regions)
        conn.send("ready")
        await asyncio.to_thread(conn.recv)  # "stop"


async def send(args, device: torch.device, conn) -> list[dict]:
    capacity = max(args.sizes)
    kv, aux, regions = pools(device, capacity)
    kv.random_(0, 256)
    async with TransferAgent("vram-send", regions) as agent:
        peer_metadata, peer_regions = await asyncio.to_thread(conn.recv)
        await agent.add_peer("vram-recv", peer_metadata, peer_regions)
        conn.send((agent.metadata(), regions))
        await asyncio.to_thread(conn.recv)  # "ready"
        rows, tag = [], 0
        for size in args.sizes:
            plan = [Descriptor(KV, 0, 0, 0, size), Descriptor(AUX_KEY, 0, 0, 0, AUX_BYTES)]
            times = []
            for i in range(args.warmup + args.iters):
                tag += 1
                t0 = time.perf_counter()
                result = await agent.write("vram-recv", plan, tag, 30.0)
                if not result.ok:
                    raise SystemExit(f"WRITE of {size} B failed: {result.error}")
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            rows.append({"bytes": size, "write_gb_s": size / statistics.median(times) / 1e9,
                         "copy_gb_s": size / copy_seconds(kv, size, args) / 1e9})
        conn.send("stop")
    return rows


def copy_seconds(kv: torch.Tensor, size: int, args) -> float:
    src, dst = kv[:size], torch.empty(size, dtype=torch.uint8, device=kv.device)
    times = []
    for i in range(args.warmup + args.iters):
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="1M,16M,64M,256M", help="payloads, comma-separated (K/M/G suffixes)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    device = torch.device(args.device)
    ctx = mp.get_context("spawn")  # CUDA in a child needs spawn
    here, there = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(there, args.device, max(args.sizes)), daemon=True)
    child.start()
    try:
        rows = asyncio.run(send(args, device, here))
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    print(f"NIXL WRITE within {device} (two processes) and a torch copy on it, medians of {args.iters}")
    print(f"{'bytes':>12} {'write GB/s':>11} {'copy GB/s':>10}")
    for r in rows:
        print(f"{r['bytes']:>12} {r['write_gb_s']:>11.2f} {r['copy_gb_s']:>10.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(device), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
