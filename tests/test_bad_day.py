"""A bad day under `baton up`, as a user runs it (issue 25): its nats-server killed -9 mid-load and
restarted on the same port and store; the only decode, or the only prefill, stopped 15 s (SIGSTOP,
then SIGCONT: a GC pause, a hung host). Each also with the machine loaded by two busy loops.

Replies are compared whole (token ids, text, finish reason) with the same request before the fault."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from baton.proto import subjects
from baton.proto.codec import decode
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import LookupReply, LookupRequest, WorkerEvent
from baton.proto.public import GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from e2e_cluster import until, wait_all_free
from test_up_supervision import LOADED, baton_up, busy_loops, descendants, prompts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
MAX_TOKENS = 96
IN_FLIGHT = 8
CLIENT_TIMEOUT_S = 90.0  # a client timeout is silence: no test here may see one
STALL_S = 15.0


async def reply(bus: Bus, prompt: list[int], stream: bool):
    """(token ids, text, finish reason) of one request, streamed or not, or its BatonError."""
    request = GenerateRequest(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, stream=stream)
    try:
        if not stream:
            r = await bus.request(subjects.GENERATE, request, GenerateReply, timeout=CLIENT_TIMEOUT_S)
            return r.token_ids, r.text, r.finish_reason
        ids, text = [], ""
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk,
                                      timeout_per_message=CLIENT_TIMEOUT_S) as chunks:
            async for chunk in chunks:
                ids, text = ids + chunk.token_ids, text + chunk.text
        return ids, text, chunk.finish_reason
    except BatonError as exc:
        return exc


async def load(bus: Bus, batch: list[list[int]], total: int, done: list) -> None:
    """`total` requests over `batch`, IN_FLIGHT at once, every other one streamed; appends
    (index, outcome) to `done` as each ends."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        async with gate:
            done.append((i, await reply(bus, batch[i % len(batch)], stream=i % 2 == 1)))
    await asyncio.gather(*(one(i) for i in range(total)))


async def references(bus: Bus, batch: list[list[int]]) -> list[tuple]:
    found = await asyncio.gather(*(reply(bus, p, stream=False) for p in batch))
    assert all(isinstance(r, tuple) for r in found), found
    return found


async def registered(bus: Bus) -> dict[str, str]:
    """worker id -> instance id of every registered worker."""
    found = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply, timeout=5.0)
    return {w.registration.worker_id: w.registration.instance_id for w in found.workers}


async def left_events(bus: Bus) -> list[WorkerEvent]:
    got: list[WorkerEvent] = []

    async def on_event(msg) -> None:
        if (event := decode(msg.data, WorkerEvent)).kind == "left":
            got.append(event)
    await bus.subscribe(subjects.WORKER_EVENTS, on_event)
    return got


def pid_of(up, what: str) -> int:
    return next(pid for pid, cmd in descendants(up.proc.pid).items() if what in cmd)


def silent(outcome) -> bool:
    return isinstance(outcome, BatonError) and outcome.code is ErrorCode.TIMEOUT


@LOADED
def test_nats_server_killed_and_restarted_mid_load_answers_every_request(tmp_path, busy):
    """120 requests, 8 in flight: every one ends complete (exact) or with an error code, none in
    silence; afterwards every request is exact again."""
    with busy_loops(busy), baton_up(tmp_path) as up:
        async def run():
            async with await Bus.connect(up.nats_url, "test", reconnect_wait_s=0.2) as bus:
                batch = prompts(IN_FLIGHT)
                before = await references(bus, batch)
                done: list = []
                during = asyncio.create_task(load(bus, batch, 120, done))
                await until(lambda: _at_least(done, 2 * IN_FLIGHT), 300, "load flowing")
                os.kill(pid_of(up, "nats-server"), signal.SIGKILL)
                await asyncio.to_thread(up.wait_for, "nats-server restarted", 30)
                await during
                await until(lambda: _roles_back(bus), 60, "both workers registered again")
                after = await asyncio.gather(*(reply(bus, p, stream=s) for p in batch for s in (False, True)))
                await wait_all_free(up.nats_url, timeout_s=60)
                return before, done, after
        before, done, after = asyncio.run(run())
        assert len(done) == 120
        assert [o for _, o in done if silent(o)] == [], "requests that got no answer in time"
        wrong = [(i, o) for i, o in done if not isinstance(o, BatonError) and o != before[i % len(before)]]
        assert wrong == [], "complete but not exact"
        errors = [o for _, o in done if isinstance(o, BatonError)]
        print(f"{120 - len(errors)} exact, {len(errors)} errors: {[(e.code.value, e.message) for e in errors]}")
        assert after == [r for r in before for _ in (False, True)]
        assert up.proc.poll() is None


async def _at_least(done: list, count: int) -> bool:
    return len(done) >= count


async def _roles_back(bus: Bus) -> bool:
    try:
        roles = sorted(w.split("-")[0] for w in await registered(bus))
    except BatonError:
        return False
    return roles == ["decode", "prefill"]


@LOADED
@pytest.mark.parametrize("role", ["decode", "prefill", "registry"])
def test_the_only_worker_of_a_role_stopped_15_s_fails_no_request(tmp_path, role, busy):
    """SIGSTOP of the only decode (or prefill, or the registry) for 15 s, longer than a lease, while
    requests run and arrive: requests wait for it instead of failing, no worker is forgotten (same
    instances, no 'left'), every reply is exact and every page and slot comes back."""
    with busy_loops(busy), baton_up(tmp_path) as up:
        async def run():
            async with await Bus.connect(up.nats_url, "test") as bus:
                batch = prompts(IN_FLIGHT)
                before = await references(bus, batch)
                workers, left = await registered(bus), await left_events(bus)
                done: list = []
                during = asyncio.create_task(load(bus, batch, 48, done))
                await until(lambda: _at_least(done, IN_FLIGHT), 300, "load flowing")
                worker = pid_of(up, f"serve {role}")
                os.kill(worker, signal.SIGSTOP)
                try:  # requests that arrive during the stall, beyond the 8 in flight
                    arrived = [asyncio.create_task(reply(bus, p, stream=False)) for p in batch[:4]]
                    await asyncio.sleep(STALL_S)  # the fault: a 15 s stall
                finally:
                    os.kill(worker, signal.SIGCONT)
                await during
                done += list(enumerate(await asyncio.gather(*arrived)))
                await wait_all_free(up.nats_url, timeout_s=60, min_requests=48)
                return before, done, workers, await registered(bus), left
        before, done, workers, workers_after, left = asyncio.run(run())
        assert len(done) == 52
        assert [(i, o) for i, o in done if o != before[i % len(before)]] == []
        assert workers_after == workers
        assert left == []
        print(f"52 requests exact across a {STALL_S:g} s stop of the only {role} (4 arrived during it)")


@LOADED
def test_requests_wait_for_the_only_decode_to_come_back_after_a_kill(tmp_path, busy):
    """SIGKILL of the only decode under `baton up`: its requests, and those that arrive while no
    decode is registered, wait in the router's queue until the restarted decode registers, then
    finish exactly (moved ones continue after the tokens already sent)."""
    with busy_loops(busy), baton_up(tmp_path) as up:
        async def run():
            async with await Bus.connect(up.nats_url, "test") as bus:
                batch = prompts(IN_FLIGHT)
                before = await references(bus, batch)
                done: list = []
                during = asyncio.create_task(load(bus, batch, 32, done))
                await until(lambda: _at_least(done, IN_FLIGHT), 300, "load flowing")
                os.kill(pid_of(up, "serve decode"), signal.SIGKILL)
                await during
                await wait_all_free(up.nats_url, timeout_s=60)
                return before, done
        before, done = asyncio.run(run())
        assert [(i, o) for i, o in done if o != before[i % len(before)]] == []
        up.wait_for(r"decode-\d restarted", 5)
        print("32 requests exact across a kill and restart of the only decode")
