"""Faults with real processes: kill -9 of decode and of prefill mid-request, a registry restart,
cancels at several stages. Each asserts that every request got a complete reply or an error code,
that capacity on every surviving worker returns to full, and that later requests are exact."""
import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (LookupReply, LookupRequest, PrefillDispatch, PrefillDone,
                                  SamplingParams)
from baton.proto.public import CancelReply, CancelRequest, GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import (Reference, done_within, running_cluster, service_metric, until, wait_all_free,
                         worker_loads)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
LEASE_S = 10.0  # registry lease: a killed worker is noticed within this plus a sweep


@pytest.fixture(scope="module")
def reference():
    return Reference()


def prompt(n: int, seed: int) -> list[int]:
    return heldout_prompts(TextTokenizer.load(DEFAULT_MODEL_DIR), 1, n, seed=seed)[0]


async def outcome(bus: Bus, p: list[int], max_tokens: int, request_id: str | None = None):
    """The reply, or the BatonError; never a hang (the router's timeouts bound it)."""
    try:
        return await bus.request(subjects.GENERATE, GenerateRequest(token_ids=p, max_tokens=max_tokens,
                                                                    request_id=request_id), GenerateReply, timeout=120)
    except BatonError as exc:
        return exc


@dataclass
class Streamed:
    """A streamed request's outcome, shaped like the GenerateReply fields the checks read."""
    token_ids: list[int]
    finish_reason: str | None


async def streamed(bus: Bus, p: list[int], max_tokens: int, decoding: asyncio.Event):
    """A streaming request; `decoding` is set once its first tokens arrived. Returns a Streamed,
    or the BatonError (never a hang: every message has a timeout)."""
    tokens, last = [], None
    request = GenerateRequest(token_ids=p, max_tokens=max_tokens, stream=True)
    try:
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
            async for last in chunks:
                tokens += last.token_ids
                if tokens:
                    decoding.set()
    except BatonError as exc:
        return exc
    return Streamed(tokens, last.finish_reason)


async def wait_decoding(events: list[asyncio.Event], timeout_s: float = 120) -> None:
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout_s)


async def cancel_after_first_tokens(bus: Bus, p: list[int], request_id: str) -> StreamChunk:
    """Stream a long request and cancel it once decode has streamed tokens (the decoding stage,
    however fast decode is); returns the last chunk."""
    request = GenerateRequest(token_ids=p, max_tokens=2000, ignore_eos=True, stream=True,
                              request_id=request_id)  # seconds of decoding: the cancel comes first
    last, cancelled = None, False
    async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
        async for last in chunks:
            if last.token_ids and not cancelled:
                cancelled = (await bus.request(subjects.CANCEL, CancelRequest(request_id=request_id),
                                               CancelReply)).cancelled
    return last


def kill(cluster, role: str, index: int = 0) -> None:
    procs = [p for r, p in cluster.children if r == role]
    os.kill(procs[index].pid, signal.SIGKILL)
    procs[index].wait()


async def prefill_holding_requests(cluster, timeout_s: float = 30.0) -> int:
    """Index (among the prefill children) of the first prefill whose heartbeat reports requests."""
    prefills = [cluster.worker_ids[i] for i, (role, _) in enumerate(cluster.children) if role == "prefill"]

    async def holding() -> list[int]:
        loads = await worker_loads(cluster.nats_url)
        return [i for i, worker_id in enumerate(prefills) if loads.get(worker_id, (0,) * 7)[5] > 0]
    return (await until(holding, timeout_s, "a prefill reporting a request", every_s=0.05))[0]


async def registered_again(url: str, roles: set[str], timeout_s: float = 60.0) -> None:
    """Until a worker of each role is registered (the registry may still be starting: no answer)."""
    async def registered() -> bool:
        try:
            return roles <= {v[0] for v in (await worker_loads(url)).values()}
        except BatonError:
            return False
    await until(registered, timeout_s, f"{sorted(roles)} registered again", every_s=0.1)


def migrations(cluster) -> list[int]:
    """Tokens sent before each request that moved off a lost decode (the router's request log)."""
    lines = [line for log in Path(cluster.log_dir).glob("router-*.log") for line in log.read_text().splitlines()]
    return [json.loads(line[line.index("{"):])["migrated_after"] for line in lines
            if '"migrated_after": ' in line and '"migrated_after": null' not in line]


def assert_exact(reference, p, reply, n) -> None:
    """The whole reply and its finish reason: a request that survived a fault lost no token."""
    want = reference.greedy(p, n)
    assert isinstance(reply, (GenerateReply, Streamed)), reply
    assert (reply.token_ids, reply.finish_reason) == (want, "length" if len(want) == n else "stop"), reply


def test_decode_killed_mid_request_continues_on_another(reference):
    with running_cluster(prefill=1, decode=2) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                prompts = [prompt(40, s) for s in range(4)]
                decoding = [asyncio.Event() for _ in prompts]
                tasks = [asyncio.create_task(streamed(bus, p, 400, d)) for p, d in zip(prompts, decoding)]
                await wait_decoding(decoding)  # all four are decoding, spread over both decode workers
                started = time.monotonic()
                kill(cluster, "decode", 0)
                results = await done_within(asyncio.gather(*tasks), LEASE_S + 60,
                                            "every client's whole reply after the kill of a decode")
                elapsed = time.monotonic() - started
                # the killed decode's requests continued on the other one, from what they had sent
                for p, r in zip(prompts, results):
                    assert_exact(reference, p, r, 400)
                    assert len(r.token_ids) == 400 or r.finish_reason == "stop", r
                moved = migrations(cluster)
                assert moved and all(0 < n < 400 for n in moved), moved
                print(f"moved after {moved} tokens; clients waited {elapsed:.1f} s after the kill")
                later = prompt(50, 9)
                assert_exact(reference, later, await outcome(bus, later, 20), 20)
                # a restarted decode registers and takes traffic (no lasting "no responders")
                cluster.spawn("decode", ["--model", str(DEFAULT_MODEL_DIR), "--threads", "1"], cluster.log_dir)
                restarted = cluster.worker_ids[len(cluster.children) - 1]
                replies = []
                for attempt in range(60):  # until the router sends it work (its view refreshes every 0.5 s);
                    # six at once, and new prompts: no decode holds their last turn, so no turn-cache bonus
                    # keeps them on the other decode (with `later`, held there, 60 rounds once were not enough)
                    replies += await asyncio.gather(*(outcome(bus, prompt(50, 100 + 6 * attempt + i), 8)
                                                      for i in range(6)))
                    if (await worker_loads(cluster.nats_url)).get(restarted, (0,) * 7)[6] > 0:
                        break
                print(f"the restarted decode took work after {attempt + 1} rounds of six requests")
                assert all(isinstance(r, GenerateReply) for r in replies), replies
            loads = await wait_all_free(cluster.nats_url, min_requests=1)
            decodes = [v for v in loads.values() if v[0] == "decode"]
            assert len(decodes) == 2 and all(v[6] > 0 for v in decodes), loads  # both serve
        asyncio.run(run())


def test_prefill_killed_before_its_transfer_is_retried(reference, monkeypatch):
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", "delay=3")  # every WRITE waits 3 s: a window to kill in
    with running_cluster(prefill=2, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                prompts = [prompt(30, 20 + s) for s in range(4)]
                tasks = [asyncio.create_task(outcome(bus, p, 8)) for p in prompts]
                holding = await prefill_holding_requests(cluster)  # its WRITEs wait 3 s: killed before they go
                kill(cluster, "prefill", holding)
                results = await asyncio.gather(*tasks)
                for p, r in zip(prompts, results):  # those on the killed prefill were retried on the other
                    assert_exact(reference, p, r, 8)
            await wait_all_free(cluster.nats_url, timeout_s=LEASE_S + 15)  # decode held the slots until then
        asyncio.run(run())


def test_a_prefill_killed_after_it_streamed_the_first_token_continues_after_that_token(reference, monkeypatch):
    """Prefill streams the first token ahead of the transfer: the client has it while the WRITE
    still waits (5 s here). Killed then, prefill never writes the state; the request continues on
    the other prefill after that one token, and the client's reply is whole and exact."""
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", "delay=5")
    with running_cluster(prefill=2, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                p = prompt(30, 90)
                first = asyncio.Event()
                task = asyncio.create_task(streamed(bus, p, 12, first))
                await wait_decoding([first])  # the first token came, from prefill: its WRITE waits 5 s
                kill(cluster, "prefill", await prefill_holding_requests(cluster))
                return p, await task
        p, reply = asyncio.run(run())
        assert_exact(reference, p, reply, 12)
        assert migrations(cluster) == [1]


def test_registry_restart_keeps_requests_flowing(reference):
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                p = prompt(70, 30)
                decoding = asyncio.Event()
                inflight = asyncio.create_task(streamed(bus, p, 200, decoding))
                await wait_decoding([decoding])  # in flight: the kill lands while it decodes
                kill(cluster, "registry")
                assert_exact(reference, p, await inflight, 200)
                assert_exact(reference, p, await outcome(bus, p, 10), 10)  # router's cached view
                cluster.spawn("registry", ["--model", str(DEFAULT_MODEL_DIR)], cluster.log_dir)
                await registered_again(cluster.nats_url, {"prefill", "decode"})  # they heartbeat into it
                assert_exact(reference, p, await outcome(bus, p, 10), 10)
            loads = await wait_all_free(cluster.nats_url)
            assert sorted(v[0] for v in loads.values()) == ["decode", "prefill"]
        asyncio.run(run())


def test_cancel_at_every_stage_frees_everything(reference, monkeypatch):
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", "delay=1.5")  # a transfer stage long enough to cancel in
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                # cancelled: at once (queued, tokenizing or prefilling), once the router drives it (at
                # prefill), once prefill computed it (transferring: its WRITE waits 1.5 s)
                for i, stage in enumerate(["sent", "driven by the router", "computed by prefill"]):
                    rid = f"cancel-stage-{i}"
                    await until(lambda: service_metric(cluster, "router", "baton_requests_in_flight") == 0, 30,
                                "the router done with the previous request", every_s=0.02)
                    computed = service_metric(cluster, "prefill", "baton_prefill_seconds_count")
                    task = asyncio.create_task(outcome(bus, prompt(60, 40 + i), 300, request_id=rid))
                    if stage == "driven by the router":
                        await until(lambda: service_metric(cluster, "router", "baton_requests_in_flight") > 0, 30,
                                    f"{rid} {stage}", every_s=0.02)
                    elif stage == "computed by prefill":
                        await until(lambda: service_metric(cluster, "prefill", "baton_prefill_seconds_count") > computed,
                                    30, f"{rid} {stage}", every_s=0.02)
                    await bus.request(subjects.CANCEL, CancelRequest(request_id=rid), CancelReply)
                    result = await task
                    assert isinstance(result, BatonError) or result.finish_reason == "abort", result
                last = await cancel_after_first_tokens(bus, prompt(60, 43), "cancel-stage-decoding")
                assert last.finished and last.finish_reason == "abort" and last.usage.completion_tokens < 2000, last
                p = prompt(33, 50)
                assert_exact(reference, p, await outcome(bus, p, 12), 12)
            await wait_all_free(cluster.nats_url)
        asyncio.run(run())


def test_sigterm_stops_every_service_cleanly(reference):
    """SIGTERM: stop intake, finish in-flight work, deregister, exit 0 — for every service."""
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                p = prompt(50, 60)
                decoding = asyncio.Event()
                inflight = asyncio.create_task(streamed(bus, p, 60, decoding))
                await wait_decoding([decoding])  # in flight: SIGTERM lands while it decodes
                stopper = asyncio.get_running_loop().run_in_executor(None, cluster.stop_services)
                reply = await inflight
                await stopper
                return p, reply
        p, reply = asyncio.run(run())
        codes = {role: proc.returncode for role, proc in cluster.children}
    assert codes == {"registry": 0, "router": 0, "prefill": 0, "decode": 0}, codes
    assert isinstance(reply, BatonError) or reply.token_ids == reference.greedy(p, 60)[:len(reply.token_ids)]


def test_sigterm_of_one_decode_loses_no_request(reference):
    """A decode stopped with SIGTERM mid-generation (a rolling restart): it deregisters at once,
    so the router moves its requests to the other decode; every reply is complete and exact,
    and the stopped decode exits 0."""
    with running_cluster(prefill=1, decode=2) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                prompts = [prompt(40, s) for s in range(10, 14)]
                decoding = [asyncio.Event() for _ in prompts]
                tasks = [asyncio.create_task(streamed(bus, p, 300, d)) for p, d in zip(prompts, decoding)]
                await wait_decoding(decoding)  # all four are decoding, spread over both decode workers
                decode = next(proc for role, proc in cluster.children if role == "decode")
                decode.send_signal(signal.SIGTERM)
                code = await asyncio.get_running_loop().run_in_executor(None, decode.wait, 60)
                return prompts, await asyncio.gather(*tasks), code
        prompts, results, code = asyncio.run(run())
        for p, r in zip(prompts, results):
            assert_exact(reference, p, r, 300)
            assert len(r.token_ids) == 300 or r.finish_reason == "stop", r
        assert code == 0
        moved = migrations(cluster)
        print(f"moved after {moved} tokens")
        assert moved, "the stopped decode's requests should have moved"


@pytest.mark.parametrize("fault", ["fail=target/FULL", "drop=aux/AUX"])
def test_failed_or_unnotified_transfer_ends_with_an_error_and_frees_slots(monkeypatch, fault):
    """A WRITE that fails, or whose notification never arrives (decode's transfer deadline, 3 s
    here): the client gets an error, not a hang, and no slot stays taken on either side."""
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", fault)
    monkeypatch.setenv("BATON_WORKER_TRANSFER_DEADLINE_S", "3")
    with running_cluster(prefill=1, decode=1, warm_up=False) as cluster:  # every transfer fails
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                return await done_within(outcome(bus, prompt(40, 70), 8), 20, "the reply to a request whose "
                                         "transfer fails (decode's transfer deadline is 3 s)")
        result = asyncio.run(run())
        assert isinstance(result, BatonError) and result.code.value in ("internal", "unavailable", "timeout"), result
        asyncio.run(wait_all_free(cluster.nats_url))
        # a healthy prefill replaces the faulty one: later requests are exact again
        monkeypatch.delenv("BATON_TRANSFER_FAULTS")
        cluster.spawn("prefill", ["--model", str(DEFAULT_MODEL_DIR), "--threads", "1"], cluster.log_dir)
        faulty = next(p for r, p in cluster.children if r == "prefill")
        faulty.terminate()
        faulty.wait(30)

        async def later():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                async def only_the_healthy_prefill() -> bool:
                    loads = await worker_loads(cluster.nats_url)
                    return sum(v[0] == "prefill" for v in loads.values()) == 1 and faulty.returncode is not None
                await until(only_the_healthy_prefill, 30, "the healthy prefill registered, the faulty one gone",
                            every_s=0.5)
                p = prompt(30, 71)
                return p, await outcome(bus, p, 10)
        p, reply = asyncio.run(later())
        assert_exact(Reference(), p, reply, 10)


async def prefills_where(bus: Bus, done) -> list:
    """The registered prefill workers if `done(workers)` holds (loads come with heartbeats), else []."""
    workers = (await bus.request(subjects.LOOKUP, LookupRequest(role="prefill"), LookupReply)).workers
    return workers if done(workers) else []


def test_sigterm_of_one_prefill_finishes_its_writes_before_it_leaves(reference, monkeypatch):
    """A prefill stopped with SIGTERM while its WRITEs are in flight (a rolling restart): it takes
    no new prompt, finishes the requests it holds, and deregisters only after their last WRITE
    ended. Decode releases a sender's slots when that sender leaves (nothing it started can still
    land), so leaving first would let a WRITE land in freed slots (sglang #27372)."""
    monkeypatch.setenv("BATON_TRANSFER_FAULTS", "delay=5")  # every WRITE waits 5 s: a window to stop in
    with running_cluster(prefill=2, decode=1) as cluster:
        index, stopped = next((i, proc) for i, (role, proc) in enumerate(cluster.children) if role == "prefill")
        stopped_id = cluster.worker_ids[index]

        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                prompts = [prompt(30, s) for s in range(80, 86)]
                tasks = [asyncio.create_task(outcome(bus, p, 8, request_id=f"rolling-{i}"))
                         for i, p in enumerate(prompts)]
                # the prefill to stop holds requests (computing, or their WRITEs waiting in the delay)
                await until(lambda: prefills_where(bus, lambda ws: any(w.registration.worker_id == stopped_id and
                                                                       w.load.active_requests > 0 for w in ws)),
                            30, f"the prefill to stop ({stopped_id}) reporting requests", every_s=0.05)
                stopped.send_signal(signal.SIGTERM)
                # still registered, marked draining, and refusing new prompts
                prefills = await until(lambda: prefills_where(bus, lambda ws: any(w.load.draining for w in ws)),
                                       30, "a prefill marked draining", every_s=0.05)
                draining = [w.registration.worker_id for w in prefills if w.load.draining]
                assert len(prefills) == 2 and draining == [stopped_id], prefills
                try:
                    refused = await bus.request(subjects.prefill_dispatch(draining[0]), PrefillDispatch(
                        request_id="to-the-stopped", token_ids=prompt(30, 88), sampling=SamplingParams()), PrefillDone)
                except BatonError as exc:
                    refused = exc
                assert isinstance(refused, BatonError) and refused.code is ErrorCode.UNAVAILABLE, refused
                assert "stopping" in refused.message, refused
                late = prompt(30, 87)  # sent while the stopped prefill drains: served by the other
                results = await asyncio.gather(*tasks, outcome(bus, late, 8, request_id="rolling-late"))
                code = await asyncio.get_running_loop().run_in_executor(None, stopped.wait, 60)
                return prompts + [late], results, code
        prompts, results, code = asyncio.run(run())
        for p, r in zip(prompts, results):
            assert_exact(reference, p, r, 8)
        assert code == 0
        logs = {path.name: path.read_text() for path in Path(cluster.log_dir).glob("*.log")}
        router = "".join(text for name, text in logs.items() if name.startswith("router"))
        decode = "".join(text for name, text in logs.items() if name.startswith("decode"))
        stopped_log = next(text for name, text in logs.items() if name.startswith("prefill") and
                           "stopping: no new prompts; finishing" in text)
        finished = int(stopped_log.split("stopping: no new prompts; finishing ")[1].split()[0])
        assert finished > 0, "the stopped prefill held no request: nothing was tested"
        assert "retrying once" not in router, "a request of the stopped prefill was retried, not finished"
        assert "notice for unknown request" not in decode, "a WRITE ended after decode released its request"
        asyncio.run(wait_all_free(cluster.nats_url))


def test_router_killed_mid_stream_fails_its_clients_within_seconds_and_decode_frees(reference):
    """kill -9 of the router while three requests stream: decode's next chunk to the router's token
    inbox gets "no responders" and decode ends each request (freeing its slots at once instead of
    generating to max_tokens); each client's stream pings the router's probe after 2 s of silence
    and fails `unavailable`. A new router then serves exactly."""
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                prompts = [prompt(40, 40 + s) for s in range(3)]
                decoding = [asyncio.Event() for _ in prompts]
                tasks = [asyncio.create_task(streamed_long(bus, p, d)) for p, d in zip(prompts, decoding)]
                await wait_decoding(decoding)
                router = next(i for i, (role, _) in enumerate(cluster.children) if role == "router")
                kill(cluster, "router")
                killed_at = time.monotonic()
                # within seconds: each stream pings the router's probe after 2 s of silence (not the
                # 120 s per-message timeout, nor the end of 1,500 tokens)
                results = await done_within(asyncio.gather(*tasks), 10, "every client told of the router's kill")
                waited = time.monotonic() - killed_at
                assert all(isinstance(r, BatonError) and r.code is ErrorCode.UNAVAILABLE for r in results), results
                print(f"clients learned {waited:.1f} s after the kill")
                await wait_all_free(cluster.nats_url, timeout_s=15)  # long before 1,500 tokens each
                decode_log = next(Path(cluster.log_dir).glob("decode-*.log")).read_text()
                assert decode_log.count("its router's token inbox is gone; aborted") == 3
                cluster.respawn(router)
                later = prompt(50, 9)
                assert_exact(reference, later, await served_once_a_router_is_up(bus, later, 20), 20)
                last = await streamed(bus, later, 20, asyncio.Event())
                assert_exact(reference, later, last, 20)
            await wait_all_free(cluster.nats_url, min_requests=5)
        asyncio.run(run())


async def streamed_long(bus: Bus, p: list[int], decoding: asyncio.Event):
    """A stream that would run 1,500 tokens (past end of text); the outcome as `streamed` gives it."""
    request = GenerateRequest(token_ids=p, max_tokens=1500, stream=True, ignore_eos=True)
    try:
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
            async for chunk in chunks:
                if chunk.token_ids:
                    decoding.set()
    except BatonError as exc:
        return exc
    return chunk


async def served_once_a_router_is_up(bus: Bus, p: list[int], n: int, timeout_s: float = 60):
    """The first reply that is not `unavailable` (no router listening yet)."""
    deadline = time.monotonic() + timeout_s
    while isinstance(reply := await outcome(bus, p, n), BatonError) and reply.code is ErrorCode.UNAVAILABLE:
        assert time.monotonic() < deadline, reply
        await asyncio.sleep(0.2)
    return reply
