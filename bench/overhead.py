"""Control-plane overhead per request, and transfer bytes per request as prompts grow.

    python bench/overhead.py --requests 40 --json out/overhead.json
    python bench/overhead.py --requests 40 --cpu-wake-latency-us 0   # as `baton up --cpu-wake-latency-us 0` runs

One run starts a real cluster (nats-server, registry, router, 1 prefill, 1 decode; NIXL), then:
1. sends short requests one at a time (2 tokens each: prefill streams the first token ahead of
   the transfer unless it is the only one); for each, the router's request log gives TTFT
   (request received -> first token chunk) and prefill's own compute and NIXL transfer times, so
   control-plane overhead = TTFT - prefill compute - the transfer if it was on the first token's
   path (NATS hops, queueing, thread hand-offs, the first chunk); "strict" subtracts the model
   compute alone (and the transfer as the receiver sees it, WRITE start -> decode notified, when
   decode's copy of the first token came first); next to it, measured in the same run on the same
   server: a raw NATS request/reply round trip (back to back, one process) and one idle NATS hop
   between two processes (publish -> subscriber, the receiver asleep in between, as each hop of a
   lone request is). Every
   service's request log carries stage stamps (CLOCK_MONOTONIC, shared by the processes), so the
   same requests are also shown hop by hop;
2. sends one request per prompt length (16, W/2 .. 32W) and reads the bytes each transfer moved,
   its descriptors and transfer time (prefill's request log), with the per-component split from
   the transfer plan: sliding-window components stay flat past the window, full-attention ones
   grow linearly, and descriptors count runs of whole pages (item-major storage), not layers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from e2e_cluster import running_cluster  # noqa: E402

from baton.proto import subjects  # noqa: E402
from baton.proto.internal import Ack  # noqa: E402
from baton.proto.public import GenerateReply, GenerateRequest  # noqa: E402
from baton.shared.bus import Bus  # noqa: E402
from baton.shared.config import WorkerSection  # noqa: E402
from baton.shared.kv.plan import make_plan  # noqa: E402
from baton.shared.kv.store import KVStore  # noqa: E402
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model  # noqa: E402
from baton.shared.model.heldout import heldout_prompts  # noqa: E402
from baton.shared.model.tokenizer import TextTokenizer  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    i = (len(s) - 1) * q
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


async def nats_rtt(url: str, n: int) -> list[float]:
    async with await Bus.connect(url, "rtt") as bus:
        await bus.serve("bench.echo", Ack, lambda msg: _echo())
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await bus.request("bench.echo", Ack(), Ack, timeout=5)
            out.append((time.perf_counter() - t0) * 1000)
        return out


def nats_one_way_idle(url: str, n: int, gap_s: float = 0.005) -> list[float]:
    """One NATS hop between two processes with the receiver asleep in between (as each hop of a
    lone request is): publish in this process -> subscriber callback in a child process, timed on
    CLOCK_MONOTONIC, which the two processes share."""
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_one_way_receiver, args=(url, n, ready, results))
    child.start()
    try:
        ready.get(timeout=30)
        asyncio.run(_one_way_send(url, n, gap_s))
        return results.get(timeout=30)
    finally:
        child.join(timeout=10)


async def _one_way_send(url: str, n: int, gap_s: float) -> None:
    async with await Bus.connect(url, "one-way-send") as bus:
        for _ in range(n):
            await asyncio.sleep(gap_s)
            await bus.publish(f"bench.one_way.{time.monotonic_ns()}", Ack())


def _one_way_receiver(url: str, n: int, ready, results) -> None:
    async def run() -> list[float]:
        got: list[float] = []
        done = asyncio.Event()

        async def on_message(msg) -> None:
            got.append((time.monotonic_ns() - int(msg.subject.rsplit(".", 1)[1])) / 1e6)
            if len(got) == n:
                done.set()
        async with await Bus.connect(url, "one-way-receive") as bus:
            await bus.subscribe("bench.one_way.*", on_message)
            ready.put(True)
            await asyncio.wait_for(done.wait(), 60)
        return got
    results.put(asyncio.run(run()))


async def _echo() -> Ack:
    return Ack()


async def send(url: str, prompts: list[list[int]], max_tokens: int) -> None:
    async with await Bus.connect(url, "overhead") as bus:
        for p in prompts:
            await bus.request(subjects.GENERATE, GenerateRequest(token_ids=p, max_tokens=max_tokens), GenerateReply,
                              timeout=120)


def request_log(log_dir: Path, service: str) -> list[dict]:
    rows = []
    for path in log_dir.glob(f"{service}-*.log"):
        for line in path.read_text().splitlines():
            if "baton.requests:" in line:
                rows.append(json.loads(line.split("baton.requests: ", 1)[1]))
    return rows


def router_log(log_dir: Path) -> list[dict]:
    return request_log(log_dir, "router")


# The request path hop by hop: (what, from (service, stage), to (service, stage)); stamps are
# CLOCK_MONOTONIC ms, shared by all processes on the machine.
HOPS = [
    ("router: accept -> flow admit", ("router", "received"), ("router", "admit")),
    ("NATS router -> prefill dispatch", ("router", "admit"), ("prefill", "received")),
    ("prefill: queue -> batch", ("prefill", "received"), ("prefill", "batched")),
    ("prefill: hop to engine thread", ("prefill", "batched"), ("prefill", "computing")),
    ("prefill: compute (model) to first token", ("prefill", "computing"), ("prefill", "sampled")),
    ("prefill: first token to loop, published", ("prefill", "sampled"), ("prefill", "first_token")),
    ("NATS prefill -> router first token", ("prefill", "first_token"), ("router", "first_chunk")),
    ("prefill: compute (model), all of it", ("prefill", "computing"), ("prefill", "computed")),
    ("  meanwhile: router pick + plan", ("router", "admit"), ("router", "reserve")),
    ("  meanwhile: NATS router -> decode", ("router", "reserve"), ("decode", "reserve")),
    ("  meanwhile: decode allocates slots", ("decode", "reserve"), ("decode", "reserved")),
    ("  meanwhile: NATS decode -> router", ("decode", "reserved"), ("router", "reserved")),
    ("  meanwhile: target to prefill (RTT)", ("router", "reserved"), ("router", "targeted")),
    ("prefill: engine -> write task", ("prefill", "computed"), ("prefill", "write")),
    ("NIXL write (sender's view)", ("prefill", "write"), ("prefill", "written")),
    ("decode: notified after write start", ("prefill", "write"), ("decode", "arrived")),
    ("decode: publish first token (again)", ("decode", "arrived"), ("decode", "first_chunk")),
    ("TTFT at the router", ("router", "received"), ("router", "first_chunk")),
]


def request_stamps(log_dir: Path, request_ids: set[str]) -> dict[str, dict[tuple[str, str], float]]:
    """request id -> {(service, stage): ms}: every service's stamps joined by request id."""
    stamps: dict[str, dict[tuple[str, str], float]] = {}
    for service in ("router", "prefill", "decode"):
        for row in request_log(log_dir, service):
            if row["request_id"] in request_ids and row.get("at"):
                at = stamps.setdefault(row["request_id"], {})
                at.update({(service, stage): t for stage, t in row["at"].items()})
    return stamps


def hop_table(stamps: dict[str, dict[tuple[str, str], float]]) -> dict[str, dict[str, float]]:
    """p50/p90/mean of every hop in HOPS."""
    table = {}
    for name, start, end in HOPS:
        values = [at[end] - at[start] for at in stamps.values() if start in at and end in at]
        if values:
            table[name] = {"p50": pct(values, 0.5), "p90": pct(values, 0.9), "mean": statistics.mean(values)}
    return table


def first_from_prefill(at: dict[tuple[str, str], float]) -> bool:
    """Whether prefill's copy of the first token was published before decode's (the one relayed)."""
    ahead = at.get(("prefill", "first_token"))
    return ahead is not None and ahead <= at.get(("decode", "first_chunk"), float("inf"))


def overheads(at: dict[tuple[str, str], float]) -> tuple[float, float]:
    """(control plane, strict) for one request: TTFT minus prefill's compute from its batch start
    (engine hand-off included), and minus the transfer when the first token came through decode;
    strict: TTFT minus the model compute alone, and the data movement as the receiver sees it
    (WRITE start -> decode notified) when it was on the path. Everything else counts."""
    def span(start, end):
        return at[end] - at[start]
    ttft = span(("router", "received"), ("router", "first_chunk"))
    if first_from_prefill(at):
        return (ttft - span(("prefill", "batched"), ("prefill", "sampled")),
                ttft - span(("prefill", "computing"), ("prefill", "sampled")))
    return (ttft - span(("prefill", "batched"), ("prefill", "computed")) - span(("prefill", "write"), ("prefill", "written")),
            ttft - span(("prefill", "computing"), ("prefill", "computed")) - span(("prefill", "write"), ("decode", "arrived")))


def plan_bytes(length: int, k: int = WorkerSection().draft_tokens) -> dict[str, int]:
    """Bytes per component of one request's transfer plan, at the deployment's k (as the cluster runs)."""
    cfg = load_model().cfg
    kw = dict(mode="ring", num_pages=1200, page_size=16, num_slots=2, max_draft_tokens=k)
    src, dst = KVStore(cfg, draft_enabled=True, **kw), KVStore(cfg, draft_enabled=True, **kw)
    plan = make_plan(src.manifest("p", "fp", role="prefill"), dst.manifest("d", "fp", role="decode"))
    for store in (src, dst):
        store.allocate("r", length + 8)
        store.extend("r", length)
    split: dict[str, int] = {}
    for d in plan.descriptors(length, src.allocation("r"), dst.allocation("r")):
        split[d.component_key] = split.get(d.component_key, 0) + d.nbytes
    return split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens per latency request (1: the first "
                    "token comes through decode, after the transfer)")
    ap.add_argument("--cpu-wake-latency-us", type=int, default=WorkerSection().cpu_wake_latency_us,
                    help="the workers' `worker.cpu_wake_latency_us` (0: idle CPUs poll, as root; the PM QoS "
                         "request holds for the whole machine, so the NATS baselines run under it too)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    cfg = load_model().cfg
    W = cfg.sliding_window
    # up to the context: the longest prompt leaves room for the one token each request generates
    lengths = sorted({min(n, cfg.max_position_embeddings - 1)
                      for n in (16, W // 2, W, 2 * W, 4 * W, 8 * W, 16 * W, 32 * W, 64 * W)})
    short = heldout_prompts(tok, args.requests, args.prompt_len, seed=1)
    growing = [heldout_prompts(tok, 1, n, seed=n)[0] for n in lengths]
    worker_args = ["--num-pages", "1024", "--cpu-wake-latency-us", str(args.cpu_wake_latency_us)]
    with running_cluster(worker_args=worker_args) as cluster:
        asyncio.run(send(cluster.nats_url, short[:3], 1))  # warm up
        rtt = asyncio.run(nats_rtt(cluster.nats_url, 200))
        one_way = nats_one_way_idle(cluster.nats_url, 200)
        before = len(router_log(cluster.log_dir))
        asyncio.run(send(cluster.nats_url, short, args.max_tokens))
        rows = router_log(cluster.log_dir)[before:]
        asyncio.run(send(cluster.nats_url, growing, 1))
        grow_rows = router_log(cluster.log_dir)[before + len(rows):]
        log_dir = cluster.log_dir
    prefill = {r["request_id"]: r for r in request_log(log_dir, "prefill")}  # its own timing: the
    rows = [dict(r, prefill_ms=prefill[r["request_id"]]["prefill_ms"],  # router may finish before
                 transfer_ms=prefill[r["request_id"]]["transfer_ms"]) for r in rows]  # prefill's reply
    stamps = request_stamps(log_dir, {r["request_id"] for r in rows})
    control, strict = zip(*(overheads(at) for at in stamps.values()))
    table = {name: {"p50": pct(v, 0.5), "p90": pct(v, 0.9), "mean": statistics.mean(v)} for name, v in (
        ("ttft_ms", [r["ttft_ms"] for r in rows]), ("prefill_ms", [r["prefill_ms"] for r in rows]),
        ("transfer_ms", [r["transfer_ms"] for r in rows]), ("control_plane_ms", control),
        ("control_plane_strict_ms", strict),
        ("nats_rtt_ms", rtt), ("nats_one_way_idle_ms", one_way))}
    ahead = sum(first_from_prefill(at) for at in stamps.values())
    print(f"\n{args.requests} sequential requests, prompt {args.prompt_len} tokens, max_tokens {args.max_tokens}; "
          f"first token from prefill ahead of the transfer in {ahead} of {len(stamps)}")
    print(f"{'':<24} {'p50':>8} {'p90':>8} {'mean':>8}")
    for name, v in table.items():
        print(f"{name:<24} {v['p50']:>8.2f} {v['p90']:>8.2f} {v['mean']:>8.2f}")
    hops = hop_table(stamps)
    print("\nthe same requests hop by hop (ms; stamps from every service's request log)")
    print(f"{'':<36} {'p50':>8} {'p90':>8} {'mean':>8}")
    for name, v in hops.items():
        print(f"{name:<36} {v['p50']:>8.2f} {v['p90']:>8.2f} {v['mean']:>8.2f}")
    print(f"\ntransfer bytes per request (k={WorkerSection().draft_tokens}, draft state travels):")
    print(f"{'prompt':>7} {'measured':>10} {'descs':>6} {'ms':>7} {'ttft_ms':>8} "
          + " ".join(f"{c:>16}" for c in plan_bytes(W)))
    growth = []
    for n, r in zip(lengths, grow_rows):
        sent = prefill[r["request_id"]]  # prefill's own count (its reply may trail the stream)
        split = plan_bytes(n)
        growth.append({"prompt_tokens": n, "transfer_bytes": sent["transfer_bytes"], "by_component": split,
                       "descriptors": sent["descriptors"], "transfer_ms": sent["transfer_ms"], "ttft_ms": r["ttft_ms"]})
        print(f"{n:>7} {sent['transfer_bytes']:>10,} {sent['descriptors']:>6} {sent['transfer_ms']:>7.2f} "
              f"{r['ttft_ms']:>8.2f} " + " ".join(f"{b:>16,}" for b in split.values()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"latency": table, "hops": hops, "first_token_from_prefill": ahead,
                                         "cpu_wake_latency_us": args.cpu_wake_latency_us,
                                         "max_tokens": args.max_tokens, "requests": rows, "transfer_growth": growth}, indent=2))


if __name__ == "__main__":
    main()
