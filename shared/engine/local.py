"""In-process generation: prefill and decode on one KVStore, no NATS, no NIXL.

Used by benchmarks (acceptance length, the aggregated baseline) and tests. It runs exactly the
steps the disaggregated services run, with the transfer replaced by sharing the store.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from baton.shared.config import WorkerSection
from baton.shared.kv.budget import reservation
from baton.shared.kv.store import KVStore
from baton.shared.model.model import BatonLM

from .runner import ModelRunner, SpecConfig
from .sampling import SamplingParams
from .sequence import Sequence


LOCAL_STORE = WorkerSection(num_pages=4096)  # room for the benches' batches of long prompts


class LocalEngine:
    def __init__(self, model: BatonLM, spec: SpecConfig, store: WorkerSection = LOCAL_STORE,
                 prefill_chunk: int = 256) -> None:
        """`store`: the [worker] section's storage keys (kv_mode, num_pages, page_size, num_slots);
        its k is `spec`'s."""
        self.spec = spec
        self.store = KVStore.for_worker(model.cfg, replace(store, draft_tokens=spec.draft_tokens),
                                        draft_enabled=spec.enabled, dtype=model.dtype, device=model.device)
        self.runner = ModelRunner(model, self.store, spec, prefill_chunk)
        self.window = model.cfg.sliding_window

    def reservation(self, seq: Sequence) -> int:
        """Positions a request may ever write: prompt, outputs, and one verify block beyond."""
        return reservation(len(seq.prompt), seq.max_tokens, self.spec.draft_tokens)

    def admit(self, seqs: list[Sequence]) -> None:
        """Allocate, prefill and hand each sequence to decode as the services would."""
        for s in seqs:
            self.store.allocate(s.request_id, self.reservation(s))
        outputs, state = self.runner.prefill(seqs), self.spec.draft_state
        if self.spec.enabled and state == "transfer":
            self.runner.fill_draft_windows(seqs, outputs)
        for s, out in zip(seqs, outputs):
            h = out.hidden
            tail = h[-self.window:] if state == "rebuild" else h[-1:]
            self.runner.start_decode(s, out.first_token, tail, state)

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: SamplingParams = SamplingParams()) -> list[Sequence]:
        return self.run([Sequence(f"local-{i}", p, max_tokens, params, device=self.store.device)
                         for i, p in enumerate(prompts)])

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Generate every sequence to its end (one batch, all admitted at once), then free it."""
        self.admit(seqs)
        with torch.inference_mode():
            while active := [s for s in seqs if s.finish_reason is None]:
                self.runner.step(active)
        for s in seqs:
            self.store.free(s.request_id)
        return seqs
