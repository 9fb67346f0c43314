"""`baton serve <role>`: one service process on one event loop, stopped by SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging

from baton.proto.errors import BatonError
from baton.shared.bus import Bus
from baton.shared.model.config import ModelConfig
from baton.services.runtime import run_service, setup_logging

log = logging.getLogger("baton.serve")


async def _registry(stop: asyncio.Event, bus: Bus, args) -> None:
    from baton.services.registry.service import Registry
    registry = await Registry.open(bus, ModelConfig.load(args.model))
    await registry.serve()
    sweeper = asyncio.create_task(registry.sweep_forever(), name="lease-sweeper")
    await stop.wait()
    sweeper.cancel()
    await bus.close()


async def _router(stop: asyncio.Event, bus: Bus, args) -> None:
    from baton.services.router.service import Router, RouterConfig
    from baton.shared.model.tokenizer import TextTokenizer
    router = Router(bus, ModelConfig.load(args.model), TextTokenizer.load(args.model), RouterConfig())
    await router.start()
    await stop.wait()
    await router.stop()
    await bus.close(grace_s=10.0)


def _worker_config(args):
    from baton.services.worker import WorkerConfig
    return WorkerConfig(role=args.role, model=args.model, worker_id=args.worker_id, mode=args.kv_mode,
                        num_pages=args.num_pages, page_size=args.page_size, num_slots=args.num_slots,
                        spec=args.spec == "mtp", draft_tokens=args.draft_tokens, draft_state=args.draft_state,
                        max_batch=args.max_batch, threads=args.threads)


async def _prefill(stop: asyncio.Event, bus: Bus, args) -> None:
    from baton.services.prefill.service import serve
    await serve(stop, bus, _worker_config(args))


async def _decode(stop: asyncio.Event, bus: Bus, args) -> None:
    from baton.services.decode.service import serve
    await serve(stop, bus, _worker_config(args))


SERVICES = {"registry": _registry, "router": _router, "prefill": _prefill, "decode": _decode}


def serve(args) -> int:
    setup_logging(args.role, args.log_level)
    from baton.cli import default_nats_url
    url = args.nats_url or default_nats_url()

    async def main(stop: asyncio.Event) -> None:
        try:
            bus = await Bus.connect(url, f"baton-{args.role}")
        except BatonError as exc:
            log.error("%s", exc)
            raise SystemExit(1)
        await SERVICES[args.role](stop, bus, args)
        log.info("%s stopped", args.role)

    return run_service(main)
