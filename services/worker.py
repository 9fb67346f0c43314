"""What prefill and decode workers share: the model settings, the parts a worker is built of and
how it runs (`Worker`), registry membership under a lease, NIXL peers from validated manifests,
the single engine thread that owns model and KV store, and the messages that tell routers what a
worker's cache holds (prefill's prefix cache, decode's turn cache: proto `PrefixEvents`)."""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import (Ack, CachedPrefix, Capacity, Deregistration, Heartbeat, HeartbeatReply,
                                  LookupReply, LookupRequest, PrefixEvents, RegisterReply, WorkerEvent, WorkerLoad,
                                  WorkerRegistration)
from baton.shared import wake_latency
from baton.shared.bus import Bus
from baton.shared.bus.wire import decode_event
from baton.shared.config import Config, ConfigError, WorkerSection, check_section, cpu_ids
from baton.shared.engine.runner import ModelRunner, SpecConfig
from baton.shared.kv.cache_changes import Cached
from baton.shared.kv.manifest import Manifest
from baton.shared.kv.store import KVStore
from baton.shared.metrics import ServiceMetrics
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, fingerprint, load_model
from baton.shared.transfer.agent import PeerInfo, TransferAgent
from baton.shared.transfer.regions import regions_of

log = logging.getLogger("baton.worker")
# prefill, and decode for a prompt it computes itself: the engine thread, having handed first tokens
# to the loop, waits at most this for them to be on the wire before it computes on (holding the core
# and the GIL the loop needs to send them)
FIRST_TOKENS_WAIT_S = 0.002
HEARTBEAT_S = 1.0  # the load in heartbeats is at most this old (router balancing, tests' leak checks)


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process runs with: its role, the model directory and the [worker] settings
    (each declared once, in shared/config.py). An empty `worker.id` becomes role + random suffix,
    unique per process (a restart is a new NIXL peer)."""
    role: str
    model: Path = DEFAULT_MODEL_DIR
    worker: WorkerSection = WorkerSection()

    def __post_init__(self) -> None:
        check_section(self.worker)  # loaded settings were checked already; these may come from code (tests)
        if not self.worker.id:
            object.__setattr__(self, "worker", replace(self.worker, id=f"{self.role}-{uuid.uuid4().hex[:10]}"))

    @classmethod
    def of(cls, role: str, cfg: Config) -> WorkerConfig:
        """From the effective config: its [model] path and its [worker] section."""
        return cls(role, Path(cfg.model.path), cfg.worker)


def use_threads(worker: WorkerSection) -> None:
    """This process's torch threads from [worker] (0: torch's default); call before the model loads."""
    if worker.threads:
        torch.set_num_threads(worker.threads)


def use_cpus(worker: WorkerSection) -> None:
    """Keep this process on [worker] cpus, if set: every thread it has now (threads started
    later inherit it). A CPU this process may not use is a configuration error."""
    if not worker.cpus:
        return
    wanted, allowed = cpu_ids(worker.cpus), os.sched_getaffinity(0)
    if not wanted <= allowed:
        raise ConfigError(f"worker.cpus: {worker.cpus} names CPUs this process may not run on "
                          f"(it may use {sorted(allowed)})")
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), wanted)


def speculation(worker: WorkerSection) -> SpecConfig:
    """The engine's speculation settings from [worker] (where `spec` is mtp | off)."""
    return SpecConfig(worker.spec == "mtp", worker.draft_tokens, worker.draft_state)


class Worker:
    """A prefill or decode worker: the parts it is built of, each from the one before (the model,
    its KV store and runner, the manifest of the store's memory, the NIXL agent that registers
    that memory, the engine thread, the metrics, the registry membership), and how it runs.

    A role adds `load()` (its heartbeat's load), `_serve()` (its subjects and tasks),
    `_peer_left(worker_id)` (a registered worker is gone) and `_leave()` (stop serving, end what it
    holds, close the bus)."""

    def __init__(self, bus: Bus, config: WorkerConfig, draft_windows: bool, copy_threads: int = 0) -> None:
        """`draft_windows`: a draft window per slot (`KVStore.for_worker`); `copy_threads`:
        TransferAgent's, for parallel WRITEs."""
        w = config.worker
        use_cpus(w)
        use_threads(w)
        self.wake_latency = wake_latency.hold(w.cpu_wake_latency_us)  # held while the worker lives
        self.bus, self.config = bus, config
        self.model = load_model(config.model, w.dtype, w.device, w.projection)
        self.spec = speculation(w)
        self.store = KVStore.for_worker(self.model.cfg, w, draft_enabled=draft_windows, dtype=self.model.dtype,
                                        device=self.model.device)
        self.runner = ModelRunner(self.model, self.store, self.spec, w.prefill_chunk)
        self.manifest = self.store.manifest(w.id, fingerprint(config.model), role=config.role)
        self.lookup = peer_lookup(bus)
        self.agent = TransferAgent(w.id, regions_of(self.manifest), lookup=self.lookup, copy_threads=copy_threads)
        self.engine = EngineThread()
        self.metrics = ServiceMetrics(config.role)
        self.membership = Membership(bus, registration(config, self.manifest, self.agent.metadata(),
                                                       self.model.cfg.max_position_embeddings), self.load)

    async def run(self, stop: asyncio.Event) -> None:
        """Register, serve until `stop` is set, leave. Raises the registry's refusal of our worker
        id (another live instance holds it), also when found out while serving."""
        self.metrics.serve_from_env()
        self.membership.on_refused = stop.set
        async with self.agent:
            await self.membership.start()  # the worker id is ours before we serve its subjects
            await self._serve()
            await on_worker_left(self.bus, self._peer_left)
            await stop.wait()
            await self._leave()
        self.engine.close()
        if self.wake_latency is not None:
            self.wake_latency.close()
        if self.membership.refusal is not None:
            raise self.membership.refusal


class EngineThread:
    """The one thread that touches the model and the KV store (the store has no locks)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class Membership:
    """Register with the registry, heartbeat under the lease (re-registering when the registry
    forgot us, e.g. after our lease expired), deregister on stop. The registration names this
    process's instance: when another live instance holds the worker id, `start` raises
    `duplicate_worker`; when that is found out later, `refusal` is set and `on_refused` called
    (the worker stops: it must not serve the other instance's subjects)."""
    bus: Bus
    registration: WorkerRegistration
    load: Callable[[], WorkerLoad]
    lease_s: float = 5.0
    on_refused: Callable[[], Any] = lambda: None
    refusal: BatonError | None = field(default=None, init=False)
    _task: asyncio.Task | None = field(default=None, init=False)

    async def start(self, timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                reply = await self.bus.request(subjects.REGISTER, self.registration, RegisterReply, timeout=5.0)
                self.lease_s = reply.lease_ms / 1000
                break
            except BatonError as exc:
                if exc.code.value not in ("unavailable", "timeout") or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        self._task = asyncio.create_task(self._beat(), name="heartbeat")
        log.info("registered as %s %s (instance %s)", self.registration.role, self.registration.worker_id,
                 self.registration.instance_id)

    async def _beat(self) -> None:
        while self.refusal is None:
            await asyncio.sleep(min(HEARTBEAT_S, self.lease_s / 4))
            await self.beat()

    async def beat(self) -> None:
        """Send the load now (e.g. that we are draining) instead of at the next heartbeat."""
        reg = self.registration
        try:
            beat = Heartbeat(worker_id=reg.worker_id, instance_id=reg.instance_id, load=self.load())
            reply = await self.bus.request(subjects.HEARTBEAT, beat, HeartbeatReply, timeout=2.0)
            if not reply.registered:
                await self.bus.request(subjects.REGISTER, reg, RegisterReply, timeout=5.0)
        except BatonError as exc:
            if exc.code is ErrorCode.DUPLICATE_WORKER:
                log.error("%s", exc.message)
                self.refusal = exc
                self.on_refused()
            else:  # registry restarting: keep serving, keep trying
                log.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self.refusal is not None:  # the worker id is another instance's: leave its entry alone
            return
        try:
            await self.bus.request(subjects.DEREGISTER, Deregistration(
                worker_id=self.registration.worker_id, instance_id=self.registration.instance_id,
                reason="shutdown"), Ack, timeout=2.0)
        except BatonError as exc:
            log.warning("deregister failed: %s", exc)


def registration(config: WorkerConfig, manifest: Manifest, nixl_metadata: bytes, max_seq_len: int) -> WorkerRegistration:
    w = config.worker
    return WorkerRegistration(
        worker_id=w.id, instance_id=uuid.uuid4().hex, role=config.role, manifest=manifest,
        nixl_metadata=nixl_metadata,
        capacity=Capacity(total_pages=w.num_pages, page_size=w.page_size, total_slots=w.num_slots,
                          max_seq_len=max_seq_len))


async def on_worker_left(bus: Bus, callback: Callable[[str], Any]) -> None:
    """Call `await callback(worker_id)` whenever the registry reports a worker gone (deregistered
    or lease expired): its NIXL peer is dropped and what it held is released. Anyone on the bus
    can publish an event, so a "left" counts only if the registry's own view agrees."""
    async def handle(msg) -> None:
        if (event := decode_event(msg.data, WorkerEvent, log)) is None:
            return
        if event.kind == "left" and await _left_indeed(bus, event):
            await callback(event.worker_id)
    await bus.subscribe(subjects.WORKER_EVENTS, handle)


async def _left_indeed(bus: Bus, event: WorkerEvent) -> bool:
    """False while the registry lists the instance the event names (any, if it names none) as
    live. When the registry cannot be asked, the event is believed: a real departure matters more."""
    try:
        reply = await bus.request(subjects.LOOKUP, LookupRequest(worker_id=event.worker_id), LookupReply, timeout=2.0)
    except BatonError as exc:
        log.warning("worker %s left, unconfirmed (registry lookup failed: %s)", event.worker_id, exc)
        return True
    live = [w.registration.instance_id for w in reply.workers]
    if any(not event.instance_id or instance == event.instance_id for instance in live):
        log.warning("ignored a 'left' event for %s, which the registry lists as live", event.worker_id)
        return False
    return True


def peer_lookup(bus: Bus) -> Callable[[str], Any]:
    """NIXL peers come only from manifests the registry validated (looked up by worker id)."""
    async def lookup(worker_id: str) -> PeerInfo | None:
        reply = await bus.request(subjects.LOOKUP, LookupRequest(worker_id=worker_id), LookupReply, timeout=2.0)
        if not reply.workers:
            return None
        reg = reply.workers[0].registration
        return PeerInfo(reg.worker_id, reg.nixl_metadata, regions_of(reg.manifest))
    return lookup


async def publish_changes(bus: Bus, reg: WorkerRegistration, block: int,
                          changes: tuple[int, list[Cached], list[Cached]] | None) -> None:
    """A cache's numbered changes (`take_changes`), if any, to every router. One that cannot go out
    is logged: routers see the gap in seq and ask for a snapshot."""
    if changes is None:
        return
    seq, added, evicted = changes
    try:
        await bus.publish(subjects.PREFIX_EVENTS, PrefixEvents(
            worker_id=reg.worker_id, instance_id=reg.instance_id, seq=seq, block=block, added=_plain(added),
            evicted=_plain(evicted)))
    except BatonError as exc:
        log.warning("cache changes %d not published: %s", seq, exc)


def snapshot_message(reg: WorkerRegistration, block: int, seq: int, held: list[Cached]) -> PrefixEvents:
    """Everything a cache holds (`snapshot`), current at `seq`."""
    return PrefixEvents(worker_id=reg.worker_id, instance_id=reg.instance_id, seq=seq, block=block,
                        added=_plain(held), snapshot=True)


def _plain(entries: list[Cached]) -> list[CachedPrefix]:
    return [CachedPrefix(blocks=e.blocks, digest=e.digest, tokens=e.tokens) for e in entries]
