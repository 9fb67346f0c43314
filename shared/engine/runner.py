"""The model step loop shared by prefill, decode and the aggregated baseline.

Prefill:  target over the prompt in chunks -> first token; optionally the MTP layer over the
          prompt's window so the draft state can travel (draft-state mode `transfer`), one
          forward for the whole batch.
Decode:   one `step(seqs)` advances every active sequence together:
          spec off  one target forward over each sequence's last token, sample one token;
          spec on   draft k tokens with the MTP layer (first draft forward also recomputes the
                    draft entries of the tokens accepted last round, from target hidden states),
                    verify all of them with one target forward over k+1 positions, accept, rewind.
                    k is per sequence: the deployment's K, or less where a request asks for less
                    (`Sequence.draft_tokens`); a sequence with k = 0 skips the draft forwards and
                    is verified over its one position, i.e. decoded plainly, in the same forward.
Drafts stay on the engine's device through the chain and the verify; sampling and acceptance
are decided for the whole batch at once, and the step reads its results back to the host once.
The draft entry at position p is f(h_{p-1}, token_p) and predicts token_{p+1} (docs/architecture.md).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from baton.kernels.cpu_fused import argmax
from baton.proto.public import MAX_DRAFT_TOKENS, Logprobs
from baton.shared.kv.store import KVStore
from baton.shared.model.model import BatonLM

from . import logprobs, sampling
from .attention import Chunk, StoreAttention
from .penalties import Penalties
from .sampling import BatchSampling, race
from .sequence import Sequence

DRAFT_STATE_MODES = ("transfer", "rebuild", "cold")


@dataclass(frozen=True)
class SpecConfig:
    enabled: bool = True
    draft_tokens: int = 3
    draft_state: str = "transfer"

    def __post_init__(self) -> None:
        if self.draft_state not in DRAFT_STATE_MODES:
            raise ValueError(f"draft_state must be one of {DRAFT_STATE_MODES}, got {self.draft_state!r}")
        if self.enabled and not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")


@dataclass
class PrefillOutput:
    first_token: int
    hidden: torch.Tensor  # [L - hidden_start, d] target hidden states of the prompt (before the final norm)
    prompt_logprobs: Logprobs | None = None  # of prompt[1:], when the sequence asks for them
    hidden_start: int = 0  # the position of hidden's first row


class ModelRunner:
    def __init__(self, model: BatonLM, store: KVStore, spec: SpecConfig, prefill_chunk: int = 256) -> None:
        self.model, self.store, self.spec, self.chunk = model, store, spec, prefill_chunk
        cfg = model.cfg
        self.target_layers = list(range(cfg.num_hidden_layers))
        self.draft_layer = cfg.draft_layer_ids()[0] if cfg.num_draft_layers else None
        self.window, self.vocab, self.device = cfg.sliding_window, cfg.vocab_size, store.device

    # --- forwards -------------------------------------------------------------------------
    def _ids(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        return ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=self.device)

    def _target(self, chunks: list[Chunk], ids: list[int] | torch.Tensor) -> torch.Tensor:
        attn = StoreAttention(self.store, chunks, self.target_layers)
        return self.model.forward_hidden(self._ids(ids), attn.positions, attn, attn.max_position)  # [T, d]

    def _draft(self, chunks: list[Chunk], ids: list[int] | torch.Tensor, prev_hidden: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """The draft layer over the chunks: stores every token's draft K/V; -> the hidden states
        of `rows` ([N] flat token indices; [T, d] for all when None)."""
        attn = StoreAttention(self.store, chunks, [self.draft_layer])
        return self.model.draft_hidden(prev_hidden, self._ids(ids), attn.positions, attn,
                                       max_position=attn.max_position, rows=rows)  # [N, d]

    # --- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], starts: list[int] | None = None,
                on_chunk: Callable[[int, int, torch.Tensor], None] | None = None) -> list[PrefillOutput]:
        """Fill target KV for each prompt (chunked, batched) and sample each first token.
        `starts`: the position each prompt's computation starts from (0 by default); the store
        holds the positions below already (a prefix cache hit), and the hidden states returned
        begin there. `on_chunk(i, end, hidden)`: after each chunk that ends inside prompt i, with
        its hidden states so far ([end - start, d]); sliding storage then holds the chunk's end."""
        hidden = [[] for _ in seqs]
        starts = starts or [0] * len(seqs)
        if any(start and s.prompt_logprobs is not None for s, start in zip(seqs, starts)):
            raise ValueError("prompt logprobs need the whole prompt computed (start 0)")
        done = list(starts)
        while any(d < len(s.prompt) for d, s in zip(done, seqs)):
            active = [i for i, s in enumerate(seqs) if done[i] < len(s.prompt)]
            chunks = [Chunk(seqs[i].request_id, done[i], min(self.chunk, len(seqs[i].prompt) - done[i]))
                      for i in active]
            ids = [t for i, c in zip(active, chunks) for t in seqs[i].prompt[c.start:c.start + c.n]]
            out = self._target(chunks, ids).split([c.n for c in chunks])
            for i, c, h in zip(active, chunks, out):
                hidden[i].append(h)
                done[i] += c.n
                if on_chunk is not None and done[i] < len(seqs[i].prompt):
                    on_chunk(i, done[i], torch.cat(hidden[i]))
        hidden = [torch.cat(h) for h in hidden]
        last = self.model.logits(torch.stack([h[-1] for h in hidden]))  # [B, V]
        first = BatchSampling(seqs, self.vocab, device=self.device).choose(self._penalised(seqs, last)).tolist()
        return [PrefillOutput(t, h, None if s.prompt_logprobs is None else
                              logprobs.prompt_logprobs(self.model.logits, h, s.prompt, s.prompt_logprobs), start)
                for s, t, h, start in zip(seqs, first, hidden, starts)]

    @torch.inference_mode()
    def fill_draft_windows(self, seqs: list[Sequence], outputs: list[PrefillOutput]) -> None:
        """Draft K/V of entries max(1, L-W+1) .. L-1 of each prompt from its target hidden states
        (which must reach down to position L-W): exactly what decode's first draft query (position
        L) reads. One forward for the batch."""
        chunks, ids, prev = [], [], []
        for seq, out in zip(seqs, outputs):
            L, first = len(seq.prompt), out.hidden_start
            lo = max(1, L - self.window + 1)
            if lo - 1 < first:
                raise ValueError(f"request {seq.request_id}: the draft window needs hidden states from "
                                 f"position {lo - 1}, these start at {first}")
            if lo < L:
                chunks.append(Chunk(seq.request_id, lo, L - lo, floor=lo))
                ids += seq.prompt[lo:L]
                prev.append(out.hidden[lo - 1 - first:L - 1 - first])
        if chunks:  # only the K/V are wanted: no token's output projection or MLP runs
            self._draft(chunks, ids, torch.cat(prev), rows=self._host_index([]))

    def prefill_and_start(self, seqs: list[Sequence], draft_state: str,
                          sampled_by: list[Sequence] | None = None,
                          on_sampled: Callable[[list[PrefillOutput]], None] | None = None) -> list[PrefillOutput]:
        """Prefill the prompts and start decoding them on this store, as prefill + decode would:
        the draft windows as `draft_state` says (transfer: filled now; rebuild: from the prompt's
        last W hidden states; cold). `sampled_by`: the sequences each first token is drawn with
        (prefill's own; default `seqs`). `on_sampled(outputs)`: as soon as the first tokens are
        drawn, before the draft windows (to stream them ahead, as prefill does)."""
        first = sampled_by or seqs
        outputs = self.prefill(first)
        if on_sampled is not None:
            on_sampled(outputs)
        if draft_state == "transfer":
            self.fill_draft_windows(first, outputs)
        rows = self.window if draft_state == "rebuild" else 1
        for seq, out in zip(seqs, outputs):
            self.start_decode(seq, out.first_token, out.hidden[-rows:], draft_state)
        return outputs

    # --- decode start (what arrived from prefill) -------------------------------------------
    def start_decode(self, seq: Sequence, first_token: int, hidden_tail: torch.Tensor, draft_state: str) -> None:
        """hidden_tail: the last rows of the prompt's target hidden states; [1, d] for transfer
        and cold, up to [W, d] (h_{L-W}..h_{L-1}) for rebuild; from the aux row (host memory, fp32)
        or the prefill's own output."""
        hidden_tail = hidden_tail.to(self.device, self.model.dtype)
        L = len(seq.prompt)
        if self.store.length(seq.request_id) < L:  # the prompt's KV arrived by transfer
            self.store.extend(seq.request_id, L)
        seq.length = L
        seq.emit([first_token])
        if seq.logprobs is not None:  # h_{L-1} is what prefill sampled the first token from
            self._report(seq, self.model.logits(hidden_tail[-1:]), [first_token])
        if draft_state == "rebuild":  # recompute the window's draft entries in the first draft forward
            seq.draft_len = max(1, L - hidden_tail.shape[0] + 1)
            seq.draft_floor = seq.draft_len
        else:
            seq.draft_len = L
            seq.draft_floor = 1 if draft_state == "transfer" else L
        seq.pending_hidden = hidden_tail[-(L - seq.draft_len + 1):]

    # --- decode ---------------------------------------------------------------------------
    def run(self, seqs: list[Sequence], changed: threading.Event,
            deliver: Callable[[list[list[int]], float], None]) -> None:
        """Step `seqs` until one of them ends or `changed` is set (looked at after each step),
        handing each step's emitted tokens and its seconds to `deliver` as soon as it is done:
        a service's engine thread runs steps back to back, not one per event-loop round trip."""
        while True:
            start = time.perf_counter()
            emitted = self.step(seqs)
            deliver(emitted, time.perf_counter() - start)
            if changed.is_set() or any(s.finish_reason for s in seqs):
                return

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """Advance every sequence; returns the tokens each one emitted this step."""
        if self.spec.enabled:
            return self._spec_step(seqs)
        out = self._target([Chunk(s.request_id, s.length, 1) for s in seqs], [s.last_token for s in seqs])
        logits = self.model.logits(out)  # [B, V]
        tokens = BatchSampling(seqs, self.vocab, device=self.device).choose(self._penalised(seqs, logits)).tolist()
        emitted = []
        for s, t in zip(seqs, tokens):
            s.length += 1
            emitted.append(s.emit([t]))
        self._report_step(seqs, logits, list(range(len(seqs))), emitted)
        return emitted

    def _penalised(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] of one position per sequence -> the same with each row's penalties."""
        penalties = Penalties(seqs, self.vocab, self.device)
        if not penalties.any:
            return logits
        logits = logits.clone()
        logits[penalties.index] = penalties.at_positions(logits[penalties.index][:, None], None)[:, 0]
        return logits

    def draft_tokens(self, seq: Sequence) -> int:
        """k for this sequence: the deployment's K, lowered (never raised) by the request's own cap."""
        k = self.spec.draft_tokens
        return k if seq.draft_tokens is None else min(k, seq.draft_tokens)

    def _spec_step(self, seqs: list[Sequence]) -> list[list[int]]:
        ks = [self.draft_tokens(s) for s in seqs]  # k_b; 0: plain decode inside the same forward
        K = max(ks)
        draws = BatchSampling(seqs, self.vocab, ks, self.device)
        penalties = Penalties(seqs, self.vocab, self.device)
        drafts, q = self._draft_chain(seqs, ks, draws, penalties)  # [B, K] on the device; q [Ns, K, V] or None
        verify = [Chunk(s.request_id, s.length, k + 1) for s, k in zip(seqs, ks)]
        chain = torch.cat((torch.tensor([[s.last_token] for s in seqs], device=self.device), drafts), 1)  # [B, K+1]
        ids = chain.view(-1) if min(ks) == K else chain.view(-1).index_select(0, self._host_index(
            [b * (K + 1) + j for b, k in enumerate(ks) for j in range(k + 1)]))
        hidden = self._target(verify, ids)  # [T, d], T = sum(k_b + 1)
        logits = self.model.logits(hidden)  # [T, V]
        offsets = [0, *accumulate(k + 1 for k in ks)]
        at = self._host_index([[offsets[b] + min(j, k) for j in range(K + 1)] for b, k in enumerate(ks)])  # [B, K+1]
        accepted, emitted = self._verify(drafts, ks, logits, at, q, draws, penalties)
        result = torch.cat((drafts, accepted[:, None], emitted[:, None]), 1).tolist()  # the step's one host sync
        out = []
        for b, (s, k, row) in enumerate(zip(seqs, ks, result)):
            a, bonus = row[K], row[K + 1]
            if k:  # a request without drafts reports no speculation
                s.stats.record(k, a)
            n = s.length
            s.length = n + a + 1  # t_n and the accepted drafts are now committed
            self.store.rollback(s.request_id, s.length)
            s.draft_len, s.pending_hidden = n + 1, hidden[offsets[b]:offsets[b] + a + 1]  # h_n .. h_{n+a}
            out.append(s.emit(row[:a] + [bonus]))
        self._report_step(seqs, logits, offsets, out)  # verify row offsets[b] + j scored chain position j
        return out

    def _report_step(self, seqs: list[Sequence], logits: torch.Tensor, first_rows: list[int],
                     emitted: list[list[int]]) -> None:
        """Logprobs of what each asking sequence emitted this step, in one pass for the batch:
        logits [T, V]; sequence b's j-th emitted token was scored by row first_rows[b] + j."""
        asking = [b for b, s in enumerate(seqs) if s.logprobs is not None and emitted[b]]
        if not asking:
            return
        picked = self._host_index([first_rows[b] + j for b in asking for j in range(len(emitted[b]))])
        values = logprobs.logprobs_of(logits[picked], [t for b in asking for t in emitted[b]],
                                      [seqs[b].logprobs for b in asking for _ in emitted[b]])
        at = 0
        for b in asking:
            n = len(emitted[b])
            logprobs.extend(seqs[b].output_logprobs, values[at:at + n])
            at += n

    def _report(self, seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> None:
        logprobs.extend(seq.output_logprobs, logprobs.logprobs_of(logits, tokens, [seq.logprobs] * len(tokens)))

    def _host_index(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _verify(self, drafts: torch.Tensor, ks: list[int], logits: torch.Tensor, at: torch.Tensor,
                q: torch.Tensor | None, draws: BatchSampling, penalties: Penalties) -> tuple[torch.Tensor, torch.Tensor]:
        """drafts [B, K], logits [T, V] of the verified positions, at [B, K+1] their rows per
        sequence -> (accepted [B], emitted [B]). Greedy rows: the longest prefix equal to the
        target's (penalised) argmax; sampled rows: `sampling.accept`."""
        K = drafts.shape[1]
        scores = None
        if penalties.any:  # each position penalised as plain decoding would penalise it there
            scores = logits[at]  # [B, K+1, V]
            scores[penalties.index] = penalties.at_positions(scores[penalties.index], drafts[penalties.index])
        best = argmax(logits).take(at) if scores is None else argmax(scores)  # [B, K+1]
        drafted = torch.arange(K, device=self.device) < self._host_index(ks)[:, None]
        accepted = ((drafts == best[:, :K]) & drafted).long().cumprod(-1).sum(-1)  # [B]
        emitted = best.gather(1, accepted[:, None])[:, 0]
        if draws.any:
            rows = draws.index
            p = draws.probs(logits[at[rows]] if scores is None else scores[rows])  # [Ns, K+1, V]
            accepted[rows], emitted[rows] = sampling.accept(drafts[rows], draws.ks, q, p, draws.uniform,
                                                            draws.emission_noise)
        return accepted, emitted

    def _draft_chain(self, seqs: list[Sequence], ks: list[int], draws: BatchSampling, penalties: Penalties
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft max(k_b) tokens for every sequence with k_b > 0, in one batch (a row past its own
        k_b drafts tokens nobody verifies; its draft entries there are overwritten before they are
        read). Sequences with k_b = 0 take no draft forward at all (they never read their draft
        entries). -> drafts [B, K] (0 where not drafted), q [Ns, K, V] for the sampled rows."""
        B, K = len(seqs), max(ks)
        drafts = torch.zeros((B, K), dtype=torch.long, device=self.device)
        live = [b for b, k in enumerate(ks) if k > 0]  # row i of `last` is seqs[live[i]]
        q = torch.zeros((len(draws.rows), K, self.vocab), device=self.device) if draws.any else None
        if not live:
            return drafts, q
        sampled_row = {b: i for i, b in enumerate(draws.rows)}
        sampled = [(i, sampled_row[b]) for i, b in enumerate(live) if b in sampled_row]
        s_live, s_draws = (self._host_index(list(x)) for x in zip(*sampled)) if sampled else (None, None)
        penalised_row = {b: i for i, b in enumerate(penalties.rows)}
        penalised = [(i, penalised_row[b]) for i, b in enumerate(live) if b in penalised_row]
        p_live, p_rows = (self._host_index(list(x)) for x in zip(*penalised)) if penalised else (None, None)
        chain = [seqs[b] for b in live]
        # first draft forward: entries draft_len .. length (the last one queries the next token)
        chunks = [Chunk(s.request_id, s.draft_len, s.length - s.draft_len + 1, floor=s.draft_floor) for s in chain]
        ids = [t for s in chain for t in s.token_span(s.draft_len, s.length + 1)]
        ends = self._host_index([end - 1 for end in accumulate(c.n for c in chunks)])  # each chunk's last row
        last = self._draft(chunks, ids, torch.cat([s.pending_hidden for s in chain]), rows=ends)  # [B', d]
        steps = StoreAttention.chain(self.store, [Chunk(s.request_id, s.length + 1, 1, floor=s.draft_floor)
                                                  for s in chain], [self.draft_layer], K - 1)
        columns = []
        for j in range(K):
            logits = self.model.logits(last)  # [B', V]
            if penalised:  # the chain's own tokens so far count as output, as they would if accepted
                before = torch.stack(columns, 1)[p_live] if columns else None  # [Np', j]
                logits[p_live] = penalties.after(logits[p_live], p_rows, before)
            token = argmax(logits)  # [B']
            if sampled:
                p = draws.probs(logits[s_live][:, None], s_draws)[:, 0]  # [Ns', V]
                token[s_live] = race(p, draws.draft_noise[s_draws, j])
                q[s_draws, j] = p
            columns.append(token)
            if j + 1 < K:  # chain: the draft's own hidden state stands in for the target's
                attn = steps[j]
                last = self.model.draft_hidden(last, token, attn.positions, attn, max_position=attn.max_position)
        drafted = torch.stack(columns, 1)  # [B', K]
        if len(live) == B:
            return drafted, q
        drafts[self._host_index(live)] = drafted
        return drafts, q
