"""router: the public entry. Serves the public API (`PublicAPI`: `baton.v1.generate` and
`baton.v1.cancel`, validation, tokenization, text) and drives each request through the cluster in
a Flow: admission, the pick of a prefill and decode pair, the hand-off, the tokens.
Never imports torch: the tokenizer is the `tokenizers` library."""
from __future__ import annotations

import asyncio
import logging

from baton.proto.internal import SamplingParams
from baton.shared.bus import Bus
from baton.shared.config import RouterSection
from baton.shared.metrics import ServiceMetrics
from baton.shared.model.config import ModelConfig
from baton.shared.model.tokenizer import TextTokenizer

from .admission import AdmissionQueue
from .affinity import PrefixAffinity
from .directory import Directory
from .flow import Flow, RouterPolicy, RouterTimeouts
from .public import PublicAPI
from .tokens import TokenInbox

log = logging.getLogger("baton.router")


class Router:
    def __init__(self, bus: Bus, model: ModelConfig, tokenizer: TextTokenizer, config: RouterSection) -> None:
        """`config`: the [router] section (its queue, in-flight bound, affinity weight, timeouts)."""
        self.bus, self.config = bus, config
        self.timeouts = RouterTimeouts.of(config)
        self.directory = Directory(bus, PrefixAffinity(config.prefix_affinity))
        self.directory.on_left = self._worker_left
        self.directory.on_refresh = lambda: self.admission.wake()  # a worker that joined admits who waits
        self.tokens = TokenInbox(bus)
        self.metrics = ServiceMetrics("router")
        self.admission = AdmissionQueue(self._decode_slots, config.max_queued, config.max_queue_s, self.metrics)
        self.api = PublicAPI(bus, model, tokenizer, config, self._open_flow, self.metrics)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.metrics.serve_from_env()
        self.bus.on_reconnected.append(self._reconnected)
        await self.directory.start()
        await self.tokens.start()
        self._tasks.append(asyncio.create_task(self.directory.refresh_forever(), name="directory"))
        await self.api.serve()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.admission.close()
        self.api.close("router shutting down")

    async def _open_flow(self, request_id: str, ids: list[int], max_tokens: int, sampling: SamplingParams) -> Flow:
        """What drives one request through the cluster."""
        return Flow(self.bus, self.directory, self.tokens, self.timeouts, request_id, ids, max_tokens, sampling,
                    self.admission, RouterPolicy.of(self.config))

    def _decode_slots(self) -> int:
        """Requests the decode workers can hold at once, all together; 0 while no prefill or no
        decode takes work (requests wait in the queue for one to register)."""
        decodes = [w for w in self.directory.of_role("decode") if not w.load.draining]
        if not any(not w.load.draining for w in self.directory.of_role("prefill")):
            return 0
        return sum(w.registration.capacity.total_slots for w in decodes)

    def _reconnected(self) -> None:
        for flow in self.api.flows.values():
            flow.reconnected()

    def _worker_left(self, worker_id: str, reason: str) -> None:
        for flow in self.api.flows.values():
            flow.worker_left(worker_id, reason)
