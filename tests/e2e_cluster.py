"""Helpers for end-to-end tests: a real cluster (nats-server + service processes) and the
`transformers` greedy reference on the shipped checkpoint."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import pytest
import torch

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import LookupReply, LookupRequest
from baton.shared.bus import Bus
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.services.worker import HEARTBEAT_S
from baton.up import Cluster, start_cluster, wait_http_ready, wait_ready


@contextlib.contextmanager
def running_cluster(nats_url: str | None = None, prefill: int = 1, decode: int = 1, worker_args: list[str] = (),
                    auth: bool = False, warm_up: bool = True, model: Path = DEFAULT_MODEL_DIR,
                    env: dict[str, str] = {}, http_port: int | None = None):
    """Registry, router, prefill and decode processes (and the HTTP door on `http_port`) on
    `nats_url` or a nats-server of their own; `env` is set for the services' start."""
    log_dir = tempfile.mkdtemp(prefix="baton-test-")
    args = argparse.Namespace(model=model, prefill=prefill, decode=decode, log_dir=log_dir, nats_url=nats_url,
                              nats_port=None, http=http_port is not None, http_host="127.0.0.1", http_port=http_port)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        cluster = start_cluster(args, ["--threads", "1", "--num-pages", "512", "--num-slots", "16", *worker_args],
                                auth)
    try:
        asyncio.run(wait_ready(cluster.nats_url, cluster, prefill, decode, 240.0, warm_up))
        if http_port is not None:
            wait_http_ready(cluster, "127.0.0.1", http_port, 120.0)
        yield cluster
    except BaseException:
        print_logs(log_dir)
        raise
    finally:
        cluster.stop()


def print_logs(log_dir: str) -> None:
    for path in sorted(Path(log_dir).glob("*.log")):
        print(f"--- {path.name} ---\n{path.read_text()[-4000:]}")


async def until(condition, timeout_s: float, what: str, every_s: float = 0.2):
    """`await condition()` again every `every_s` until it is truthy; returns it. AssertionError
    naming `what` if that takes more than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (result := await condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(every_s)
    return result


async def worker_loads(url: str) -> dict[str, tuple]:
    """worker id -> (role, free pages, total pages, free slots, total slots, active, requests taken)."""
    async with await Bus.connect(url, "test-lookup") as bus:
        reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
    return {w.registration.worker_id: (w.registration.role, w.load.free_pages, w.registration.capacity.total_pages,
                                       w.load.free_slots, w.registration.capacity.total_slots, w.load.active_requests,
                                       w.load.requests_total)
            for w in reply.workers}


async def wait_all_free(url: str, timeout_s: float = 20.0, min_requests: int = 0) -> dict:
    """Until every worker reports all pages and slots free and the decode workers together report
    at least `min_requests` requests taken. Heartbeats carry the loads; the first read waits until
    they are newer than the call, so a stale "all free" cannot pass. A lookup that gets no answer
    (a NATS route still recovering from a partition, a registry restarting) is asked again."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    await asyncio.sleep(HEARTBEAT_S * 1.5)  # every load read from now on was sent after the work ended
    loads: dict | BatonError = {}
    while True:
        try:
            loads = await worker_loads(url)
        except BatonError as exc:
            if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                raise
            loads = exc
        else:
            taken = sum(v[6] for v in loads.values() if v[0] == "decode")
            if taken >= min_requests and all(v[1] == v[2] and v[3] == v[4] for v in loads.values()):
                return loads
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"capacity did not return to full: {loads}")
        await asyncio.sleep(0.25)


def window_prompts() -> list[list[int]]:
    """Held-out prompts shorter than, equal to and several times longer than the sliding window."""
    from baton.shared.model.checkpoint import load_model
    from baton.shared.model.heldout import heldout_prompts
    from baton.shared.model.tokenizer import TextTokenizer
    W = load_model().cfg.sliding_window
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    return [heldout_prompts(tok, 1, n, seed=n)[0] for n in (W // 2, W, 4 * W + 5)]


class Reference:
    """transformers' Qwen3ForCausalLM greedy generate on the same checkpoint."""

    def __init__(self) -> None:
        import transformers
        self.model = transformers.Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0, eos_token_id=self.model.config.eos_token_id)
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def margin_at(self, prefix: list[int]) -> float:
        """Top-2 logit margin of the next token after `prefix` (how close a tie was)."""
        logits = self.model(torch.tensor([prefix])).logits[0, -1]
        top = logits.topk(2).values
        return float(top[0] - top[1])

    def explain(self, prompt: list[int], got: list[int], want: list[int]) -> str:
        i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        margin = self.margin_at(prompt + want[:i])
        return f"diverged at generated token {i}: got {got[i]}, reference {want[i]}, reference top-2 margin {margin:.2e}"


__all__ = ["Cluster", "Reference", "running_cluster", "wait_all_free", "window_prompts", "worker_loads"]
