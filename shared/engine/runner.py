"""The model step loop shared by prefill, decode and the aggregated baseline.

Prefill:  target over the prompt in chunks -> first token; optionally the MTP layer over the
          prompt's window so the draft state can travel (draft-state mode `transfer`).
Decode:   one `step(seqs)` advances every active sequence together:
          spec off  one target forward over each sequence's last token, sample one token;
          spec on   draft k tokens with the MTP layer (first draft forward also recomputes the
                    draft entries of the tokens accepted last round, from target hidden states),
                    verify all of them with one target forward over k+1 positions, accept, rewind.
                    k is per sequence: the deployment's K, or less where a request asks for less
                    (`Sequence.draft_tokens`); a sequence with k = 0 skips the draft forwards and
                    is verified over its one position, i.e. decoded plainly, in the same forward.
The draft entry at position p is f(h_{p-1}, token_p) and predicts token_{p+1} (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.proto.public import MAX_DRAFT_TOKENS
from baton.shared.kv.store import KVStore
from baton.shared.model.model import BatonLM

from .attention import Chunk, StoreAttention
from .sampling import accept_drafts, choose
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
    hidden: torch.Tensor  # [L, d] target hidden states of the prompt (before the final norm)


class ModelRunner:
    def __init__(self, model: BatonLM, store: KVStore, spec: SpecConfig, prefill_chunk: int = 256) -> None:
        self.model, self.store, self.spec, self.chunk = model, store, spec, prefill_chunk
        cfg = model.cfg
        self.target_layers = list(range(cfg.num_hidden_layers))
        self.draft_layer = cfg.draft_layer_ids()[0] if cfg.num_draft_layers else None
        self.window = cfg.sliding_window

    # --- forwards -------------------------------------------------------------------------
    def _target(self, chunks: list[Chunk], ids: list[int]) -> torch.Tensor:
        attn = StoreAttention(self.store, chunks, self.target_layers)
        return self.model.forward_hidden(torch.tensor(ids), attn.positions, attn)  # [T, d]

    def _draft(self, chunks: list[Chunk], ids: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
        attn = StoreAttention(self.store, chunks, [self.draft_layer])
        return self.model.draft_hidden(prev_hidden, torch.tensor(ids), attn.positions, attn)  # [T, d]

    # --- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> list[PrefillOutput]:
        """Fill target KV for each prompt (chunked, batched) and sample each first token."""
        hidden = [[] for _ in seqs]
        done = [0] * len(seqs)
        while any(d < len(s.prompt) for d, s in zip(done, seqs)):
            active = [i for i, s in enumerate(seqs) if done[i] < len(s.prompt)]
            chunks = [Chunk(seqs[i].request_id, done[i], min(self.chunk, len(seqs[i].prompt) - done[i]))
                      for i in active]
            ids = [t for i, c in zip(active, chunks) for t in seqs[i].prompt[c.start:c.start + c.n]]
            out = self._target(chunks, ids).split([c.n for c in chunks])
            for i, c, h in zip(active, chunks, out):
                hidden[i].append(h)
                done[i] += c.n
        hidden = [torch.cat(h) for h in hidden]
        last = self.model.logits(torch.stack([h[-1] for h in hidden]))  # [B, V]
        return [PrefillOutput(choose(lg, s.params, s.gen)[0], h) for s, h, lg in zip(seqs, hidden, last)]

    @torch.inference_mode()
    def fill_draft_window(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Draft K/V of entries max(1, L-W+1) .. L-1 from the prompt's target hidden [L, d]:
        exactly what decode's first draft query (position L) reads."""
        L = len(seq.prompt)
        lo = max(1, L - self.window + 1)
        if lo < L:
            self._draft([Chunk(seq.request_id, lo, L - lo, floor=lo)], seq.prompt[lo:L], hidden[lo - 1:L - 1])

    # --- decode start (what arrived from prefill) -------------------------------------------
    def start_decode(self, seq: Sequence, first_token: int, hidden_tail: torch.Tensor, draft_state: str) -> None:
        """hidden_tail: the last rows of the prompt's target hidden states; [1, d] for transfer
        and cold, up to [W, d] (h_{L-W}..h_{L-1}) for rebuild."""
        L = len(seq.prompt)
        if self.store.length(seq.request_id) < L:  # the prompt's KV arrived by transfer
            self.store.extend(seq.request_id, L)
        seq.length = L
        seq.emit([first_token])
        if draft_state == "rebuild":  # recompute the window's draft entries in the first draft forward
            seq.draft_len = max(1, L - hidden_tail.shape[0] + 1)
            seq.draft_floor = seq.draft_len
        else:
            seq.draft_len = L
            seq.draft_floor = 1 if draft_state == "transfer" else L
        seq.pending_hidden = hidden_tail[-(L - seq.draft_len + 1):]

    # --- decode ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """Advance every sequence; returns the tokens each one emitted this step."""
        if self.spec.enabled:
            return self._spec_step(seqs)
        out = self._target([Chunk(s.request_id, s.length, 1) for s in seqs], [s.last_token for s in seqs])
        logits = self.model.logits(out)  # [B, V]
        emitted = []
        for s, lg in zip(seqs, logits):
            s.length += 1
            emitted.append(s.emit([choose(lg, s.params, s.gen)[0]]))
        return emitted

    def draft_tokens(self, seq: Sequence) -> int:
        """k for this sequence: the deployment's K, lowered (never raised) by the request's own cap."""
        k = self.spec.draft_tokens
        return k if seq.draft_tokens is None else min(k, seq.draft_tokens)

    def _spec_step(self, seqs: list[Sequence]) -> list[list[int]]:
        ks = [self.draft_tokens(s) for s in seqs]  # k_b; 0: plain decode inside the same forward
        drafts, q_probs = self._draft_chain(seqs, ks)  # [B][k_b] tokens, [B][k_b] probs or None
        verify = [Chunk(s.request_id, s.length, k + 1) for s, k in zip(seqs, ks)]
        ids = [t for s, d in zip(seqs, drafts) for t in [s.last_token] + d]
        hidden = self._target(verify, ids)  # [sum(k_b+1), d]
        logits = self.model.logits(hidden)  # [sum(k_b+1), V]
        sizes = [k + 1 for k in ks]  # each sequence's rows of hidden and logits
        emitted = []
        for s, k, d, q, h, lg in zip(seqs, ks, drafts, q_probs, hidden.split(sizes), logits.split(sizes)):
            accepted, bonus = accept_drafts(d, q, lg, s.params, s.gen)  # h: [k_b+1, d], lg: [k_b+1, V]
            if k:  # a request without drafts reports no speculation
                s.stats.record(k, accepted)
            n = s.length
            s.length = n + accepted + 1  # t_n and the accepted drafts are now committed
            self.store.rollback(s.request_id, s.length)
            s.draft_len, s.pending_hidden = n + 1, h[:accepted + 1]  # h_n .. h_{n+accepted}
            emitted.append(s.emit(d[:accepted] + [bonus]))
        return emitted

    def _draft_chain(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[list]]:
        """Draft k_b tokens for each sequence; those with k_b = 0 take no draft forward at all
        (they never draft, so they never read their draft entries)."""
        drafts, probs = [[] for _ in seqs], [[] for _ in seqs]
        rows = [b for b, k in enumerate(ks) if k > 0]  # row i of `last` is seqs[rows[i]]
        if not rows:
            return drafts, probs
        live = [seqs[b] for b in rows]
        # first draft forward: entries draft_len .. length (the last one queries the next token)
        chunks = [Chunk(s.request_id, s.draft_len, s.length - s.draft_len + 1, floor=s.draft_floor) for s in live]
        ids = [t for s in live for t in s.tokens[s.draft_len:s.length + 1]]
        g = self._draft(chunks, ids, torch.cat([s.pending_hidden for s in live]))
        last = torch.stack([x[-1] for x in g.split([c.n for c in chunks])])  # [B', d]
        for j in range(max(ks)):
            logits = self.model.logits(last)  # [B', V]
            for b, lg in zip(rows, logits):
                token, q = choose(lg, seqs[b].params, seqs[b].gen)
                drafts[b].append(token)
                probs[b].append(q)
            keep = [i for i, b in enumerate(rows) if ks[b] > j + 1]  # the rows that draft again
            if not keep:
                break
            if len(keep) < len(rows):
                rows, last = [rows[i] for i in keep], last[keep]  # [B'', d]
            # chain: the draft's own hidden state stands in for the target's
            chunks = [Chunk(seqs[b].request_id, seqs[b].length + j + 1, 1, floor=seqs[b].draft_floor) for b in rows]
            last = self._draft(chunks, [drafts[b][-1] for b in rows], last)
        return drafts, probs
