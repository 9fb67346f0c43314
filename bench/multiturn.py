"""Multi-turn conversations through the whole system, the caches on against off: prefill's prefix
cache (what prefill computes) and decode's turn cache (what prefill sends: `bytes/turn`).

N conversations of T turns run at once, each turn sent only after the previous reply: turn 1 is a
held-out user text of 32-128 tokens; each later prompt is the previous prompt, its greedy answer
(32-64 tokens) and a new user text of 32-128 tokens. Every configuration (cache on / off, 1 or 2
prefill workers) gets its own `baton up`-style cluster (tests/e2e_cluster.py), the same
conversations, streaming `baton.v1.generate`. Per turn: TTFT p50/p99 as the client sees it
(request sent to first token chunk), prompt tokens prefill computed (prompt - usage.cached_tokens),
bytes prefill wrote to decode (the router's request log), and tokens per verify step. The script
checks that every turn's tokens and finish reason are identical with the cache on and off.

    python bench/multiturn.py --conversations 16 --turns 6 --prefill 1,2 --json out/multiturn.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from baton.proto import subjects  # noqa: E402
from baton.proto.public import GenerateRequest, StreamChunk  # noqa: E402
from baton.shared.bus import Bus  # noqa: E402
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR  # noqa: E402
from baton.shared.model.heldout import heldout_prompts  # noqa: E402
from baton.shared.model.tokenizer import TextTokenizer  # noqa: E402


def plan(conversations: int, turns: int, seed: int) -> list[list[tuple[list[int], int]]]:
    """Each conversation's (user tokens, max_tokens) per turn."""
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        lengths = [rng.randint(32, 128) for _ in range(turns)]
        texts = [heldout_prompts(tok, 1, n, seed=seed * 1000 + c * 31 + t)[0] for t, n in enumerate(lengths)]
        out.append([(text, rng.randint(32, 64)) for text in texts])
    return out


async def converse(bus: Bus, name: str, turns: list[tuple[list[int], int]]) -> list[dict]:
    prompt, rows = [], []
    for t, (said, max_tokens) in enumerate(turns):
        prompt = prompt + said
        request = GenerateRequest(token_ids=prompt, max_tokens=max_tokens, stream=True, request_id=f"{name}-t{t}")
        sent, first, tokens, last = time.perf_counter(), None, [], None
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=300) as chunks:
            async for last in chunks:
                if last.token_ids and first is None:
                    first = time.perf_counter()
                tokens += last.token_ids
        spec = last.spec
        rows.append({"turn": t, "request_id": request.request_id, "prompt_tokens": len(prompt), "tokens": tokens,
                     "finish_reason": last.finish_reason, "ttft_ms": ((first or time.perf_counter()) - sent) * 1000,
                     "computed_tokens": len(prompt) - last.usage.cached_tokens,
                     "tau": (spec.accepted + spec.verify_steps) / spec.verify_steps if spec.verify_steps else None})
        prompt = prompt + tokens
    return rows


def transfer_bytes(log_dir: Path) -> dict[str, int]:
    """request id -> bytes prefill wrote, from the router's request log."""
    out = {}
    for line in (line for path in log_dir.glob("router*.log") for line in path.read_text().splitlines()):
        start = line.find("{\"service\": \"router\"")
        if start >= 0:
            entry = json.loads(line[start:])
            if entry.get("transfer_bytes") is not None:
                out[entry["request_id"]] = entry["transfer_bytes"]
    return out


def run(config: str, prefill: int, cache: bool, conversations, threads: int, pages: int) -> list[dict]:
    from e2e_cluster import running_cluster

    async def all_of(url):
        async with await Bus.connect(url, "bench") as bus:
            await converse(bus, f"warm-{config}", [([1, 2, 3, 4] * 4, 4)])  # shares no prefix with them
            return await asyncio.gather(*(converse(bus, f"{config}-c{i}", c) for i, c in enumerate(conversations)))
    args = ["--prefix-cache", "64" if cache else "0", "--turn-cache", "64" if cache else "0",
            "--threads", str(threads), "--num-pages", str(pages)]
    with running_cluster(prefill=prefill, worker_args=args) as cluster:
        results = asyncio.run(all_of(cluster.nats_url))
        log_dir = Path(cluster.log_dir)
    sizes = transfer_bytes(log_dir)
    rows = [dict(r, conversation=i, transfer_bytes=sizes.get(r["request_id"])) for i, c in enumerate(results) for r in c]
    return rows


def per_turn(rows: list[dict], turns: int) -> list[dict]:
    out = []
    for t in range(turns):
        at = [r for r in rows if r["turn"] == t]
        ttft = sorted(r["ttft_ms"] for r in at)
        taus = [r["tau"] for r in at if r["tau"]]
        sizes = [r["transfer_bytes"] for r in at if r["transfer_bytes"] is not None]
        out.append({"turn": t + 1, "ttft_p50_ms": statistics.median(ttft),
                    "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                    "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in at),
                    "computed_tokens": statistics.mean(r["computed_tokens"] for r in at),
                    "transfer_bytes": statistics.mean(sizes) if sizes else None,
                    "tau": statistics.mean(taus) if taus else None})
    return out


def table(name: str, turns: list[dict]) -> str:
    lines = [f"{name}:", "turn  prompt  computed  TTFT p50 ms  TTFT p99 ms  bytes/turn   tau"]
    for t in turns:
        lines.append(f"{t['turn']:>4}  {t['prompt_tokens']:>6.0f}  {t['computed_tokens']:>8.0f}  {t['ttft_p50_ms']:>11.1f}"
                     f"  {t['ttft_p99_ms']:>11.1f}  {t['transfer_bytes'] or 0:>10.0f}  {t['tau'] or 0:>4.2f}")
    return "\n".join(lines)


def ratios(on: list[dict], off: list[dict], from_turn: int = 3) -> dict:
    """Cache on / off over turns `from_turn`.. (sums of the per-turn means, medians of TTFT p50)."""
    a, b = [t for t in on if t["turn"] >= from_turn], [t for t in off if t["turn"] >= from_turn]
    return {"computed_tokens": sum(t["computed_tokens"] for t in a) / sum(t["computed_tokens"] for t in b),
            "ttft_p50": statistics.median(t["ttft_p50_ms"] for t in a) / statistics.median(t["ttft_p50_ms"] for t in b),
            "transfer_bytes": sum(t["transfer_bytes"] or 0 for t in a) / max(1, sum(t["transfer_bytes"] or 0 for t in b)),
            "tau": statistics.mean(t["tau"] or 0 for t in a) / statistics.mean(t["tau"] or 1 for t in b)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--prefill", default="1,2", help="prefill worker counts to run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages per worker (the deployment default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    conversations = plan(args.conversations, args.turns, args.seed)
    result, exact = {"args": vars(args) | {"json": str(args.json)}, "runs": {}}, True
    for prefill in [int(p) for p in args.prefill.split(",")]:
        runs = {}
        for cache in (True, False):
            name = f"prefill={prefill} cache={'on' if cache else 'off'}"
            rows = run(name.replace(" ", "_").replace("=", ""), prefill, cache, conversations, args.threads,
                       args.num_pages)
            runs[cache] = rows
            turns = per_turn(rows, args.turns)
            result["runs"][name] = {"turns": turns, "requests": rows}
            print(table(name, turns), flush=True)
        same = [(a["tokens"], a["finish_reason"]) == (b["tokens"], b["finish_reason"])
                for a, b in zip(runs[True], runs[False])]
        exact &= all(same)
        r = ratios(result["runs"][f"prefill={prefill} cache=on"]["turns"],
                   result["runs"][f"prefill={prefill} cache=off"]["turns"])
        result["runs"][f"prefill={prefill} ratios"] = r
        print(f"prefill={prefill}: identical replies cache on/off: {sum(same)}/{len(same)}; from turn 3, on/off: "
              + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()), flush=True)
    result["exact"] = exact
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
