"""kv-registry: who is alive, what each worker's KV memory looks like, and transfer plans.

State lives in a JetStream key-value bucket (one key per worker, value = WorkerInfo as msgpack),
so a registry restart loses nothing. The registry keeps its view of the bucket from one watch
held for the process's life (listing keys per call would leave a server-side consumer behind
each time), and decides itself when a lease expired: a worker whose entry has not changed for a
lease, by this registry's clock, is deleted and announced "left" (after a pause of the registry
itself, every lease starts over) once it is also gone from NATS: a worker whose subscriptions
nats-server still holds is stalled, not dead (paused, starved), and is kept up to `stall_grace_s`
longer, so a request it holds can still finish. A worker whose heartbeat first says it is draining gets a
"draining" event.
Never imports torch: it validates manifests (KV records, no tensors) against the model config.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from baton.proto import subjects
from baton.proto.codec import decode, encode
from baton.proto.errors import BatonError, ErrorCode, bad_request
from baton.proto.internal import (Ack, Deregistration, Heartbeat, HeartbeatReply, LookupReply,
                                  LookupRequest, PlanReply, PlanRequest, RegisterReply, WorkerEvent,
                                  WorkerInfo, WorkerLoad, WorkerRegistration)
from baton.shared.bus import Bus
from baton.shared.kv.descriptors import PlanError
from baton.shared.kv.manifest import Manifest, ManifestError, validate_manifest
from baton.shared.kv.plan import TransferPlan, make_plan
from baton.shared.metrics import ServiceMetrics
from baton.shared.model.config import ModelConfig
from baton.shared.transfer.metadata_check import MetadataCheck
from baton.shared.transfer.regions import regions_of

log = logging.getLogger("baton.registry")
BUCKET = "baton_workers"
STREAM_IN_USE = 10058  # JetStream: a stream of this name exists with another configuration
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream: the key changed since the revision given


@dataclass(frozen=True)
class RegistryConfig:
    lease_s: float = 10.0  # a worker missing heartbeats this long is dropped (heartbeats every lease/4)
    sweep_s: float = 1.0
    pause_s: float = 2.0  # a sweep this much later than due: this registry was paused (SIGSTOP, a frozen VM,
    # a starved loop) and saw no heartbeat meanwhile, so every lease starts over instead of expiring
    stall_grace_s: float = 30.0  # how much longer than its lease a silent worker that nats-server still
    # lists as subscribed (a stalled process, not a dead one: its connection is open) stays registered
    probe_s: float = 0.5  # how long the liveness probe of a silent worker waits for an answer
    replicas: int = 1  # of the workers' bucket (a NATS cluster: 3)
    check_metadata: bool = True  # load each registration's NIXL metadata as a peer would (metadata_check.py):
    # needs the workers' UCX addresses reachable from the registry; off for a registry outside the data network
    check_timeout_s: float = 10.0  # one metadata check, the checking process's start-up included


@dataclass(frozen=True)
class Lease:
    """A live worker as this registry sees it."""
    info: WorkerInfo
    revision: int  # of its entry in the bucket
    seen_at: float  # this registry's monotonic clock when the entry last changed


class Registry:
    def __init__(self, bus: Bus, kv: KeyValue, model: ModelConfig, config: RegistryConfig,
                 metadata_check: MetadataCheck | None = None) -> None:
        self.bus, self.kv, self.model, self.config = bus, kv, model, config
        self.metadata_check = metadata_check
        self.leases: dict[str, Lease] = {}
        self._revisions: dict[str, int] = {}  # newest revision applied per key, deletions included
        self._plans: dict[tuple[str, str, int, int], TransferPlan] = {}  # (p, d, revisions) -> plan
        self._watcher: KeyValue.KeyWatcher | None = None
        self._tasks: list[asyncio.Task] = []
        self._swept_at = time.monotonic()
        self._stalled: set[str] = set()  # silent past their lease, kept while NATS still lists them
        self.metrics = ServiceMetrics("registry")

    @classmethod
    async def open(cls, bus: Bus, model: ModelConfig, config: RegistryConfig = RegistryConfig()) -> "Registry":
        check = MetadataCheck(config.check_timeout_s) if config.check_metadata else None
        if check is not None:
            await check.start()
        registry = cls(bus, await open_bucket(bus.connection.jetstream(), config.replicas), model, config, check)
        await registry._load()
        return registry

    async def serve(self) -> None:
        """Serve the registry subjects; watch the bucket and sweep leases until `close`."""
        self.metrics.serve_from_env()
        self._tasks = [asyncio.create_task(self._watch_forever(), name="bucket-watch"),
                       asyncio.create_task(self.sweep_forever(), name="lease-sweeper")]
        q = subjects.REGISTRY_QUEUE
        await self.bus.serve(subjects.REGISTER, WorkerRegistration, self.register, queue=q)
        await self.bus.serve(subjects.HEARTBEAT, Heartbeat, self.heartbeat, queue=q)
        await self.bus.serve(subjects.DEREGISTER, Deregistration, self.deregister, queue=q)
        await self.bus.serve(subjects.LOOKUP, LookupRequest, self.lookup, queue=q)
        await self.bus.serve(subjects.PLAN, PlanRequest, self.plan, queue=q)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watcher is not None:
            await self._watcher.stop()
        if self.metadata_check is not None:
            await self.metadata_check.close()

    # --- handlers ---------------------------------------------------------------------------
    async def register(self, reg: WorkerRegistration) -> RegisterReply:
        manifest = self._manifest(reg)
        if manifest.worker_id != reg.worker_id or manifest.role != reg.role:
            raise bad_request(f"manifest names worker {manifest.worker_id!r} ({manifest.role}), "
                              f"registration says {reg.worker_id!r} ({reg.role})")
        lease = self.leases.get(reg.worker_id)
        if lease is not None:
            self._check_instance(lease, reg.instance_id, "registration")
            if lease.info.registration != reg:
                raise bad_request(f"instance {reg.instance_id} of {reg.worker_id} registered again with another "
                                  "manifest or capacity; a registration never changes while its instance lives")
        else:
            await self._check_metadata(reg, manifest)
        load = WorkerLoad(free_pages=reg.capacity.total_pages, free_slots=reg.capacity.total_slots,
                          active_requests=0, queued_prompt_tokens=0)
        try:
            await self._put(WorkerInfo(registration=reg, load=load), last=lease.revision if lease else 0)
        except KeyWrongLastSequenceError:  # registered meanwhile, here or at another registry, or our own late write
            if not await self._put_over_own(WorkerInfo(registration=reg, load=load)):
                raise BatonError(ErrorCode.DUPLICATE_WORKER, f"worker {reg.worker_id} was registered by another "
                                 f"instance while instance {reg.instance_id} registered") from None
        if lease is None:
            await self._event("joined", reg)
        self.metrics.requests.labels("registered").inc()
        log.info("registered %s %s", reg.role, reg.worker_id)
        return RegisterReply(lease_ms=int(self.config.lease_s * 1000))

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        lease = self.leases.get(beat.worker_id)
        if lease is None:
            return HeartbeatReply(registered=False)
        self._check_instance(lease, beat.instance_id, "heartbeat")
        info = lease.info
        try:
            await self._put(WorkerInfo(registration=info.registration, load=beat.load), last=lease.revision)
        except KeyWrongLastSequenceError:  # dropped or re-registered meanwhile, or our own late write
            if not await self._put_over_own(WorkerInfo(registration=info.registration, load=beat.load)):
                return HeartbeatReply(registered=False)
        if beat.load.draining and not info.load.draining:  # routers look again now, not at their next refresh
            await self._event("draining", info.registration, "stopping")
        return HeartbeatReply(registered=True)

    async def deregister(self, msg: Deregistration) -> Ack:
        lease = self.leases.get(msg.worker_id)
        if lease is not None:
            self._check_instance(lease, msg.instance_id, "deregistration")
            await self._drop(msg.worker_id, lease, msg.reason or "deregistered")
        return Ack()

    async def lookup(self, req: LookupRequest) -> LookupReply:
        workers = [lease.info for worker_id, lease in sorted(self.leases.items())
                   if (req.role is None or lease.info.registration.role == req.role)
                   and (req.worker_id is None or worker_id == req.worker_id)]
        return LookupReply(workers=workers)

    async def plan(self, req: PlanRequest) -> PlanReply:
        p_lease, d_lease = self._lease(req.prefill_worker_id), self._lease(req.decode_worker_id)
        key = (req.prefill_worker_id, req.decode_worker_id, p_lease.revision, d_lease.revision)
        if key not in self._plans:
            try:
                plan = make_plan(self._manifest(p_lease.info.registration), self._manifest(d_lease.info.registration))
            except PlanError as exc:
                raise bad_request(f"no transfer plan for {req.prefill_worker_id} -> {req.decode_worker_id}: {exc}")
            self._plans[key] = plan
        return PlanReply(prefill_worker_id=req.prefill_worker_id, decode_worker_id=req.decode_worker_id,
                         plan=self._plans[key])

    # --- leases ---------------------------------------------------------------------------
    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_s)
            try:
                await self.sweep()
            except Exception as exc:  # JetStream briefly unavailable: try again next round
                log.warning("sweep failed: %s", exc)

    async def sweep(self) -> None:
        """Drop every worker whose entry has not changed for a lease, unless this registry was
        paused: then it could not see their heartbeats, and every lease starts over."""
        now = time.monotonic()
        late, self._swept_at = now - self._swept_at - self.config.sweep_s, now
        if late > self.config.pause_s:
            log.warning("this registry was paused for %.1f s: every lease starts over", late)
            self.leases = {w: replace(lease, seen_at=now) for w, lease in self.leases.items()}
        silent = [(w, lease) for w, lease in self.leases.items() if now - lease.seen_at > self.config.lease_s]
        gone = await asyncio.gather(*(self._gone(lease) for _, lease in silent))
        for (worker_id, lease), dead in zip(silent, gone):
            if self.leases.get(worker_id) is not lease:  # it beat (or left) while we probed
                continue
            if dead or now - lease.seen_at > self.config.lease_s + self.config.stall_grace_s:
                self.metrics.expired.inc()
                log.warning("lease expired: %s %s", lease.info.registration.role, worker_id)
                await self._drop(worker_id, lease, "lease expired")
            elif worker_id not in self._stalled:
                self._stalled.add(worker_id)
                log.warning("%s %s missed its heartbeats for %.1f s but still holds its subscriptions "
                            "(stalled, not gone): kept for up to %g s more", lease.info.registration.role,
                            worker_id, now - lease.seen_at, self.config.stall_grace_s)
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(role).set(
                sum(1 for lease in self.leases.values() if lease.info.registration.role == role))
        self._plans = {k: v for k, v in self._plans.items() if k[0] in self.leases and k[1] in self.leases}

    async def _gone(self, lease: Lease) -> bool:
        """True when nats-server has no subscriber on the worker's release subject: its process died
        or lost its connection. An answer (an error reply to the empty probe) or silence (a paused or
        starved process, whose connection stays open) means it is still there."""
        reg = lease.info.registration
        release = subjects.decode_release if reg.role == "decode" else subjects.prefill_release
        try:
            await self.bus.connection.request(release(reg.worker_id), b"", timeout=self.config.probe_s)
        except nats.errors.NoRespondersError:
            return True
        except (asyncio.TimeoutError, nats.errors.Error):
            return False
        return False

    async def _put(self, info: WorkerInfo, last: int) -> None:
        """Write the worker's entry if it is still at revision `last` (0: if it has none)."""
        worker_id = info.registration.worker_id
        data = encode(info)
        revision = await (self.kv.update(worker_id, data, last) if last else self.kv.create(worker_id, data))
        self._apply(worker_id, revision, info)

    async def _put_over_own(self, info: WorkerInfo) -> bool:
        """After a write was refused for a stale revision: write over the entry if it is still this
        instance's. A write of ours whose acknowledgement timed out (its JetStream leader cut off)
        may have landed later, unseen by us and not yet by the watch. False if the entry is gone
        or another instance's."""
        worker_id = info.registration.worker_id
        try:
            entry = await self.kv.get(worker_id)
        except KeyNotFoundError:  # deleted included
            return False
        current = decode(entry.value, WorkerInfo)
        if current.registration.instance_id != info.registration.instance_id:
            return False
        self._apply(worker_id, entry.revision, current)
        try:
            await self._put(info, last=entry.revision)
        except KeyWrongLastSequenceError:  # changed again meanwhile: the caller's refusal stands
            return False
        log.info("%s's entry held a write of ours that landed after its timeout; written over it", worker_id)
        return True

    async def _drop(self, worker_id: str, lease: Lease, reason: str) -> None:
        """Delete the worker's entry unless it changed meanwhile (a heartbeat, maybe at another
        registry), and announce that it left."""
        try:
            await self.kv.delete(worker_id, last=lease.revision)
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                return
            raise
        if self.leases.get(worker_id) is lease:
            del self.leases[worker_id]
        await self._event("left", lease.info.registration, reason)

    # --- the bucket watch -----------------------------------------------------------------
    async def _load(self) -> None:
        """Every entry in the bucket now; then the same watch follows every change."""
        self._watcher = await self.kv.watchall()
        while (entry := await self._watcher.updates(timeout=10.0)) is not None:
            self._on_entry(entry)

    async def _watch_forever(self) -> None:
        async for entry in self._watcher:
            self._on_entry(entry)

    def _on_entry(self, entry: KeyValue.Entry) -> None:
        if entry.operation in (KV_DEL, KV_PURGE):
            self._apply(entry.key, entry.revision, None)
            return
        try:
            info = decode(entry.value, WorkerInfo)
        except BatonError as exc:
            log.warning("ignored unreadable entry %s in bucket %s: %s", entry.key, BUCKET, exc)
            return
        self._apply(entry.key, entry.revision, info)

    def _apply(self, worker_id: str, revision: int, info: WorkerInfo | None) -> None:
        """Record a change of a worker's entry (None: deleted), unless a newer one was applied
        already: the watch also delivers this registry's own writes, after it applied them."""
        if revision <= self._revisions.get(worker_id, 0):
            return
        self._revisions[worker_id] = revision
        self._stalled.discard(worker_id)
        if info is None:
            self.leases.pop(worker_id, None)
        else:
            self.leases[worker_id] = Lease(info, revision, time.monotonic())

    # --- helpers ----------------------------------------------------------------------------
    def _manifest(self, reg: WorkerRegistration) -> Manifest:
        try:
            validate_manifest(self.model, reg.manifest)
        except ManifestError as exc:
            raise bad_request(f"manifest of {reg.worker_id} refused: {exc}")
        return reg.manifest

    async def _check_metadata(self, reg: WorkerRegistration, manifest: Manifest) -> None:
        """Refuse a registration whose NIXL metadata a peer could not use, before anyone looks it up."""
        if self.metadata_check is None:
            return
        try:
            problem = await self.metadata_check.problem(reg.worker_id, reg.nixl_metadata, regions_of(manifest))
        except asyncio.TimeoutError:
            raise BatonError(ErrorCode.UNAVAILABLE, f"the check of {reg.worker_id}'s NIXL metadata took over "
                             f"{self.config.check_timeout_s}s; try again") from None
        if problem:
            self.metrics.requests.labels("refused_metadata").inc()
            raise bad_request(f"registration of {reg.role} {reg.worker_id} refused: {problem}")

    @staticmethod
    def _check_instance(lease: Lease, instance_id: str, what: str) -> None:
        reg = lease.info.registration
        if instance_id != reg.instance_id:
            raise BatonError(ErrorCode.DUPLICATE_WORKER, (
                f"{what} of {reg.role} {reg.worker_id} from instance {instance_id} refused: instance "
                f"{reg.instance_id} holds this worker id and its lease is alive; give every worker its own id"))

    def _lease(self, worker_id: str) -> Lease:
        lease = self.leases.get(worker_id)
        if lease is None:
            raise BatonError(ErrorCode.UNAVAILABLE, f"worker {worker_id} is not registered")
        return lease

    async def _event(self, kind: str, reg: WorkerRegistration, reason: str = "") -> None:
        await self.bus.publish(subjects.WORKER_EVENTS, WorkerEvent(
            kind=kind, worker_id=reg.worker_id, role=reg.role, reason=reason, instance_id=reg.instance_id))


async def open_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """The workers' bucket with `replicas`, without a TTL: the registry decides when a lease
    expired (a bucket TTL expired every entry at once when the registry itself had been paused).
    An existing bucket gets this replica count and loses a TTL an older registry gave it."""
    try:
        return await js.create_key_value(bucket=BUCKET, history=1, replicas=replicas)
    except BadRequestError as exc:
        if exc.err_code != STREAM_IN_USE:
            raise
    info = await js.stream_info(f"KV_{BUCKET}")
    await js.update_stream(replace(info.config, max_age=0, num_replicas=replicas))
    return await js.key_value(BUCKET)
