"""Encode + decode + validate, microseconds per message, for the messages every request carries.

    python bench/codec.py --json out/codec.json

Each case is one message as the services send it: a generate request with a text prompt and one
with 160 token ids (client -> router), a token chunk mid-stream and the finished one (decode ->
router, once per step per request), and the two that carry KV records once per request: decode's
reservation reply (its allocation) and the router's target for prefill (that allocation and the
transfer plan, for the default model's ring-mode stores). A case is timed as `decode(encode(message))` through
`baton.proto.codec`, the path every receiver takes (bounds, version, types, ranges, the message's
own `validate`), after a warm-up, best of `--repeats` runs of `--calls` calls each, in one thread.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from baton.proto.codec import decode, encode
from baton.proto.internal import PrefillTarget, ReserveReply, TokenChunk
from baton.proto.public import GenerateRequest, SpecStats, Timing
from baton.shared.kv.plan import make_plan
from baton.shared.kv.store import KVStore
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.config import ModelConfig


def kv_records():
    """A transfer plan between two ring-mode stores of the default model, and a reservation of
    200 positions with 150 extended (a prompt of 150 tokens)."""
    cfg = ModelConfig.load(DEFAULT_MODEL_DIR)
    prefill, decode_ = (KVStore(cfg, mode="ring", num_pages=512, page_size=16, num_slots=16, max_draft_tokens=5)
                        for _ in range(2))
    plan = make_plan(prefill.manifest("prefill-1", "sha256:model", role="prefill"),
                     decode_.manifest("decode-1", "sha256:model"))
    decode_.allocate("bench-0005", 200)
    decode_.extend("bench-0005", 150)
    return plan, decode_.allocation("bench-0005")


def cases() -> dict[str, object]:
    plan, allocation = kv_records()
    return {
        "GenerateRequest (text prompt)": GenerateRequest(
            prompt="Tell me about the history of the printing press. " * 8, max_tokens=128, stream=True,
            stop=["\n\n"], request_id="bench-0001"),
        "GenerateRequest (160 token ids)": GenerateRequest(
            token_ids=list(range(100, 260)), max_tokens=128, temperature=0.7, top_p=0.9, seed=7,
            stream=True, request_id="bench-0002"),
        "TokenChunk (5 tokens)": TokenChunk(request_id="bench-0003", seq=12, token_ids=[5, 81, 300, 7, 1999]),
        "TokenChunk (finished)": TokenChunk(
            request_id="bench-0004", seq=30, token_ids=[9, 12], finished=True, finish_reason="length",
            spec=SpecStats(verify_steps=24, drafted=120, accepted=103), timing=Timing(ttft_ms=31.2, total_ms=712.5)),
        "ReserveReply (allocation)": ReserveReply(request_id="bench-0005", decode_worker_id="decode-1",
                                                  allocation=allocation),
        "PrefillTarget (allocation, plan)": PrefillTarget(request_id="bench-0005", decode_worker_id="decode-1",
                                                          decode_allocation=allocation, transfer_plan=plan),
    }


def time_case(message: object, calls: int, repeats: int) -> dict[str, float]:
    cls = type(message)
    data = encode(message)
    assert decode(data, cls) == message, f"{cls.__name__} does not survive a round trip"
    best = {"encode_us": float("inf"), "decode_us": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            encode(message)
        t1 = time.perf_counter()
        for _ in range(calls):
            decode(data, cls)
        t2 = time.perf_counter()
        best["encode_us"] = min(best["encode_us"], (t1 - t0) / calls * 1e6)
        best["decode_us"] = min(best["decode_us"], (t2 - t1) / calls * 1e6)
    return {"bytes": len(data), **best, "total_us": best["encode_us"] + best["decode_us"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    for name, message in cases().items():
        for _ in range(1000):  # warm-up: schema caches, allocator
            decode(encode(message), type(message))
        results[name] = time_case(message, args.calls, args.repeats)
    print(f"{'message':34} {'bytes':>6} {'encode us':>10} {'decode+validate us':>19} {'total us':>9}")
    for name, r in results.items():
        print(f"{name:34} {r['bytes']:>6} {r['encode_us']:>10.2f} {r['decode_us']:>19.2f} {r['total_us']:>9.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
