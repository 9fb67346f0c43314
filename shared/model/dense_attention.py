"""No-cache attention over a dense batch of equal-length sequences (training and tests).

The batch is B sequences of S tokens, flattened to T = B * S in the model. Each layer's
mask comes from the config's attention metadata: causal for full layers, causal plus the
window (query p sees keys p-W+1 .. p) for sliding ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [Q, K] mask: True where the query at q_pos may attend the key at k_pos."""
    delta = q_pos[:, None] - k_pos[None, :]  # [Q, K]
    allowed = delta >= 0
    if window is not None:
        allowed &= delta < window
    return allowed


class DenseAttention:
    def __init__(self, cfg: ModelConfig, batch: int, seq: int) -> None:
        self.cfg, self.batch, self.seq = cfg, batch, seq
        pos = torch.arange(seq)
        self._masks: dict[int | None, torch.Tensor] = {}
        for layer_id in range(cfg.num_hidden_layers + cfg.num_draft_layers):
            window = cfg.window_of(layer_id)
            if window not in self._masks:
                self._masks[window] = window_mask(pos, pos, window)  # [S, S]

    def __call__(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        B, S = self.batch, self.seq
        k, v = kv.unbind(1)  # [T, Hkv, D] each
        H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        q4 = q.view(B, S, H, D).transpose(1, 2)  # [B, H, S, D]
        k4 = k.view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # [B, H, S, D]
        v4 = v.view(B, S, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        mask = self._masks[self.cfg.window_of(layer_id)]
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)  # [B, H, S, D]
        return out.transpose(1, 2).reshape(B * S, H, D)
