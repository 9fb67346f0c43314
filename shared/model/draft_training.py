"""Training-time test (EAGLE-3) for the MTP draft: the draft layer unrolled on its own outputs.

Decode chains the draft: step 1 reads the target's hidden state h_{p-1}, every later step reads the
draft's own output from the step before. A draft trained only on the target's hidden states meets
inputs it never saw from step 2 on. `unroll_draft` runs the chain for every position of a dense
batch at once, level by level, with `ChainAttention` giving each level exactly the entries decode's
chained step would see, so a loss on every level trains every draft position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .model import BatonLM


class ChainAttention:
    """Attention for the draft layer unrolled `depth` times in training ("training-time test",
    EAGLE-3), over a dense batch of B sequences of S draft positions.

    Call it once per level, level 0 first. Level 0 is the ordinary draft pass: causal over the
    window. Level j stands for the j-th chained draft step of decode: its query at position p was
    fed the draft's own output from position p-1 (level j-1), so at inference it sees the entries
    committed before the chain started (level 0 at p-j and earlier, within the window) and the
    chain's own entries, level i at position p-j+i for i = 1..j. Keys and values of every level
    stay in the graph, so the loss at level j trains the levels it read."""

    def __init__(self, cfg: ModelConfig, batch: int, seq: int) -> None:
        (self.layer_id,) = cfg.draft_layer_ids()  # one draft layer
        self.window = cfg.window_of(self.layer_id)
        self.batch, self.seq = batch, seq
        self.keys: list[torch.Tensor] = []  # per level: [B, Hkv, S, D]
        self.values: list[torch.Tensor] = []

    def mask(self, level: int) -> torch.Tensor:
        """Boolean [S, (level + 1) * S]: level `level`'s queries against the keys of levels 0..level."""
        pos = torch.arange(self.seq)
        delta = pos[:, None] - pos[None, :]  # [S, S]: query position - key position
        committed = (delta >= level) & (delta < (self.window or self.seq + level))
        chain = [delta == level - i for i in range(1, level + 1)]
        return torch.cat([committed, *chain], dim=1)

    def __call__(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        assert layer_id == self.layer_id, "ChainAttention serves the draft layer only"
        B, S = self.batch, self.seq
        k, v = kv.unbind(1)  # [T, Hkv, D] each
        H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        self.keys.append(k.view(B, S, Hkv, D).transpose(1, 2))
        self.values.append(v.view(B, S, Hkv, D).transpose(1, 2))
        level = len(self.keys) - 1
        q4 = q.view(B, S, H, D).transpose(1, 2)  # [B, H, S, D]
        k4 = torch.cat(self.keys, dim=2)  # [B, Hkv, (level + 1) S, D]
        v4 = torch.cat(self.values, dim=2)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=self.mask(level), enable_gqa=True)
        return out.transpose(1, 2).reshape(B * S, H, D)


def unroll_draft(model: BatonLM, hidden: torch.Tensor, ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """hidden [B, S, d] (the target's, before the final norm) and ids [B, S] of B sequences ->
    the draft's outputs per level, each [B, S-1, d]. Index i is draft position i+1 (input h_i and
    token i+1, predicting token i+2); level j at index i is the j-th chained step there, fed
    level j-1's output at index i-1 (meaningful for i >= j)."""
    B, S, d = hidden.shape
    attn = ChainAttention(model.cfg, B, S - 1)
    tokens = ids[:, 1:].reshape(-1)  # token_p for p = 1..S-1
    positions = torch.arange(1, S).repeat(B)
    prev = hidden[:, :-1]  # [B, S-1, d]: h_{p-1}
    levels = []
    for _ in range(depth):
        g = model.draft_hidden(prev.reshape(-1, d), tokens, positions, attn).view(B, S - 1, d)
        levels.append(g)
        prev = torch.cat((prev[:, :1], g[:, :-1]), dim=1)  # the draft's own output from p-1
    return levels
