"""What the registry costs JetStream with several routers and workers, idle and under load.

    python bench/registry_load.py --routers 2 --prefill 4 --decode 4 --minutes 10 --json out/registry_load.json

Starts a nats-server with its monitoring port, then registry, `--prefill` + `--decode` workers and
one router (tests/e2e_cluster.py), and measures three phases in one run: one router idle, every
router idle (the others started after phase 1), every router under load (a client keeps
`--concurrency` short requests in flight over `baton.v1.generate`, which the routers share as a
queue group) until `--minutes` have passed since phase 1 began. Every few seconds it reads
nats-server's `/jsz` (JetStream API calls and errors, consumers on the server, the workers'
bucket's last sequence = writes to it) and prints per phase: API calls/s, bucket writes/s,
consumers, API errors, next to the heartbeat rate (workers / `HEARTBEAT_S`: each heartbeat is one
bucket write) and the routers' registry lookups per second they make (routers / refresh interval,
answered from the registry's in-memory view of its bucket watch, no JetStream call). JetStream
load that grew with routers x workers would show as API calls or writes per second rising from
phase 1 to phase 2. At the end: replies that were not a whole answer, and every log line of any
service that says "maximum consumers".
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from e2e_cluster import running_cluster  # noqa: E402

from baton.proto import subjects  # noqa: E402
from baton.proto.errors import BatonError  # noqa: E402
from baton.proto.public import GenerateReply, GenerateRequest  # noqa: E402
from baton.services.router.directory import Directory  # noqa: E402
from baton.services.worker import HEARTBEAT_S  # noqa: E402
from baton.shared.bus import Bus  # noqa: E402
from baton.shared.bus.server import NatsServer, free_port  # noqa: E402
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR  # noqa: E402

SAMPLE_S = 5.0


def jsz(monitor: int) -> dict:
    """API calls and errors, consumers, and the summed last sequence of every stream (the
    workers' bucket is the only one the services write to)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/jsz?streams=true", timeout=5) as r:
        z = json.load(r)
    streams = [s for a in z.get("account_details", []) for s in a.get("stream_detail", [])]
    return {"t": time.monotonic(), "api": z["api"]["total"], "api_errors": z["api"]["errors"],
            "consumers": z["consumers"], "writes": sum(s["state"]["last_seq"] for s in streams),
            "streams": [s["name"] for s in streams]}


async def sample_until(monitor: int, seconds: float, samples: list[dict]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(jsz(monitor))
        await asyncio.sleep(min(SAMPLE_S, max(end - time.monotonic(), 0.0)))
    samples.append(jsz(monitor))


def rates(samples: list[dict]) -> dict:
    first, last = samples[0], samples[-1]
    seconds = last["t"] - first["t"]
    return {"seconds": round(seconds, 1), "api_per_s": (last["api"] - first["api"]) / seconds,
            "writes_per_s": (last["writes"] - first["writes"]) / seconds,
            "api_errors": last["api_errors"] - first["api_errors"],
            "consumers_max": max(s["consumers"] for s in samples)}


async def load(url: str, concurrency: int, seconds: float, prompts: list[list[int]]) -> dict:
    """Keep `concurrency` requests in flight for `seconds`; count whole replies and failures."""
    counts = {"ok": 0, "failed": 0, "errors": []}
    end = time.monotonic() + seconds

    async def client(i: int) -> None:
        async with await Bus.connect(url, f"bench-{i}") as bus:
            n = 0
            while time.monotonic() < end:
                p = prompts[(i + n * concurrency) % len(prompts)]
                n += 1
                try:
                    reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=p, max_tokens=16),
                                              GenerateReply, timeout=120)
                    whole = len(reply.token_ids) == 16 or reply.finish_reason == "stop"
                    counts["ok" if whole else "failed"] += 1
                except BatonError as exc:
                    counts["failed"] += 1
                    counts["errors"].append(str(exc)[:200])

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=10.0, help="from the first phase to the end of the load")
    ap.add_argument("--idle-s", type=float, default=60.0, help="length of each idle phase")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from baton.shared.model.heldout import heldout_prompts
    from baton.shared.model.tokenizer import TextTokenizer
    prompts = heldout_prompts(TextTokenizer.load(DEFAULT_MODEL_DIR), 32, 48, seed=3)
    store, monitor = tempfile.TemporaryDirectory(prefix="baton-bench-js-"), free_port()
    conf = Path(store.name) / "nats.conf"
    conf.write_text(f"http_port: {monitor}\n")
    server = NatsServer(store_dir=store.name, config_file=conf).start()
    phases: dict[str, dict] = {}
    try:
        with running_cluster(nats_url=server.url, prefill=args.prefill, decode=args.decode) as cluster:
            started = time.monotonic()
            samples: list[dict] = []
            asyncio.run(sample_until(monitor, args.idle_s, samples))
            phases["1 router, idle"] = rates(samples)
            for _ in range(args.routers - 1):
                cluster.spawn("router", ["--model", str(DEFAULT_MODEL_DIR)], cluster.log_dir)
            wait_for_routers(cluster, args.routers)
            samples = []
            asyncio.run(sample_until(monitor, args.idle_s, samples))
            phases[f"{args.routers} routers, idle"] = rates(samples)
            remaining = args.minutes * 60 - (time.monotonic() - started)
            samples = []

            async def loaded() -> dict:
                sampler = asyncio.create_task(sample_until(monitor, remaining, samples))
                counts = await load(server.url, args.concurrency, remaining, prompts)
                await sampler
                return counts
            counts = asyncio.run(loaded())
            phases[f"{args.routers} routers, load c={args.concurrency}"] = rates(samples)
            log_dir = Path(cluster.log_dir)
            consumer_errors = [f"{p.name}: {line.strip()[:200]}" for p in sorted(log_dir.glob("*.log"))
                               for line in p.read_text(errors="replace").splitlines() if "maximum consumers" in line]
            streams = samples[-1]["streams"]
    finally:
        server.stop()
        store.cleanup()
    workers = args.prefill + args.decode
    heartbeats = workers / HEARTBEAT_S
    lookups = args.routers / inspect.signature(Directory).parameters["refresh_s"].default
    print(f"\n{workers} workers ({args.prefill} prefill, {args.decode} decode), up to {args.routers} routers; "
          f"streams: {', '.join(streams)}")
    print(f"{'phase':<28} {'seconds':>8} {'API calls/s':>12} {'writes/s':>9} {'heartbeats/s':>13} "
          f"{'consumers':>10} {'API errors':>11}")
    for name, r in phases.items():
        print(f"{name:<28} {r['seconds']:>8.1f} {r['api_per_s']:>12.2f} {r['writes_per_s']:>9.2f} "
              f"{heartbeats:>13.1f} {r['consumers_max']:>10} {r['api_errors']:>11}")
    print(f"router lookups of the registry: {lookups:.1f}/s with {args.routers} routers "
          f"(answered from the registry's watch of its bucket)")
    print(f"load: {counts['ok']} whole replies, {counts['failed']} not; "
          f"'maximum consumers' in the logs: {len(consumer_errors)}")
    for line in consumer_errors[:10] + counts["errors"][:10]:
        print("  " + line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "phases": phases,
                                         "heartbeats_per_s": heartbeats, "lookups_per_s": lookups,
                                         "load": counts, "maximum_consumers_lines": consumer_errors}, indent=2))


def wait_for_routers(cluster, n: int, timeout_s: float = 120.0) -> None:
    """Until `n` routers serve their metrics (a router subscribes to its subjects before that)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(m["role"] == "router" for m in cluster.metrics) >= n:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{n} routers did not start within {timeout_s:g} s")


if __name__ == "__main__":
    main()
