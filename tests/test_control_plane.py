"""Trust in the control plane, with real processes (issue 31): the registry holds a bounded number
of JetStream consumers, refuses a second live instance of a worker id, and does not declare the
living dead after its own pause."""
import asyncio
import functools
import signal
from pathlib import Path

import pytest

from baton.proto import subjects
from baton.proto.codec import decode
from baton.proto.internal import LookupReply, LookupRequest, WorkerEvent
from baton.services.registry.service import BUCKET
from baton.shared.bus import Bus
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from e2e_cluster import Reference, running_cluster, until, wait_all_free
from test_faults import assert_exact, outcome, prompt

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
WORKER_ARGS = ["--model", str(DEFAULT_MODEL_DIR), "--threads", "1", "--num-pages", "512", "--num-slots", "16"]


class CachedReference(Reference):
    """The same prompts are checked many times here: generate each reference once."""

    @functools.cache
    def greedy(self, prompt: tuple[int, ...], n: int) -> list[int]:
        return super().greedy(list(prompt), n)


@pytest.fixture(scope="module")
def reference():
    return CachedReference()


async def consumers(bus: Bus) -> int:
    return (await bus.connection.jetstream().stream_info(f"KV_{BUCKET}")).state.consumer_count


async def seen(bus: Bus, subject: str, count: int) -> asyncio.Event:
    """Set once `count` messages were published on `subject` (watched, not answered)."""
    done, n = asyncio.Event(), 0

    async def on_message(msg) -> None:
        nonlocal n
        n += 1
        if n >= count:
            done.set()
    await bus.subscribe(subject, on_message)
    return done


def test_an_idle_cluster_keeps_the_consumer_count_flat():
    """The router's refreshes and the workers' health probes look the registry up several times a
    second; each lookup used to leave a JetStream consumer behind for 5 minutes."""
    with running_cluster(prefill=1, decode=1, warm_up=False) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                before = await consumers(bus)
                lookups = await seen(bus, subjects.LOOKUP, 60)
                await asyncio.wait_for(lookups.wait(), 120)
                after = await consumers(bus)
                print(f"consumers on the workers' bucket: {before} before, {after} after 60 lookups")
                assert after <= before <= 1
        asyncio.run(run())


async def registered(bus: Bus) -> dict[str, tuple[str, str]]:
    """worker id -> (role, instance id) of every registered worker."""
    reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
    return {w.registration.worker_id: (w.registration.role, w.registration.instance_id) for w in reply.workers}


def test_a_second_decode_with_a_live_worker_id_is_refused_and_every_output_stays_exact(reference):
    """A reused --worker-id: the registry used to accept the second instance, whose registration
    and heartbeats overwrote the first's, and requests came back with wrong tokens."""
    prompts = [prompt(30 + 7 * i, 100 + i) for i in range(4)]
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                before = await registered(bus)
                decode_id = next(w for w, (role, _) in before.items() if role == "decode")
                cluster.spawn("decode", [*WORKER_ARGS, "--worker-id", decode_id], cluster.log_dir)
                duplicate = cluster.children[-1][1]
                exited = asyncio.get_running_loop().run_in_executor(None, duplicate.wait, 240)
                results = []
                while not exited.done():  # requests flow while the duplicate starts, is refused and exits
                    results += await asyncio.gather(*(outcome(bus, p, 24) for p in prompts))
                results += await asyncio.gather(*(outcome(bus, p, 24) for p in prompts))
                return await exited, results, before, await registered(bus)
        code, results, before, after = asyncio.run(run())
        log = (Path(cluster.log_dir) / f"decode-{len(cluster.children) - 1}.log").read_text()
        assert code != 0 and "duplicate_worker" in log, log[-2000:]
        assert after == before, (before, after)
        for i, reply in enumerate(results):
            assert_exact(reference, tuple(prompts[i % len(prompts)]), reply, 24)
        print(f"{len(results)} requests exact while the duplicate started and exited with {code}")
        asyncio.run(wait_all_free(cluster.nats_url))


def test_a_prefill_with_broken_nixl_metadata_is_refused_at_registration_and_exits(reference, monkeypatch):
    """A worker whose NIXL metadata does not load used to be registered and looked up; its first
    request then failed at decode (which loads it to talk back). Now the registry loads it first."""
    prompts = [prompt(30 + 7 * i, 140 + i) for i in range(4)]
    with running_cluster(prefill=1, decode=1) as cluster:
        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                before = await registered(bus)
                with monkeypatch.context() as patch:
                    patch.setenv("BATON_TRANSFER_FAULTS", "metadata=truncate")
                    cluster.spawn("prefill", WORKER_ARGS, cluster.log_dir)
                broken = cluster.children[-1][1]
                exited = asyncio.get_running_loop().run_in_executor(None, broken.wait, 240)
                results = []
                while not exited.done():  # requests flow while it starts, is refused and exits
                    results += await asyncio.gather(*(outcome(bus, p, 24) for p in prompts))
                results += await asyncio.gather(*(outcome(bus, p, 24) for p in prompts))
                return await exited, results, before, await registered(bus)
        code, results, before, after = asyncio.run(run())
        log = (Path(cluster.log_dir) / f"prefill-{len(cluster.children) - 1}.log").read_text()
        assert code != 0 and "bad_request" in log and "NIXL metadata" in log, log[-2000:]
        assert after == before, (before, after)
        for i, reply in enumerate(results):
            assert_exact(reference, tuple(prompts[i % len(prompts)]), reply, 24)
        print(f"{len(results)} requests exact while the broken prefill started and exited with {code}")
        asyncio.run(wait_all_free(cluster.nats_url))


async def worker_events(bus: Bus) -> list:
    """Every WorkerEvent published from now on (appended as they come)."""
    got: list = []

    async def on_event(msg) -> None:
        got.append(decode(msg.data, WorkerEvent))
    await bus.subscribe(subjects.WORKER_EVENTS, on_event)
    return got


def test_a_registry_paused_for_15_s_drops_no_worker_and_fails_no_request(reference):
    """SIGSTOP of the registry alone: its leases used to expire by the bucket's TTL meanwhile, so on
    resume every worker was announced "left" and every in-flight request failed."""
    prompts = [prompt(30 + 5 * i, 120 + i) for i in range(4)]
    with running_cluster(prefill=1, decode=1) as cluster:
        registry = next(proc for role, proc in cluster.children if role == "registry")

        async def rounds(bus: Bus, stop: asyncio.Event, results: list) -> None:
            while not stop.is_set():
                results += await asyncio.gather(*(outcome(bus, p, 32) for p in prompts))

        async def run():
            async with await Bus.connect(cluster.nats_url, "test") as bus:
                before, events = await registered(bus), await worker_events(bus)
                results, paused, resumed = [], asyncio.Event(), asyncio.Event()
                during = asyncio.create_task(rounds(bus, paused, results))
                # load flowing before the pause: a round served, the next one in flight
                await until(lambda: len(results) >= len(prompts), 120, "a first round served before the pause")
                registry.send_signal(signal.SIGSTOP)
                await asyncio.sleep(15.0)  # the fault itself: a 15 s pause (longer than a lease)
                registry.send_signal(signal.SIGCONT)
                paused.set()
                await during
                await registered(bus)  # the registry answers again
                after_resume: list = []
                sweeps = asyncio.create_task(rounds(bus, resumed, after_resume))
                await until(lambda: len(after_resume) >= 3 * len(prompts) * 2, 300,
                            ">= 6 rounds served after the resume")
                resumed.set()
                await sweeps
                return before, await registered(bus), events, results + after_resume
        before, after, events, results = asyncio.run(run())
        assert after == before, (before, after)
        assert [e for e in events if e.kind == "left"] == [], events
        for i, reply in enumerate(results):
            assert_exact(reference, tuple(prompts[i % len(prompts)]), reply, 32)
        print(f"{len(results)} requests exact across a 15 s registry pause")
        asyncio.run(wait_all_free(cluster.nats_url))
