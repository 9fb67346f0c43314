"""Qwen3-style building blocks: RMSNorm, RoPE, GQA attention with q/k norm, SwiGLU MLP.

Tensors are flattened over the batch: T = total new tokens in a forward, d = hidden size,
H / Hkv = query / key-value heads, D = head_dim. Attention itself (which keys a query sees,
where K/V are stored) is delegated to an `Attention` object so the same layer runs over
a dense no-cache batch (training, tests) and over paged / ring KV pools (serving).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class Attention(Protocol):
    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens (RoPE applied) -> out [T, H, D].

        Implementations store k/v for the new tokens and attend over every key the query
        may see under the layer's attention type (causal, plus the window for sliding layers).
        """


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    """Default (unscaled) RoPE, computed exactly as `transformers` does in fp32."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponent), persistent=False)  # [D/2]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, D]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(self.k_proj(x).view(T, self.kv_heads, self.head_dim))  # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(self.layer_id, q, k, v)  # [T, H, D]
        return self.o_proj(out.reshape(T, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_id)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)  # [T, d]
        return x + self.mlp(self.post_attention_layernorm(x))
