"""Sequential requests through a real cluster, counting the ones that stall: a WRITE that never
completes shows up as a request slower than the transfer deadline (then failed and retried).

    BATON_WORKER_TRANSFER_DEADLINE_S=3 python bench/soak.py --requests 3000 --json out/soak.json

Short deadlines make a stall cost seconds instead of 30 s. Prints how many requests took longer
than --slow-s and each one's index and time; the workers' logs name the stuck WRITEs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from e2e_cluster import running_cluster  # noqa: E402

from baton.proto import subjects  # noqa: E402
from baton.proto.public import GenerateReply, GenerateRequest  # noqa: E402
from baton.shared.bus import Bus  # noqa: E402


async def soak(url: str, requests: int, slow_s: float) -> list[tuple[int, float]]:
    slow = []
    async with await Bus.connect(url, "soak") as bus:
        for i in range(requests):
            started = time.monotonic()
            await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[5 + i % 50] * 16, max_tokens=1),
                              GenerateReply, timeout=120)
            if (took := time.monotonic() - started) > slow_s:
                slow.append((i, took))
                print(f"slow request {i}: {took:.2f} s", flush=True)
    return slow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--slow-s", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with running_cluster(worker_args=["--num-pages", "1024"]) as cluster:
        started = time.monotonic()
        slow = asyncio.run(soak(cluster.nats_url, args.requests, args.slow_s))
        seconds = time.monotonic() - started
        log_dir = cluster.log_dir
    print(f"\n{'requests':>9} {'slow':>5} {'seconds':>8}\n{args.requests:>9} {len(slow):>5} {seconds:>8.1f}"
          f"\nlogs: {log_dir}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"requests": args.requests, "slow_s": args.slow_s, "seconds": seconds,
                                         "slow": slow}, indent=2))


if __name__ == "__main__":
    main()
