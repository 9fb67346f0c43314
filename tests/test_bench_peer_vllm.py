"""bench/peer_vllm.py's rounds: servers take turns back to back, alternating the order, and the
ratios are read per round (pure logic, on made-up results; the bench itself needs vLLM)."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PEER = Path(__file__).resolve().parents[1] / "bench" / "peer_vllm.py"


@pytest.fixture(scope="module")
def peer():
    pytest.importorskip("aiohttp")
    spec = importlib.util.spec_from_file_location("bench_peer_vllm", PEER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def summary(tok_s: float, ttft: float = 10.0, exact: bool = True) -> dict:
    return {"tok_s": tok_s, "ttft_ms_p50": ttft, "stream_tok_s_p50": tok_s / 2, "tokens_per_request": 128.0,
            "exact": exact, "mismatches": 0 if exact else 1, "requests": 4, "ok": 4, "errors": {}}


def test_a_level_combines_its_rounds_into_medians_and_is_exact_only_if_every_round_was(peer):
    level = peer.combine([summary(100.0, 30.0), summary(300.0, 10.0), summary(200.0, 20.0, exact=False)])
    assert level["tok_s"] == 200.0 and level["ttft_ms_p50"] == 20.0 and level["tok_s_rounds"] == [100.0, 300.0, 200.0]
    assert not level["exact"] and level["mismatches"] == 1 and level["requests"] == 12


def test_ratios_are_taken_within_each_round(peer):
    baton = {"rounds": {"16": [summary(300.0), summary(200.0)]}}
    vllm = {"rounds": {"16": [summary(200.0), summary(100.0)]}}
    assert peer.round_ratios(baton, vllm, 16) == [1.5, 2.0]


def test_servers_take_turns_back_to_back_alternating_the_order(peer, monkeypatch):
    turns = []

    async def run_level(base, model, prompts, c, requests, max_tokens):
        turns.append((base, c))
        return [], 1.0
    monkeypatch.setattr(peer, "run_level", run_level)
    monkeypatch.setattr(peer, "cpu_ticks", lambda server: 0)
    settled = []

    async def settle(others):
        settled.append([o.server.name for o in others])
    monkeypatch.setattr(peer, "settle", settle)
    monkeypatch.setattr(peer, "summarize", lambda results, wall, *rest: summary(100.0))

    class Fake:
        def __init__(self, name):
            self.name, self.base = name, name

        def rss_mb(self):
            return 1.0
    runs = [peer.Run(Fake("b"), {"name": "b"}), peer.Run(Fake("v"), {"name": "v"}),
            peer.Run(Fake("x"), {"name": "x", "error": "failed to start"})]
    args = type("Args", (), {"concurrency": [1, 16], "rounds": 3, "requests": 4, "max_tokens": 8})
    asyncio.run(peer.measure(runs, args, [], [], [], None, ""))
    assert turns == [("b", 1), ("v", 1), ("v", 1), ("b", 1), ("b", 1), ("v", 1),
                     ("b", 16), ("v", 16), ("v", 16), ("b", 16), ("b", 16), ("v", 16)]  # x never started
    assert settled[:2] == [["v"], ["b"]]  # before each turn, the others must be quiet
    assert [len(r) for r in runs[0].out["rounds"].values()] == [3, 3] and "levels" not in runs[2].out
