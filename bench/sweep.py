"""Disaggregated vs aggregated, in one run: a concurrency sweep with the same harness and workload.

    python bench/sweep.py --concurrency 1,2,4 --requests 16 --max-tokens 32 --json out/sweep.json
    python bench/sweep.py --input-len 32,1024 ...        # long prompts arriving among short ones

(a) disaggregated: a nats-server plus registry, router, prefill and decode processes, as `baton up`
    starts them (baton/up.py start_cluster); prefill and decode get --threads torch threads each
    and, where the machine has a core for each, cores of their own (`engine_cpus`). With the
    router's default `prefill_on_decode_tokens` (256), a short prompt that arrives while decode
    runs nothing is prefilled by decode itself (at c = 1, nearly every one);
    `BATON_ROUTER_PREFILL_ON_DECODE_TOKENS=0 python bench/sweep.py ...` sends every prompt
    through prefill and the hand-off.
(b) aggregated: one process doing prefill and decode on one store
    (`python -m baton.services.aggregated`), with --agg-threads torch threads (default: --threads,
    like each disaggregated engine process), on the cores the disaggregated decode gets.
Each system gets its own nats-server; both are started once and stay up, and `baton bench`
(baton/loadtest.py) drives one at a time over the public API (the other idles). Prints both
tables and a side-by-side one; writes JSON (and PNGs with --plot and matplotlib). Keep the
defaults small on a 2-core machine: they finish in minutes.

--rounds N measures each level N times per system, the two systems' turns back to back and
alternating which goes first (A B, B A, A B, ...), so a machine whose speed drifts within minutes
(a shared VM) slows both alike; it then prints each round and the disaggregated / aggregated
tok/s ratio per level and round, with the median.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from baton import loadtest
from baton.services.aggregated import launch
from baton.shared.bus import NatsServer
from baton.shared.config import WorkerSection
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.up import engine_cpus, start_cluster, wait_ready

SYSTEMS = ("disaggregated", "aggregated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which to run, comma-separated")
    ap.add_argument("--concurrency", default="1,2,4", help="levels, comma-separated")
    ap.add_argument("--requests", type=int, default=16, help="measured requests per level")
    ap.add_argument("--input-len", default="128", help="prompt tokens: N, LOW:HIGH or A,B,...")
    ap.add_argument("--max-tokens", default="32", help="max_tokens: N, LOW:HIGH or A,B,...")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-itl-ms", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--spec", choices=("mtp", "off"), default="mtp")
    ap.add_argument("--draft-tokens", type=int, default=WorkerSection().draft_tokens)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per prefill / decode process")
    ap.add_argument("--agg-threads", type=int, default=None, help="torch threads of the aggregated process "
                    "(default: --threads, as each disaggregated engine process; 2 x was slower on 2 busy cores)")
    ap.add_argument("--cpu-wake-latency-us", type=int, default=-1,
                    help="both systems' worker.cpu_wake_latency_us (0: idle CPUs poll while they run; root only)")
    ap.add_argument("--rounds", type=int, default=1, help="run the pair this many times, alternating the order")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR", help="PNGs (needs matplotlib)")
    ap.add_argument("--markdown", action="store_true", help="also print the side-by-side table as Markdown")
    ap.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temporary folder)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def bench_config(args: argparse.Namespace, url: str, label: str, concurrency: int) -> loadtest.BenchConfig:
    return loadtest.BenchConfig(
        nats_url=url, requests=args.requests, concurrency=[concurrency],
        input_len=args.input_len, max_tokens=args.max_tokens, model=args.model, warmup=args.warmup,
        seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
        progress=not args.no_progress, label=label)


def worker_args(args: argparse.Namespace, threads: int) -> list[str]:
    """Both systems' worker flags. The caches that reuse a prompt across requests are off: every
    round sends the same prompts, and the aggregated baseline has no such cache."""
    return ["--spec", args.spec, "--draft-tokens", str(args.draft_tokens), "--threads", str(threads),
            "--prefix-cache", "0", "--turn-cache", "0", "--cpu-wake-latency-us", str(args.cpu_wake_latency_us)]


@contextmanager
def disaggregated(args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    """The cluster `baton up` starts, ready; yields its NATS URL."""
    ns = argparse.Namespace(model=args.model, prefill=1, decode=1, log_dir=str(log_dir / "disaggregated"),
                            nats_url=None, nats_port=None)
    cluster = start_cluster(ns, worker_args(args, args.threads), cpus=engine_cpus(1, 1, args.threads))
    try:
        waited = asyncio.run(wait_ready(cluster.nats_url, cluster, 1, 1, 300.0))
        print(f"disaggregated ready in {waited:.1f} s", file=sys.stderr)
        yield cluster.nats_url
    finally:
        cluster.stop()


@contextmanager
def aggregated(args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    """One aggregated process on its own nats-server, ready; yields the URL."""
    threads = args.agg_threads or args.threads
    placed = engine_cpus(0, 1, threads)  # the CPUs the disaggregated decode gets, as `baton up` places it
    (log_dir / "aggregated").mkdir(parents=True, exist_ok=True)
    with NatsServer(jetstream=False) as server:
        with launch.running(server.url, worker_args(args, threads) + (["--cpus", placed[0]] if placed else []),
                            log_dir / "aggregated" / "aggregated.log", 300.0):
            yield server.url


STARTS = {"disaggregated": disaggregated, "aggregated": aggregated}


def side_by_side(results: dict[str, dict], markdown: bool = False) -> str:
    """One row per level; each cell `disaggregated / aggregated`."""
    names = list(results)
    cols = (("tok/s", lambda s: loadtest._f(s["output_tokens_per_s"])),
            ("TTFT p50 ms", lambda s: loadtest._f(s["ttft_ms"]["p50"])),
            ("TTFT p99 ms", lambda s: loadtest._f(s["ttft_ms"]["p99"])),
            ("ITL p50 ms", lambda s: loadtest._f(s["itl_ms"]["p50"])),
            ("ITL p99 ms", lambda s: loadtest._f(s["itl_ms"]["p99"])),
            ("TPOT p50 ms", lambda s: loadtest._f(s["tpot_ms"]["p50"])),
            ("E2E p50 ms", lambda s: loadtest._f(s["e2e_ms"]["p50"])),
            ("tau", lambda s: loadtest._f(s["acceptance_length"], 2)),
            ("errors", lambda s: str(sum(s["errors"].values()))))
    levels = [run["name"] for run in results[names[0]]["runs"]]
    by_level = {name: {run["name"]: run["summary"] for run in results[name]["runs"]} for name in names}
    rows = []
    for level in levels:
        cells = [" / ".join(fn(by_level[n][level]) if level in by_level[n] else "-" for n in names) for _, fn in cols]
        rows.append([level] + cells)
    header = ["level"] + [c for c, _ in cols]
    if markdown:
        out = ["cells: " + " / ".join(names), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(header)]
    fmt = lambda r: "".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([f"cells: {' / '.join(names)}", fmt(header), "-" * sum(widths)] + [fmt(r) for r in rows])


def run_rounds(args: argparse.Namespace, systems: list[str], log_dir: Path) -> list[dict[str, dict]]:
    """Each system's results, `args.rounds` times: both systems up at once; per level, round i
    runs them back to back, in reverse order in odd rounds. -> per round, system -> result."""
    rounds: list[dict[str, dict]] = [{} for _ in range(args.rounds)]
    with ExitStack() as stack:
        urls = {system: stack.enter_context(STARTS[system](args, log_dir)) for system in systems}
        for level in (int(c) for c in args.concurrency.split(",")):
            for i, results in enumerate(rounds):
                for system in systems if i % 2 == 0 else systems[::-1]:
                    print(f"== c={level}, round {i + 1}: {system} (logs in {log_dir / system})", file=sys.stderr)
                    result = asyncio.run(loadtest.run_bench(bench_config(args, urls[system], system, level)))
                    if system in results:
                        results[system]["runs"] += result["runs"]
                    else:
                        results[system] = result
    return [{system: results[system] for system in systems} for results in rounds]


def ratios(rounds: list[dict[str, dict]]) -> dict[str, list[float]]:
    """Per level: disaggregated / aggregated tok/s in each round."""
    out: dict[str, list[float]] = {}
    for results in rounds:
        by = {name: {run["name"]: run["summary"]["output_tokens_per_s"] for run in r["runs"]}
              for name, r in results.items()}
        for level, agg in by.get("aggregated", {}).items():
            disagg = by.get("disaggregated", {}).get(level)
            if disagg is not None and agg:
                out.setdefault(level, []).append(disagg / agg)
    return out


def format_ratios(ratio: dict[str, list[float]]) -> str:
    lines = ["level   disaggregated / aggregated tok/s, per round     median"]
    for level, values in ratio.items():
        lines.append(f"{level:<8}{'  '.join(f'{v:.3f}' for v in values):<48}{statistics.median(values):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        print(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="baton-sweep-"))
    started = time.monotonic()
    rounds = run_rounds(args, systems, log_dir)
    elapsed = time.monotonic() - started
    for i, results in enumerate(rounds):
        title = f" (round {i + 1})" if len(rounds) > 1 else ""
        for system, result in results.items():
            print(f"\n=== {system}{title}\n{loadtest.format_report(result)}")
        print(f"\n=== side by side{title}\n" + side_by_side(results))
        if args.markdown:
            print("\n" + side_by_side(results, markdown=True))
    ratio = ratios(rounds)
    if ratio:
        print("\n=== ratio\n" + format_ratios(ratio))
    print(f"\n(sweep took {elapsed:.0f} s; machine: {loadtest.machine_info()})")
    results = rounds[-1]
    if args.json:
        loadtest.write_json({"tool": "bench/sweep.py", "argv": sys.argv[1:] if argv is None else argv,
                             "machine": loadtest.machine_info(), "elapsed_s": elapsed, "systems": results,
                             "rounds": rounds, "ratio": {level: {"per_round": v, "median": statistics.median(v)}
                                                         for level, v in ratio.items()}}, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            for path in loadtest.plot(results, args.plot):
                print(f"wrote {path}")
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib); no plots written", file=sys.stderr)
    errors = sum(sum(run["summary"]["errors"].values()) for rs in rounds for r in rs.values() for run in r["runs"])
    return 1 if errors else 0

if __name__ == "__main__":
    sys.exit(main())
