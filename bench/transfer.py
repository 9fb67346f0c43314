"""NIXL WRITE bandwidth between two processes, next to same-run in-process copies of the same bytes.

    python bench/transfer.py --json out/transfer.json

The sender (this process) and the receiver (a spawned child) each hold KV-like pools: `--layers`
regions of `--page-kib` pages, plus an aux region. A payload of S bytes is sent in realistic
descriptor shapes: min(layers, S / page) layers, S / (layers * page) pages per layer, page ids
drawn at random on both sides (`--contiguous`: consecutive ids, which NIXL merges into one
descriptor per layer), plus one aux row, through `TransferAgent.write` (prepared per-peer lists,
completion watched by the agent's NIXL thread). Columns (GB/s = 1e9 B/s, medians):
  write    payload / time of `write()` (post to every WRITE DONE)
  arrive   payload / time from `write()` start to the receiver's ARRIVED event
  cma      the same descriptors copied by raw process_vm_writev calls (1024 iovecs per call):
           the ceiling of UCX's cma transport for this shape, without NIXL or Baton
  copy1    contiguous copy of S bytes in this process on one thread (`np.copyto`, a memcpy; a
           NIXL WRITE over cma is one copying thread too)
  copyN    contiguous `dst.copy_(src)` of S bytes with torch (default thread count)
  ratio    write / copy1;  ratioN  write / copyN
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from baton.shared.transfer import AUX_KEY, Descriptor, EventKind, Region, TransferAgent

KV = "target/FULL"
AUX_BYTES = 4096
SIZES = "64K,256K,1M,4M,16M,64M,256M"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def make_pools(layers: int, pages: int, page: int, fill: bool) -> dict[tuple[str, int], np.ndarray]:
    pools = {(KV, layer): np.empty(pages * page, np.uint8) for layer in range(layers)}
    pools[AUX_KEY, 0] = np.empty(4 * AUX_BYTES, np.uint8)
    rng = np.random.default_rng(0)
    for a in pools.values():  # touch every page now: real pools are resident
        a[:] = rng.integers(0, 256, a.size, dtype=np.uint8) if fill else 0
    return pools


def regions_of(pools, page: int) -> list[Region]:
    return [Region(key, layer, a.ctypes.data, a.nbytes, AUX_BYTES if key == AUX_KEY else page)
            for (key, layer), a in pools.items()]


# --- receiver process -------------------------------------------------------------------------
def receiver(conn, layers: int, pages: int, page: int) -> None:
    asyncio.run(_receive(conn, make_pools(layers, pages, page, fill=False), page))


async def _receive(conn, pools, page: int) -> None:
    async with TransferAgent("bench-decode", regions_of(pools, page)) as agent:
        conn.send((agent.metadata(), regions_of(pools, page)))
        while True:
            while not conn.poll():
                await asyncio.sleep(0.0005)
            op, *args = conn.recv()
            if op == "stop":
                return
            if op == "expect":  # (tag, components, aux_offset): ack now, report the event later
                agent.arrivals.expect(args[0], "bench-send", args[1], args[2], 30.0)
                conn.send("ok")
                event = await agent.arrivals.events.get()
                conn.send((event.kind.value, time.monotonic()))
            elif op == "read":  # (component, layer, offset, nbytes)
                key, layer, offset, nbytes = args
                conn.send(pools[key, layer][offset:offset + nbytes].tobytes())


# --- sender -----------------------------------------------------------------------------------
def plan(payload: int, layers: int, pages: int, page: int, rng, contiguous: bool) -> list[Descriptor]:
    used = max(1, min(layers, payload // page))
    per_layer = max(1, payload // (used * page))
    out = []
    for layer in range(used):
        if contiguous:
            src = dst = range(per_layer)
        else:
            src, dst = (rng.choice(pages, per_layer, replace=False) for _ in range(2))
        out += [Descriptor(KV, layer, int(s) * page, int(d) * page, page) for s, d in zip(src, dst)]
    return out + [Descriptor(AUX_KEY, 0, 0, AUX_BYTES, AUX_BYTES)]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_seconds(pid: int, descriptors: list[Descriptor], local: dict, remote: dict) -> float:
    """Time to copy `descriptors` into process `pid` with process_vm_writev, as UCX's cma does."""
    n = len(descriptors)
    src = (_IoVec * n)(*[_IoVec(local[d.component_key, d.layer_index] + d.src_offset, d.nbytes)
                         for d in descriptors])
    dst = (_IoVec * n)(*[_IoVec(remote[d.component_key, d.layer_index] + d.dst_offset, d.nbytes)
                         for d in descriptors])
    writev = ctypes.CDLL(None, use_errno=True).process_vm_writev
    size = ctypes.sizeof(_IoVec)
    t0 = time.monotonic()
    for i in range(0, n, 1024):
        k = min(1024, n - i)
        at = (ctypes.addressof(src) + i * size, ctypes.addressof(dst) + i * size)
        if writev(pid, ctypes.c_void_p(at[0]), k, ctypes.c_void_p(at[1]), k, 0) < 0:
            raise OSError(ctypes.get_errno(), "process_vm_writev")
    return time.monotonic() - t0


async def measure(agent: TransferAgent, conn, pools, payload: int, args, rng, tag: int) -> dict:
    """Each iteration times, back to back so they see the same machine load: one `write()`, its
    arrival, the raw cma copy of its descriptors, and a one-thread memcpy. The multi-threaded torch
    copies run afterwards: torch's OpenMP workers spin after a parallel op and would steal a
    core from the next WRITE."""
    times: dict[str, list[float]] = {k: [] for k in ("write", "arrive", "cma", "copy1")}
    for i in range(args.warmup + args.iters):
        descriptors = plan(payload, args.layers, args.pages, args.page_kib << 10, rng, args.contiguous)
        nbytes = sum(x.nbytes for x in descriptors[:-1])
        if i == 0:
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            dst = torch.ones(nbytes, dtype=torch.uint8)  # touched, like the receiver's pools
            src1, dst1 = src.numpy(), dst.numpy()
        tag += 1
        conn.send(("expect", tag, [KV], AUX_BYTES))
        assert conn.recv() == "ok"
        t0 = time.monotonic()
        result = await agent.write("bench-decode", descriptors, tag, 30.0)
        t1 = time.monotonic()
        while not conn.poll():
            await asyncio.sleep(0.0005)
        kind, arrived = conn.recv()
        assert result.ok and kind == EventKind.ARRIVED.value, (result, kind)
        sample = {"write": t1 - t0, "arrive": arrived - t0,
                  "cma": cma_seconds(args.receiver_pid, descriptors, args.local, args.remote),
                  "copy1": timed(np.copyto, dst1, src1)}
        if i >= args.warmup:
            for k, v in sample.items():
                times[k].append(v)
    times["copyn"] = [timed(dst.copy_, src) for _ in range(args.warmup + args.iters)][args.warmup:]
    d = descriptors[-2]
    conn.send(("read", d.component_key, d.layer_index, d.dst_offset, d.nbytes))
    assert conn.recv() == pools[d.component_key, d.layer_index][d.src_offset:d.src_offset + d.nbytes].tobytes()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"payload_bytes": nbytes, "descriptors": len(descriptors),
            **{f"{k}_gbps": v for k, v in gbps.items()}, "ratio": gbps["write"] / gbps["copy1"],
            "ratio_n": gbps["write"] / gbps["copyn"], "write_ms": statistics.median(times["write"]) * 1e3,
            "tag": tag}


def timed(fn, *args) -> float:
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


async def send(args, conn, pools) -> list[dict]:
    rng = np.random.default_rng(1)
    rows, tag = [], 0
    async with TransferAgent("bench-send", regions_of(pools, args.page_kib << 10)) as agent:
        meta, regions = conn.recv()
        await agent.add_peer("bench-decode", meta, regions)
        args.local = {r.key: r.addr for r in agent.table.regions}
        args.remote = {r.key: r.addr for r in regions}
        for size in args.sizes.split(","):
            row = await measure(agent, conn, pools, parse_size(size), args, rng, tag)
            tag = row.pop("tag")
            rows.append(row)
            print(f"{row['payload_bytes'] / 2**20:9.3f} {row['descriptors']:6d} " + " ".join(
                f"{row[k]:7.2f}" for k in ("write_gbps", "arrive_gbps", "cma_gbps", "copy1_gbps",
                                           "copyn_gbps", "ratio", "ratio_n")), flush=True)
    conn.send(("stop",))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=SIZES, help="payloads, comma-separated (K/M/G suffixes)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64,
                    help="page bytes per layer (64 KiB: 16 tokens x 8 KV heads x 128 dims x K,V x bf16)")
    ap.add_argument("--contiguous", action="store_true", help="consecutive page ids instead of random")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    page = args.page_kib << 10
    largest = max(parse_size(s) for s in args.sizes.split(","))
    args.pages = -(-largest * 5 // (4 * args.layers * page))  # pages per layer region, 25% spare
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(child_conn, args.layers, args.pages, page), daemon=True)
    child.start()
    args.receiver_pid = child.pid
    pools = make_pools(args.layers, args.pages, page, fill=True)
    args.torch_threads = torch.get_num_threads()
    print(f"pages {'contiguous' if args.contiguous else 'random'}, {args.page_kib} KiB, "
          f"torch threads {args.torch_threads}, UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    print(f"{'MiB':>9} {'descs':>6} " + " ".join(f"{c:>7}" for c in
          ("write", "arrive", "cma", "copy1", "copyN", "ratio", "ratioN")))
    rows = asyncio.run(send(args, conn, pools))
    child.join(10)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        args.json.write_text(json.dumps({"bench": "transfer", "layers": args.layers, "page_bytes": page,
                                         "contiguous": args.contiguous, "iters": args.iters,
                                         "torch_threads": args.torch_threads, "ucx_env": env,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
