"""The kv-registry against a real nats-server, in this process: leases, worker identity and the
JetStream resources it holds (manifests come from real KV stores of a tiny model config)."""
import asyncio
import contextlib
import time

import msgspec
import pytest

from baton.proto import subjects
from baton.proto.codec import decode, encode
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (Ack, Capacity, Deregistration, Heartbeat, HeartbeatReply, LookupReply, LookupRequest,
                                  RegisterReply, WorkerEvent, WorkerInfo, WorkerLoad, WorkerRegistration)
from baton.services.registry.service import BUCKET, Registry, RegistryConfig
from baton.services.router.directory import Directory
from baton.services.worker import on_worker_left
from baton.shared.bus import Bus
from baton.shared.bus.server import NatsServer
from baton.shared.kv import KVStore
from baton.shared.model.config import FULL, SLIDING, ModelConfig
from baton.shared.transfer import nixl_ops
from baton.shared.transfer.nixl_thread import NixlThread
from baton.shared.transfer.regions import RegionTable, regions_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CFG = ModelConfig(vocab_size=64, hidden_size=6, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=2, num_hidden_layers=4, layer_types=(SLIDING, SLIDING, FULL, SLIDING), sliding_window=8,
                  num_nextn_predict_layers=1, mtp_layer_types=(SLIDING,))
LOAD = WorkerLoad(free_pages=16, free_slots=2, active_requests=0, queued_prompt_tokens=0)


class Worker:
    """A worker's KV memory registered with a NIXL agent of the worker's name, as in a real worker:
    its registration carries metadata the registry can load (metadata_check.py)."""

    def __init__(self, worker_id: str, role: str):
        self.store = KVStore(CFG, mode="ring", num_pages=16, page_size=4, num_slots=2, max_draft_tokens=3)
        self.manifest = self.store.manifest(worker_id, "sha256:m", role)
        self.nixl = NixlThread(worker_id)
        self._reg, self._items, self.metadata = self.nixl.call(
            nixl_ops.register, RegionTable(regions_of(self.manifest), worker_id))

    def close(self) -> None:
        self.nixl.call(nixl_ops.deregister, self._reg, self._items)
        self._reg = self._items = None
        self.nixl.close()


WORKERS: dict[tuple[str, str], Worker] = {}  # one per (worker id, role), closed at the module's end


@pytest.fixture(scope="module", autouse=True)
def close_workers():
    yield
    while WORKERS:
        WORKERS.popitem()[1].close()


def worker(worker_id: str, role: str = "decode") -> Worker:
    if (worker_id, role) not in WORKERS:
        WORKERS[worker_id, role] = Worker(worker_id, role)
    return WORKERS[worker_id, role]


def registration(worker_id: str, role: str = "decode", instance: str = "i1") -> WorkerRegistration:
    w = worker(worker_id, role)
    return WorkerRegistration(worker_id=worker_id, instance_id=instance, role=role,
                              manifest=w.manifest, nixl_metadata=w.metadata,
                              capacity=Capacity(total_pages=16, page_size=4, total_slots=2, max_seq_len=64))


def beat(worker_id: str, instance: str = "i1") -> Heartbeat:
    return Heartbeat(worker_id=worker_id, instance_id=instance, load=LOAD)


async def refusal(bus: Bus, subject: str, message, reply_cls) -> BatonError:
    with pytest.raises(BatonError) as refused:
        await bus.request(subject, message, reply_cls)
    return refused.value


async def registered(bus: Bus) -> list[tuple[str, str]]:
    reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
    return [(w.registration.worker_id, w.registration.instance_id) for w in reply.workers]


@contextlib.asynccontextmanager
async def registry(config: RegistryConfig = RegistryConfig(sweep_s=0.01)):
    """A fresh nats-server, a serving Registry (watch and sweeper running) and a client bus."""
    async with NatsServer() as server:
        async with await Bus.connect(server.url, "registry") as service, await Bus.connect(server.url, "test") as bus:
            reg = await Registry.open(service, CFG, config)
            await reg.serve()
            try:
                yield reg, bus
            finally:
                await reg.close()


async def consumers(bus: Bus) -> int:
    info = await bus.connection.jetstream().stream_info(f"KV_{BUCKET}")
    return info.state.consumer_count


def test_lookups_heartbeats_and_sweeps_leave_the_consumer_count_flat():
    """Every lookup and lease sweep used to list the bucket's keys, which leaves a JetStream
    consumer on the server for 5 minutes; the server refuses the 1,001st."""
    async def run():
        async with registry() as (reg, bus):
            for worker_id in ("decode-a", "decode-b"):
                await bus.request(subjects.REGISTER, registration(worker_id), RegisterReply)
            before = await consumers(bus)
            for i in range(300):
                reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
                assert sorted(w.registration.worker_id for w in reply.workers) == ["decode-a", "decode-b"]
                if i % 3 == 0:
                    assert (await bus.request(subjects.HEARTBEAT, beat("decode-a"), HeartbeatReply)).registered
            assert await consumers(bus) == before <= 1, "consumers grew with lookups and sweeps"
    asyncio.run(run())


def test_a_bucket_made_with_a_ttl_by_an_older_registry_loses_it():
    """Entries must not expire by the bucket's clock: only the registry decides a lease expired."""
    async def run():
        async with NatsServer() as server, await Bus.connect(server.url, "old") as bus:
            await bus.connection.jetstream().create_key_value(bucket=BUCKET, ttl=10.0, history=1)
            reg = await Registry.open(bus, CFG)
            info = await bus.connection.jetstream().stream_info(f"KV_{BUCKET}")
            assert not info.config.max_age, info.config
            await reg.close()
    asyncio.run(run())


async def events(bus: Bus) -> asyncio.Queue:
    """Every WorkerEvent the registry publishes from now on."""
    queue: asyncio.Queue = asyncio.Queue()

    async def put(msg) -> None:
        queue.put_nowait(decode(msg.data, WorkerEvent))
    await bus.subscribe(subjects.WORKER_EVENTS, put)
    return queue


def test_a_worker_that_stops_heartbeating_is_dropped_after_its_lease_and_announced():
    async def run():
        async with registry(RegistryConfig(lease_s=1.0, sweep_s=0.05)) as (reg, bus):
            seen = await events(bus)
            for worker_id in ("decode-quiet", "decode-beating"):
                await bus.request(subjects.REGISTER, registration(worker_id), RegisterReply)
            assert [(await seen.get()).kind for _ in range(2)] == ["joined", "joined"]
            left = asyncio.create_task(seen.get())
            while not left.done():  # one keeps beating, the other fell silent
                assert (await bus.request(subjects.HEARTBEAT, beat("decode-beating"), HeartbeatReply)).registered
                await asyncio.wait([left], timeout=0.2)
            event = left.result()
            assert (event.kind, event.worker_id, event.reason) == ("left", "decode-quiet", "lease expired")
            reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
            assert [w.registration.worker_id for w in reply.workers] == ["decode-beating"]
            assert not (await bus.request(subjects.HEARTBEAT, beat("decode-quiet"), HeartbeatReply)).registered
    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_second_live_instance_of_a_worker_id_is_refused_and_a_restarted_one_accepted():
    async def run():
        async with registry(RegistryConfig(lease_s=1.0, sweep_s=0.05)) as (reg, bus):
            seen = await events(bus)
            await bus.request(subjects.REGISTER, registration("decode-x"), RegisterReply)
            assert (await seen.get()).kind == "joined"
            for subject, message, reply_cls in [
                    (subjects.REGISTER, registration("decode-x", instance="i2"), RegisterReply),
                    (subjects.HEARTBEAT, beat("decode-x", instance="i2"), HeartbeatReply),
                    (subjects.DEREGISTER, Deregistration(worker_id="decode-x", instance_id="i2"), Ack)]:
                error = await refusal(bus, subject, message, reply_cls)
                assert error.code is ErrorCode.DUPLICATE_WORKER and "instance i1 holds" in error.message, error
            assert await registered(bus) == [("decode-x", "i1")]
            assert (await bus.request(subjects.HEARTBEAT, beat("decode-x"), HeartbeatReply)).registered
            await bus.request(subjects.REGISTER, registration("decode-x"), RegisterReply)  # the same instance again
            # a restart after an explicit deregistration, and after the lease expired
            await bus.request(subjects.DEREGISTER, Deregistration(worker_id="decode-x", instance_id="i1"), Ack)
            assert (await seen.get()).kind == "left"
            await bus.request(subjects.REGISTER, registration("decode-x", instance="i2"), RegisterReply)
            assert (await seen.get()).kind == "joined"
            event = await asyncio.wait_for(seen.get(), 10)  # i2 never heartbeats
            assert (event.kind, event.reason) == ("left", "lease expired")
            await bus.request(subjects.REGISTER, registration("decode-x", instance="i3"), RegisterReply)
            assert await registered(bus) == [("decode-x", "i3")]
    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_write_of_the_registry_that_landed_after_its_timeout_is_not_taken_for_another_instance():
    """Across a network cut the registry's heartbeat writes to JetStream timed out and then landed:
    the entry's revision moved on without the registry seeing its own write (nor, yet, the watch
    delivering it). The next heartbeat, and the worker's re-registration, used to be refused as if
    another instance held the id (`duplicate_worker`), and both workers of a healed cluster exited.
    Now the entry is read again: this instance's own is written over; another instance's is still
    refused."""
    async def run():
        async with registry(RegistryConfig(lease_s=30.0, sweep_s=0.05)) as (reg, bus):
            own = registration("decode-w")
            await bus.request(subjects.REGISTER, own, RegisterReply)
            watch, reg._on_entry = reg._on_entry, lambda entry: None  # the watch lags, as across the cut

            async def landed_behind_its_back(info: WorkerInfo) -> None:
                entry = await reg.kv.get("decode-w")
                await reg.kv.update("decode-w", encode(info), entry.revision)
            await landed_behind_its_back(WorkerInfo(registration=own, load=LOAD))
            assert (await bus.request(subjects.HEARTBEAT, beat("decode-w"), HeartbeatReply)).registered
            await landed_behind_its_back(WorkerInfo(registration=own, load=LOAD))
            await bus.request(subjects.REGISTER, own, RegisterReply)  # what the worker does after registered=False
            assert await registered(bus) == [("decode-w", "i1")]
            assert decode((await reg.kv.get("decode-w")).value, WorkerInfo).registration == own

            other = registration("decode-w", instance="i2")
            await landed_behind_its_back(WorkerInfo(registration=other, load=LOAD))
            assert not (await bus.request(subjects.HEARTBEAT, beat("decode-w"), HeartbeatReply)).registered
            error = await refusal(bus, subjects.REGISTER, own, RegisterReply)
            assert error.code is ErrorCode.DUPLICATE_WORKER, error
            reg._on_entry = watch
    asyncio.run(asyncio.wait_for(run(), 60))


def test_two_instances_registering_at_once_one_is_refused():
    async def run():
        async with registry() as (reg, bus):
            regs = [registration("decode-y", instance=f"i{n}") for n in range(4)]
            outcomes = await asyncio.gather(*(bus.request(subjects.REGISTER, r, RegisterReply) for r in regs),
                                            return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, BatonError)]
            assert len(refused) == 3 and all(o.code is ErrorCode.DUPLICATE_WORKER for o in refused), outcomes
            winner = regs[outcomes.index(next(o for o in outcomes if not isinstance(o, BatonError)))]
            assert await registered(bus) == [("decode-y", winner.instance_id)]
    asyncio.run(run())


def test_an_instance_cannot_change_its_registration():
    async def run():
        async with registry() as (reg, bus):
            first = registration("decode-z")
            await bus.request(subjects.REGISTER, first, RegisterReply)
            changed = WorkerRegistration(**{**msgspec.structs.asdict(first), "nixl_metadata": b"garbage"})
            error = await refusal(bus, subjects.REGISTER, changed, RegisterReply)
            assert error.code is ErrorCode.BAD_REQUEST and "never changes" in error.message, error
            reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply)
            assert [w.registration for w in reply.workers] == [first]
    asyncio.run(run())


def test_a_worker_whose_nixl_metadata_a_peer_could_not_use_is_refused_at_registration():
    """Broken metadata used to be accepted and published: the first request to or from that worker
    then failed when its peer loaded it. Now the registry loads it as a peer would."""
    async def run():
        async with registry() as (reg, bus):
            good = registration("prefill-m", role="prefill")
            other = worker("prefill-n", role="prefill")
            replace = msgspec.structs.replace
            elsewhere = tuple(replace(c, regions=tuple(replace(r, addr=r.addr + (1 << 40)) for r in c.regions))
                              for c in good.manifest.components)
            loads_not = ("does not load",)
            broken = [  # (change, what the refusal says)
                ({"nixl_metadata": b""}, loads_not),
                ({"nixl_metadata": b"not NIXL metadata at all"}, loads_not),
                # cut in half: NIXL's parser refuses it (some other corruptions crash it: below)
                ({"nixl_metadata": good.nixl_metadata[:len(good.nixl_metadata) // 2]},
                 ("does not load", "crashed NIXL's loader")),
                ({"nixl_metadata": other.metadata}, ("belongs to agent 'prefill-n'",)),
                ({"manifest": replace(good.manifest, components=elsewhere)},
                 ("regions are not memory its NIXL agent registered",)),
            ]
            for change, why in broken:
                error = await refusal(bus, subjects.REGISTER, WorkerRegistration(**{**msgspec.structs.asdict(good), **change}),
                                      RegisterReply)
                assert error.code is ErrorCode.BAD_REQUEST and any(w in error.message for w in why), (why, error)
                assert "prefill prefill-m" in error.message, error
            assert await registered(bus) == []
            await bus.request(subjects.REGISTER, good, RegisterReply)  # the real one is accepted
            assert await registered(bus) == [("prefill-m", "i1")]
    asyncio.run(run())


def test_the_metadata_check_refuses_what_kills_its_process_and_starts_a_new_one():
    """NIXL's parser segfaults on some corrupted blobs (which ones depends on the bytes: a garbled
    tail did at one address and not at another), so the check runs in a child process. Here the
    child dies in the middle of a check, deterministically, by SIGKILL."""
    import os
    import signal
    from baton.shared.transfer.metadata_check import MetadataCheck

    async def run():
        w = worker("prefill-k", role="prefill")
        check = MetadataCheck()
        await check.start()
        try:
            regions = regions_of(w.manifest)
            assert await check.problem("prefill-k", w.metadata, regions) == ""
            os.kill(check._child.pid, signal.SIGKILL)
            assert "crashed NIXL's loader" in await check.problem("prefill-k", w.metadata, regions)
            assert await check.problem("prefill-k", w.metadata, regions) == ""  # a new child
        finally:
            await check.close()
    asyncio.run(asyncio.wait_for(run(), 60))


def test_after_its_own_pause_the_registry_restarts_every_lease_instead_of_expiring_them():
    """A registry that was stopped (here: its event loop blocked for two leases) saw no heartbeat
    meanwhile; it must not conclude that every worker died."""
    async def run():
        async with registry(RegistryConfig(lease_s=1.0, sweep_s=0.05, pause_s=0.5)) as (reg, bus):
            seen = await events(bus)
            for worker_id in ("decode-p", "decode-q"):
                await bus.request(subjects.REGISTER, registration(worker_id), RegisterReply)
            time.sleep(2.0)  # the pause: nothing on this loop runs, the registry included
            resumed = time.monotonic()
            while reg._swept_at <= resumed:  # the first sweep after the pause
                await asyncio.sleep(0.01)
            for worker_id in ("decode-p", "decode-q"):
                assert (await bus.request(subjects.HEARTBEAT, beat(worker_id), HeartbeatReply)).registered
            assert [e.kind for e in [seen.get_nowait() for _ in range(seen.qsize())]] == ["joined", "joined"]
    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_forged_left_event_for_a_live_worker_changes_nothing_for_its_peers():
    """Anyone on the bus can publish a "left" event; a worker acts on it only if the registry
    agrees (before, a forged one made decode free slots a live prefill was writing into)."""
    async def run():
        async with registry() as (reg, bus):
            await bus.request(subjects.REGISTER, registration("prefill-f", role="prefill"), RegisterReply)
            gone: asyncio.Queue = asyncio.Queue()
            await on_worker_left(bus, gone.put)
            for instance in ("i1", ""):  # naming the live instance, and naming none
                await bus.publish(subjects.WORKER_EVENTS, WorkerEvent(kind="left", worker_id="prefill-f", role="prefill",
                                                                      reason="forged", instance_id=instance))
            await bus.request(subjects.DEREGISTER, Deregistration(worker_id="prefill-f", instance_id="i1"), Ack)
            assert await asyncio.wait_for(gone.get(), 10) == "prefill-f"  # the real one, events come in order
            assert gone.empty()
    asyncio.run(run())


def test_a_forged_left_event_changes_nothing_for_a_router(caplog):
    """The router's directory, too, keeps a worker the registry still lists (before, a forged
    "left" failed every request in flight to it) and acts on the real departure."""
    def ignored() -> int:
        return sum("ignored a 'left' event" in r.getMessage() for r in caplog.records)

    async def run():
        async with registry() as (reg, bus):
            await bus.request(subjects.REGISTER, registration("prefill-f", role="prefill"), RegisterReply)
            directory, gone = Directory(bus), asyncio.Queue()
            directory.on_left = lambda worker_id, reason: gone.put_nowait((worker_id, reason))
            await directory.start()
            for instance in ("i1", ""):
                await bus.publish(subjects.WORKER_EVENTS, WorkerEvent(kind="left", worker_id="prefill-f", role="prefill",
                                                                      reason="forged", instance_id=instance))
            async with asyncio.timeout(10):
                while ignored() < 2:  # both forged events handled before the real departure
                    await asyncio.sleep(0.01)
            assert "prefill-f" in directory.workers and gone.empty()
            await bus.request(subjects.DEREGISTER, Deregistration(worker_id="prefill-f", instance_id="i1"), Ack)
            worker_id, reason = await asyncio.wait_for(gone.get(), 10)
            assert (worker_id, reason != "forged") == ("prefill-f", True) and gone.empty()
            assert "prefill-f" not in directory.workers
    caplog.set_level("WARNING", logger="baton.router.directory")
    asyncio.run(run())
