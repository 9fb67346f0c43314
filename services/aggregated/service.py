"""aggregated: the baseline for comparison, one process doing prefill and decode together.

It serves the public API itself (`baton.v1.generate` and `baton.v1.cancel`, in the routers'
queue group) with the router's own request handling, `PublicAPI`: the same validation,
tokenization, text deltas, stop strings, stream chunks and summaries, over jobs of the in-process
`AggregatedEngine` instead of the router's flows through prefill -> NIXL -> decode. No registry,
no NIXL.

    python -m baton.services.aggregated --nats-url nats://127.0.0.1:4222
"""
from __future__ import annotations

import asyncio
import logging

from baton.proto import subjects
from baton.shared.bus import Bus
from baton.shared.config import RouterSection
from baton.shared.engine.sampling import SamplingParams
from baton.shared.metrics import ServiceMetrics
from baton.shared.model.checkpoint import load_model
from baton.shared.model.tokenizer import TextTokenizer

from ..router.public import PublicAPI
from ..worker import WorkerConfig, use_cpus, use_threads
from .engine import PREFILL_TOKENS, AggregatedEngine, Job

log = logging.getLogger("baton.aggregated")


class AggregatedService:
    """The public API (the router's `PublicAPI`) over an in-process engine."""

    def __init__(self, bus: Bus, engine: AggregatedEngine, tokenizer: TextTokenizer,
                 config: RouterSection = RouterSection()) -> None:
        self.bus, self.engine = bus, engine
        self.api = PublicAPI(bus, engine.runner.model.cfg, tokenizer, config, self._open_flow,
                             ServiceMetrics("router"))

    async def start(self) -> None:
        await self.api.serve()

    async def stop(self) -> None:
        self.api.close("service shutting down")

    async def _open_flow(self, request_id: str, ids: list[int], max_tokens: int, sampling) -> Job:
        params = SamplingParams.of(sampling, sampling.seed)
        return await self.engine.submit(request_id, ids, max_tokens, params, list(sampling.stop_token_ids),
                                        sampling.draft_tokens, sampling.min_tokens, sampling.logprobs,
                                        sampling.prompt_logprobs)


async def open_service(bus: Bus, config: WorkerConfig, prefill_tokens: int = PREFILL_TOKENS) -> AggregatedService:
    """Load the model, start the engine and serve the public subjects on `bus`."""
    w = config.worker
    use_cpus(w)
    use_threads(w)
    engine = AggregatedEngine(load_model(config.model, w.dtype, w.device, w.projection), w, prefill_tokens)
    service = AggregatedService(bus, engine, TextTokenizer.load(config.model))
    await engine.start()
    await service.start()
    log.info("serving %s (spec %s, k=%d, draft state %s, %d slots)", subjects.GENERATE,
             w.spec, w.draft_tokens, w.draft_state, w.num_slots)
    return service


async def close_service(service: AggregatedService, grace_s: float = 10.0) -> None:
    """Stop taking requests, let those in flight finish for `grace_s`, close the bus and engine."""
    try:
        await service.bus.close(grace_s=grace_s)
    finally:
        await service.stop()
        await service.engine.close()


async def serve(stop: asyncio.Event, bus: Bus, config: WorkerConfig, prefill_tokens: int = PREFILL_TOKENS) -> None:
    """Serve until `stop` is set; then finish in-flight requests (10 s grace) and close `bus`."""
    service = await open_service(bus, config, prefill_tokens)
    await stop.wait()
    log.info("stopping: no new requests; %d in flight", len(service.api.flows))
    await close_service(service)
