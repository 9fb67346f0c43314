"""Sequential small WRITEs between two TransferAgents in two processes, counting the slow ones:
the transfer layer alone (no model, no NATS), so thousands of requests take seconds.

    python bench/write_soak.py --requests 3000 --json out/write_soak.json

Each request writes 1-3 random pages of each component (8 target-full layers, 8 target-SWA
layers, one draft ring) and the aux row, as prefill does, and waits for the receiver's ARRIVED
event. A request slower than --slow-s (or failed at its --deadline-s) is printed with its error;
the table gives write-time percentiles. It found the NIXL thread's lost wake-up (about one request
in 6,000 stalled until its deadline; docs/benchmarks.md, stop 15).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import numpy as np

from baton.shared.transfer import AUX_KEY, Descriptor, Region, TransferAgent

COMPONENTS = (("target/FULL", 8), ("target/SWA", 8), ("draft/SWA_RING", 1))  # (key, layers)
PAGE = 32 << 10
PAGES = 64
AUX_BYTES = 4096
AUX_ROWS = 64


def make_pools() -> dict[tuple[str, int], np.ndarray]:
    pools = {(key, layer): np.zeros(PAGES * PAGE, np.uint8) for key, layers in COMPONENTS for layer in range(layers)}
    pools[AUX_KEY, 0] = np.zeros(AUX_ROWS * AUX_BYTES, np.uint8)
    return pools


def regions_of(pools) -> list[Region]:
    return [Region(key, layer, a.ctypes.data, a.nbytes, AUX_BYTES if key == AUX_KEY else PAGE)
            for (key, layer), a in pools.items()]


def receiver(conn) -> None:
    asyncio.run(_receive(conn))


async def _receive(conn) -> None:
    pools = make_pools()
    async with TransferAgent("soak-decode", regions_of(pools)) as agent:
        conn.send((agent.metadata(), regions_of(pools)))
        while True:
            while not conn.poll():
                await asyncio.sleep(0.0002)
            message = conn.recv()
            if message is None:
                return
            tag, row, deadline_s = message
            agent.arrivals.expect(tag, "soak-send", [key for key, _ in COMPONENTS], row * AUX_BYTES, deadline_s)
            conn.send("ok")
            conn.send((await agent.arrivals.events.get()).kind.value)


def plan(rng, row: int) -> list[Descriptor]:
    descriptors = []
    for key, layers in COMPONENTS:
        n = int(rng.integers(1, 4))
        src, dst = (int(rng.integers(0, PAGES - n)) for _ in range(2))
        descriptors += [Descriptor(key, layer, src * PAGE, dst * PAGE, n * PAGE) for layer in range(layers)]
    return descriptors + [Descriptor(AUX_KEY, 0, row * AUX_BYTES, row * AUX_BYTES, AUX_BYTES)]


async def send(conn, args) -> dict:
    rng = np.random.default_rng(args.seed)
    pools = make_pools()
    seconds, slow = [], []
    async with TransferAgent("soak-send", regions_of(pools)) as agent:
        metadata, regions = conn.recv()
        await agent.add_peer("soak-decode", metadata, regions)
        for i in range(args.requests):
            tag, row = i + 1, i % AUX_ROWS
            conn.send((tag, row, args.deadline_s + 5))
            assert conn.recv() == "ok"
            started = time.monotonic()
            result = await agent.write("soak-decode", plan(rng, row), tag, args.deadline_s)
            seconds.append(time.monotonic() - started)
            arrival = conn.recv()
            if not result.ok or seconds[-1] > args.slow_s:
                slow.append({"request": i, "seconds": seconds[-1], "error": result.error, "receiver": arrival})
                print(f"slow request {i}: {seconds[-1]:.3f} s, {result.status.value} {result.error} "
                      f"(receiver: {arrival})", flush=True)
    conn.send(None)
    ms = sorted(s * 1e3 for s in seconds)
    return {"requests": args.requests, "slow": slow, "p50_ms": statistics.median(ms),
            "p99_ms": ms[int(0.99 * (len(ms) - 1))], "max_ms": ms[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--slow-s", type=float, default=0.5)
    ap.add_argument("--deadline-s", type=float, default=2.0, help="each write's transfer deadline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(child_conn,), daemon=True)
    child.start()
    started = time.monotonic()
    report = asyncio.run(send(conn, args))
    report["seconds"] = time.monotonic() - started
    child.join(10)
    print(f"\n{'requests':>9} {'slow':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>8} {'seconds':>8}\n"
          f"{report['requests']:>9} {len(report['slow']):>5} {report['p50_ms']:>7.2f} {report['p99_ms']:>7.2f} "
          f"{report['max_ms']:>8.1f} {report['seconds']:>8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
