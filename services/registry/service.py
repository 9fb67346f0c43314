"""kv-registry: who is alive, what each worker's KV memory looks like, and transfer plans.

State lives in a JetStream key-value bucket (one key per worker, value = WorkerInfo as msgpack)
whose TTL is the lease: a worker that stops heartbeating disappears from the bucket by itself,
and a registry restart loses nothing. A sweeper notices workers that vanished and publishes a
"left" event; a worker whose heartbeat first says it is draining gets a "draining" event.
Never imports torch: it validates plain-data manifests against the model config.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.js.errors import KeyDeletedError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from baton.proto import subjects
from baton.proto.codec import decode, encode
from baton.proto.errors import BatonError, ErrorCode, bad_request
from baton.proto.internal import (Ack, Deregistration, Heartbeat, HeartbeatReply, LookupReply,
                                  LookupRequest, PlanReply, PlanRequest, RegisterReply, WorkerEvent,
                                  WorkerInfo, WorkerLoad, WorkerRegistration)
from baton.shared.bus import Bus
from baton.shared.kv.codec import CodecError, from_plain, to_plain
from baton.shared.kv.descriptors import PlanError
from baton.shared.kv.manifest import Manifest, ManifestError, validate_manifest
from baton.shared.kv.plan import make_plan
from baton.shared.metrics import ServiceMetrics
from baton.shared.model.config import ModelConfig

log = logging.getLogger("baton.registry")
BUCKET = "baton_workers"


@dataclass(frozen=True)
class RegistryConfig:
    lease_s: float = 10.0  # a worker missing heartbeats this long is dropped (heartbeats every lease/4)
    sweep_s: float = 1.0


class Registry:
    def __init__(self, bus: Bus, kv: KeyValue, model: ModelConfig, config: RegistryConfig) -> None:
        self.bus, self.kv, self.model, self.config = bus, kv, model, config
        self._known: dict[str, str] = {}  # worker id -> role, as of the last sweep
        self._plans: dict[tuple[str, str, int, int], dict] = {}  # (p, d, revisions) -> plan
        self.metrics = ServiceMetrics("registry")

    @classmethod
    async def open(cls, bus: Bus, model: ModelConfig, config: RegistryConfig = RegistryConfig()) -> "Registry":
        js = bus.connection.jetstream()
        kv = await js.create_key_value(bucket=BUCKET, ttl=config.lease_s, history=1)
        registry = cls(bus, kv, model, config)
        registry._known = {info.registration.worker_id: info.registration.role for info in await registry._all()}
        return registry

    async def serve(self) -> None:
        self.metrics.serve_from_env()
        q = subjects.REGISTRY_QUEUE
        await self.bus.serve(subjects.REGISTER, WorkerRegistration, self.register, queue=q)
        await self.bus.serve(subjects.HEARTBEAT, Heartbeat, self.heartbeat, queue=q)
        await self.bus.serve(subjects.DEREGISTER, Deregistration, self.deregister, queue=q)
        await self.bus.serve(subjects.LOOKUP, LookupRequest, self.lookup, queue=q)
        await self.bus.serve(subjects.PLAN, PlanRequest, self.plan, queue=q)

    # --- handlers ---------------------------------------------------------------------------
    async def register(self, reg: WorkerRegistration) -> RegisterReply:
        manifest = self._manifest(reg)
        if manifest.worker_id != reg.worker_id or manifest.role != reg.role:
            raise bad_request(f"manifest names worker {manifest.worker_id!r} ({manifest.role}), "
                              f"registration says {reg.worker_id!r} ({reg.role})")
        load = WorkerLoad(free_pages=reg.capacity.total_pages, free_slots=reg.capacity.total_slots,
                          active_requests=0, queued_prompt_tokens=0)
        await self.kv.put(reg.worker_id, encode(WorkerInfo(registration=reg, load=load)))
        if self._known.get(reg.worker_id) is None:
            self._known[reg.worker_id] = reg.role
            await self._event("joined", reg.worker_id, reg.role)
        self.metrics.requests.labels("registered").inc()
        log.info("registered %s %s", reg.role, reg.worker_id)
        return RegisterReply(lease_ms=int(self.config.lease_s * 1000))

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        info = await self._get(beat.worker_id)
        if info is None:
            return HeartbeatReply(registered=False)
        await self.kv.put(beat.worker_id, encode(WorkerInfo(registration=info.registration, load=beat.load)))
        self._known.setdefault(beat.worker_id, info.registration.role)  # e.g. after a registry restart
        if beat.load.draining and not info.load.draining:  # routers look again now, not at their next refresh
            await self._event("draining", beat.worker_id, info.registration.role, "stopping")
        return HeartbeatReply(registered=True)

    async def deregister(self, msg: Deregistration) -> Ack:
        info = await self._get(msg.worker_id)
        if info is not None:
            await self.kv.delete(msg.worker_id)
            self._known.pop(msg.worker_id, None)
            await self._event("left", msg.worker_id, info.registration.role, msg.reason or "deregistered")
        return Ack()

    async def lookup(self, req: LookupRequest) -> LookupReply:
        workers = [w for w in await self._all()
                   if (req.role is None or w.registration.role == req.role)
                   and (req.worker_id is None or w.registration.worker_id == req.worker_id)]
        return LookupReply(workers=workers)

    async def plan(self, req: PlanRequest) -> PlanReply:
        p_entry, d_entry = await self._entry(req.prefill_worker_id), await self._entry(req.decode_worker_id)
        key = (req.prefill_worker_id, req.decode_worker_id, p_entry.revision, d_entry.revision)
        if key not in self._plans:
            p_info, d_info = (decode(e.value, WorkerInfo) for e in (p_entry, d_entry))
            try:
                plan = make_plan(self._manifest(p_info.registration), self._manifest(d_info.registration))
            except PlanError as exc:
                raise bad_request(f"no transfer plan for {req.prefill_worker_id} -> {req.decode_worker_id}: {exc}")
            self._plans[key] = to_plain(plan)
        return PlanReply(prefill_worker_id=req.prefill_worker_id, decode_worker_id=req.decode_worker_id,
                         plan=self._plans[key])

    # --- lease sweeper ----------------------------------------------------------------------
    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_s)
            try:
                alive = {info.registration.worker_id for info in await self._all()}
            except Exception as exc:  # JetStream briefly unavailable: try again next round
                log.warning("sweep failed: %s", exc)
                continue
            for role in ("prefill", "decode"):
                self.metrics.workers.labels(role).set(sum(1 for r in self._known.values() if r == role))
            for worker_id in [w for w in self._known if w not in alive]:
                self.metrics.expired.inc()
                role = self._known.pop(worker_id)
                log.warning("lease expired: %s %s", role, worker_id)
                await self._event("left", worker_id, role, "lease expired")
            self._plans = {k: v for k, v in self._plans.items() if k[0] in alive and k[1] in alive}

    # --- helpers ----------------------------------------------------------------------------
    def _manifest(self, reg: WorkerRegistration) -> Manifest:
        try:
            manifest = from_plain(Manifest, reg.manifest)
            validate_manifest(self.model, manifest)
        except (CodecError, ManifestError) as exc:
            raise bad_request(f"manifest of {reg.worker_id} refused: {exc}")
        return manifest

    async def _entry(self, worker_id: str):
        try:
            return await self.kv.get(worker_id)
        except KeyNotFoundError:
            raise BatonError(ErrorCode.UNAVAILABLE, f"worker {worker_id} is not registered") from None

    async def _get(self, worker_id: str) -> WorkerInfo | None:
        try:
            entry = await self.kv.get(worker_id)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return decode(entry.value, WorkerInfo)

    async def _all(self) -> list[WorkerInfo]:
        """Every live worker: the bucket's keys plus every worker this registry knows, each read
        on its own. Listing keys alone is not trusted: nats-py's keys() can come back empty
        (NoKeysError) for a moment while entries exist, which would drop live workers."""
        try:
            keys = set(await self.kv.keys())
        except NoKeysError:
            keys = set()
        infos = [await self._get(k) for k in sorted(keys | set(self._known))]
        return [i for i in infos if i is not None]

    async def _event(self, kind: str, worker_id: str, role: str, reason: str = "") -> None:
        await self.bus.publish(subjects.WORKER_EVENTS,
                               WorkerEvent(kind=kind, worker_id=worker_id, role=role, reason=reason))
