"""`baton serve <role>`: one service process on one event loop, stopped by SIGTERM/SIGINT.

Every role is built from the one effective config (baton.shared.config). Beside the service, the
process keeps a health file fresh (`baton health <role>` reads it: container health checks) and,
with `metrics.port`, serves Prometheus metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Awaitable, Callable

from baton.health import health_file, remove_stale_health_files
from baton.proto.errors import BatonError
from baton.shared.bus import Bus
from baton.shared.config import Config
from baton.services.runtime import run_service, setup_logging

log = logging.getLogger("baton.serve")


def _model_config(cfg: Config):
    from baton.shared.model.config import ModelConfig
    return ModelConfig.load(Path(cfg.model.path))


async def _registry(stop: asyncio.Event, bus: Bus, cfg: Config) -> None:
    from baton.services.registry.service import Registry, RegistryConfig
    registry = await Registry.open(bus, _model_config(cfg), RegistryConfig(replicas=cfg.registry.replicas,
                                                                         check_metadata=cfg.registry.check_metadata))
    await registry.serve()
    await stop.wait()
    await registry.close()
    await bus.close()


async def _router(stop: asyncio.Event, bus: Bus, cfg: Config) -> None:
    from baton.services.router.service import Router
    from baton.shared.model.tokenizer import TextTokenizer
    router = Router(bus, _model_config(cfg), TextTokenizer.load(Path(cfg.model.path)), cfg.router)
    await router.start()
    await stop.wait()
    await router.stop()
    await bus.close(grace_s=10.0)


async def _http(stop: asyncio.Event, bus: Bus, cfg: Config) -> None:
    from baton.services.http.server import serve
    await serve(stop, bus, cfg)


async def _aggregated(stop: asyncio.Event, bus: Bus, cfg: Config) -> None:
    """The aggregated baseline (prefill and decode in one process; services/aggregated)."""
    from baton.services.aggregated.service import serve
    from baton.services.worker import WorkerConfig
    await serve(stop, bus, WorkerConfig.of("aggregated", cfg))


SERVICES = {"registry": _registry, "router": _router, "http": _http, "aggregated": _aggregated}


# --- health ----------------------------------------------------------------------------------
def _probe(role: str, bus: Bus, worker_id: str | None) -> Callable[[], Awaitable[str | None]]:
    """None when healthy, else why not: connected to NATS, serving (registry, router), or
    registered with the registry (prefill, decode)."""
    async def probe() -> str | None:
        if not bus.connection.is_connected:
            return "not connected to NATS"
        if role in ("registry", "router", "aggregated") and not bus.endpoints:
            return "not serving yet"
        if worker_id is not None:
            from baton.proto import subjects
            from baton.proto.internal import LookupReply, LookupRequest
            try:
                reply = await bus.request(subjects.LOOKUP, LookupRequest(worker_id=worker_id), LookupReply, timeout=2.0)
            except BatonError as exc:
                return f"registry lookup failed: {exc}"
            if not reply.workers:
                return f"{worker_id} is not registered"
        return None
    return probe


UNHEALTHY_RECHECK_S = 0.5  # a failing probe is asked again this soon: a worker that just registered reads healthy


async def keep_health_file(path: Path, role: str, probe: Callable[[], Awaitable[str | None]], interval_s: float) -> None:
    """Rewrite `path` with the probe's verdict every `interval_s` while it is good, and every
    UNHEALTHY_RECHECK_S (at most) while it is not, so that a service that has just become
    healthy (a worker registered after start-up) does not read unhealthy for up to `interval_s`;
    `baton health` reads it."""
    remove_stale_health_files(path.parent, role)
    while True:
        try:
            problem = await probe()
        except Exception as exc:  # noqa: BLE001 - a failing probe is an unhealthy service, not a crash
            problem = f"probe failed: {type(exc).__name__}: {exc}"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"role": role, "pid": os.getpid(), "time": time.time(),
                                       "ok": problem is None, "detail": problem or "ok"}))
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write health file %s: %s", path, exc)
        await asyncio.sleep(interval_s if problem is None else min(interval_s, UNHEALTHY_RECHECK_S))


# --- running ---------------------------------------------------------------------------------
def serve(args, cfg: Config | None = None) -> int:
    if cfg is None:
        from baton.cli import effective_config
        cfg = effective_config(args)
    role = args.role
    setup_logging(role, cfg.log.level.upper())
    from baton.cli import default_nats_url
    url = cfg.nats_servers() or default_nats_url()
    if cfg.metrics.port:
        import prometheus_client
        try:
            prometheus_client.start_http_server(cfg.metrics.port)
        except OSError as exc:
            log.error("metrics.port %d (from %s): %s", cfg.metrics.port, cfg.source("metrics.port"), exc)
            return 1
        log.info("Prometheus metrics on :%d/metrics", cfg.metrics.port)

    async def main(stop: asyncio.Event) -> None:
        limits = None
        if role == "router":
            from baton.proto.limits import Limits
            limits = Limits(max_tokens=cfg.router.max_tokens)
        try:
            bus = await Bus.connect(url, f"baton-{role}", **cfg.nats_options(), **({"limits": limits} if limits else {}))
        except BatonError as exc:
            log.error("%s", exc)
            raise SystemExit(1)
        worker = None
        if role in ("prefill", "decode"):  # its id is made unique here: the health probe asks the registry for it
            from baton.services.worker import WorkerConfig
            worker = WorkerConfig.of(role, cfg)
        path = health_file(role, cfg)
        keeper = None
        if role != "http":  # the frontend answers /health itself
            keeper = asyncio.create_task(keep_health_file(path, role, _probe(role, bus, worker and worker.worker.id),
                                                          cfg.health.interval_s), name="health")
        try:
            if worker is not None:
                await _worker(role, stop, bus, worker)
            else:
                await SERVICES[role](stop, bus, cfg)
        except BatonError as exc:  # e.g. the registry refused the worker: duplicate_worker, a bad manifest
            log.error("%s exits: %s", role, exc)
            raise SystemExit(1)
        finally:
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper
            path.unlink(missing_ok=True)
        log.info("%s stopped", role)

    return run_service(main)


async def _worker(role: str, stop: asyncio.Event, bus: Bus, worker) -> None:
    if role == "prefill":
        from baton.services.prefill.service import PrefillWorker as Role
    else:
        from baton.services.decode.service import DecodeWorker as Role
    await Role(bus, worker).run(stop)
