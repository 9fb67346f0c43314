"""Helpers for end-to-end tests: a real cluster (nats-server + service processes) and the
`transformers` greedy reference on the shipped checkpoint."""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import inspect
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from baton.launcher import Launcher
from baton.proto import subjects
from baton.proto.codec import decode as decode_message
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import Heartbeat, LookupReply, LookupRequest, WorkerInfo, WorkerLoad
from baton.shared.bus import Bus
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.process import child_env
from baton.up import Cluster, start_cluster, wait_http_ready, wait_ready


HAND_OFF_ALWAYS = {"BATON_ROUTER_PREFILL_ON_DECODE_TOKENS": "0"}  # no prompt is prefilled on its decode worker


@contextlib.contextmanager
def running_cluster(nats_url: str | None = None, prefill: int = 1, decode: int = 1, worker_args: list[str] = (),
                    auth: bool = False, warm_up: bool = True, model: Path = DEFAULT_MODEL_DIR,
                    env: dict[str, str] = {}, http_port: int | None = None):
    """Registry, router, prefill and decode processes (and the HTTP door on `http_port`) on
    `nats_url` or a nats-server of their own; `env` is set for the services' start. Every prompt
    goes through prefill and the hand-off (`HAND_OFF_ALWAYS`), which is what these tests are
    about, unless `env` says otherwise."""
    env = {**HAND_OFF_ALWAYS, **env}
    log_dir = tempfile.mkdtemp(prefix="baton-test-")
    args = argparse.Namespace(model=model, prefill=prefill, decode=decode, log_dir=log_dir, nats_url=nats_url,
                              nats_port=None, http=http_port is not None, http_host="127.0.0.1", http_port=http_port)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        cluster = start_cluster(args, ["--threads", "1", "--num-pages", "512", "--num-slots", "16", *worker_args],
                                auth, launcher=shared_launcher())
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


_LAUNCHERS: dict[tuple, Launcher] = {}  # by environment: the imports once per test process, not per cluster


def shared_launcher() -> Launcher | None:
    """The launcher this process's clusters fork their workers from, one per environment (what a
    library reads as it loads is the launcher's: baton/launcher.py); None off the main thread,
    whose end would kill the launcher it started (PR_SET_PDEATHSIG): the cluster starts its own."""
    if threading.current_thread() is not threading.main_thread():
        return None
    env = child_env(dict(os.environ))
    key = tuple(sorted(env.items()))
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = Launcher(env)
    return _LAUNCHERS[key]


@atexit.register
def _close_launchers() -> None:
    for launcher in _LAUNCHERS.values():
        launcher.close()


def print_logs(log_dir: str) -> None:
    for path in sorted(Path(log_dir).glob("*.log")):
        print(f"--- {path.name} ---\n{path.read_text()[-4000:]}")


async def until(condition, timeout_s: float, what: str, every_s: float = 0.2):
    """`condition()` again every `every_s` until it is truthy; returns it. `condition` may be a
    plain function or a coroutine function (it is awaited). AssertionError naming `what` if that
    takes more than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (result := await _value(condition())):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(every_s)
    return result


async def _value(result):
    return await result if inspect.isawaitable(result) else result


def until_sync(condition, timeout_s: float, what: str, every_s: float = 0.2):
    """`until` for code outside an event loop: `condition()` is a plain function, and the wait
    blocks the calling thread."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return result


async def done_within(awaitable, timeout_s: float, what: str):
    """`await awaitable`; AssertionError naming `what` if it is not done within `timeout_s`. For a
    bound that is the contract (an answer, not a hang), as a wait rather than a timed assertion."""
    try:
        async with asyncio.timeout(timeout_s) as scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise AssertionError(f"{what}: not within {timeout_s:g} s") from None
        raise


async def worker_loads(url: str) -> dict[str, tuple]:
    """worker id -> (role, free pages, total pages, free slots, total slots, active, requests taken)."""
    async with await Bus.connect(url, "test-lookup") as bus:
        reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
    return {w.registration.worker_id: _load_row(w) for w in reply.workers}


def _load_row(w: WorkerInfo, load: WorkerLoad | None = None) -> tuple:
    """`load`: a fresher load than the registry's (a heartbeat's), if there is one."""
    load = load or w.load
    return (w.registration.role, load.free_pages, w.registration.capacity.total_pages,
            load.free_slots, w.registration.capacity.total_slots, load.active_requests,
            load.requests_total)


def all_free(rows) -> bool:
    """Every `_load_row` row has all its pages and slots free."""
    return all(v[1] == v[2] and v[3] == v[4] for v in rows)


async def wait_all_free(url: str, timeout_s: float = 20.0, min_requests: int = 0) -> dict:
    """Until every worker reports all pages and slots free and the decode workers together report
    at least `min_requests` requests taken. Heartbeats carry the loads, so what the registry holds
    may be older than the call (seconds, on a loaded machine): every registered worker must also
    have sent a heartbeat since the call (watched on the heartbeat subject). The loads judged and
    returned are those heartbeats', and the registry must agree that all is free. A lookup that
    gets no answer (a NATS route still recovering from a partition, a registry restarting) is asked
    again. Returns the loads as `worker_loads` gives them."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    beats: dict[tuple[str, str], Heartbeat] = {}  # (worker id, instance id) -> its latest heartbeat since the call

    async def on_beat(msg) -> None:
        with contextlib.suppress(BatonError):
            beat = decode_message(msg.data, Heartbeat)
            beats[beat.worker_id, beat.instance_id] = beat

    loads: dict | BatonError = {}
    async with await Bus.connect(url, "test-heartbeats") as watcher:
        await watcher.subscribe(subjects.HEARTBEAT, on_beat)
        while True:
            try:
                async with await Bus.connect(url, "test-lookup") as bus:
                    workers = (await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)).workers
            except BatonError as exc:
                if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                    raise
                loads = exc
            else:
                fresh = [beats.get((w.registration.worker_id, w.registration.instance_id)) for w in workers]
                loads = {w.registration.worker_id: _load_row(w, beat and beat.load) for w, beat in zip(workers, fresh)}
                taken = sum(v[6] for v in loads.values() if v[0] == "decode")
                if (None not in fresh and taken >= min_requests and all_free(loads.values())
                        and all_free(_load_row(w) for w in workers)):
                    return loads
            if asyncio.get_running_loop().time() > deadline:
                seen = {wid: (b.load.free_pages, b.load.free_slots) for (wid, _), b in beats.items()}
                raise AssertionError(f"capacity did not return to full: {loads}; heartbeats since the call "
                                     f"(free pages, free slots): {seen}")
            await asyncio.sleep(0.25)


def service_metric(cluster, role: str, name: str) -> float:
    """The sample `name` (one without labels) summed over the live `role` services' /metrics."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for m in cluster.metrics:
        if m["role"] == role:
            text = urllib.request.urlopen(f"http://127.0.0.1:{m['port']}/metrics", timeout=5).read().decode()
            total += sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                         if s.name == name and not s.labels)
    return total


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
