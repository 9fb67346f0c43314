"""The Baton model: a Qwen3-style target plus DeepSeek-V3-style MTP draft layers.

Weight names follow `transformers`' Qwen3ForCausalLM (`model.*`, `lm_head`) so the target
loads there too; the MTP layers live under their own prefix `mtp.layers.{j}.*`.

Target:  h = layers(embed(ids))            hidden before the final norm, [T, d]
         logits = lm_head(norm(h))          [T, V]
MTP j:   entry at position p takes (h_{p-1}, token_p) and predicts token_{p+1}:
         x = eh_proj(cat(enorm(embed(token_p)), hnorm(h_{p-1})))  2d -> d
         g = block(x)                       one decoder layer (its own attention, usually sliding)
         logits = lm_head(norm(g))          shared final norm and head
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from baton.kernels import cpu_fused

from .config import ModelConfig
from .layers import Attention, DecoderLayer, Linear, RMSNorm, Rotary, SelfAttention, fastest_projection

log = logging.getLogger(__name__)


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d)
        self.block = DecoderLayer(cfg, layer_id)


class TargetModel(nn.Module):
    """Module tree named like Qwen3Model so state_dict keys match `model.*`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg, layer_id) for layer_id in cfg.draft_layer_ids())


class BatonLM(nn.Module):
    projection: str | None = None  # the CPU projection kernel `pack` chose

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TargetModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTPModel(cfg)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        """Where the weights live (and with them the KV store and every engine tensor)."""
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                       max_position: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> last target layer's output before the final norm, [T, d].
        max_position: the largest of `positions`, when the caller knows it without a host sync."""
        x = self.model.embed_tokens(input_ids)  # [T, d]
        rope = self.rotary(positions, x.dtype, max_position)  # cos, sin: [T, 1, D] each
        for layer in self.model.layers:
            x = layer(x, rope, attn)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, d] (target or draft) -> logits [T, V] through the shared norm and head."""
        return self.lm_head.forward(self.model.norm.forward(hidden))

    def draft_hidden(self, prev_hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                     attn: Attention, depth: int = 0, max_position: int | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
        """MTP layer `depth`: prev_hidden [T, d] (h_{p-1}), input_ids/positions [T] (token_p, p) -> [T, d],
        or [N, d] for `rows` [N] only (every token's draft K/V is stored either way)."""
        mtp = self.mtp.layers[depth]
        emb = mtp.enorm.forward(self.model.embed_tokens.forward(input_ids))  # [T, d]
        rope = self.rotary(positions, emb.dtype, max_position)
        x = mtp.eh_proj.forward(torch.cat((emb, mtp.hnorm.forward(prev_hidden)), dim=-1))  # [T, 2d] -> [T, d]
        return mtp.block.forward(x, rope, attn, rows)

    def projection_probe(self) -> Callable[[int], None]:
        """What the projection kernel changes, at r rows (`fastest_projection`): every decoder layer,
        target and MTP, as it runs (its projections, norms and, for BLAS, the fused path) around an
        attention that returns its queries (the same for every kernel, so left out), and the
        projections outside the layers (each MTP layer's eh_proj, the head)."""
        layers = [*self.model.layers, *(mtp.block for mtp in self.mtp.layers)]
        in_layers = {id(m) for layer in layers for m in layer.modules()}
        others = [m for m in self.modules() if isinstance(m, Linear) and id(m) not in in_layers]
        d, inputs = self.cfg.hidden_size, {}

        def no_attention(_layer_id: int, q: torch.Tensor, _kv: torch.Tensor) -> torch.Tensor:
            return q  # [T, H, D], the attention's output shape

        def run(rows: int) -> None:
            if rows not in inputs:  # the probe runs on the CPU only (`pack`)
                positions = torch.arange(rows, device="cpu")
                inputs[rows] = (torch.full((rows, d), 0.5, dtype=self.dtype, device="cpu"),  # [rows, d]
                                self.rotary(positions, self.dtype, rows - 1),  # cos, sin: [rows, 1, D]
                                [torch.full((rows, m.in_features), 0.5, dtype=self.dtype, device="cpu")
                                 for m in others])
            x, rope, other_inputs = inputs[rows]
            for layer in layers:
                layer.forward(x, rope, no_attention)
            for m, x_in in zip(others, other_inputs):
                m.forward(x_in)
        return run

    def pack(self, projection: str = "auto") -> "BatonLM":
        """Cache the fused q/k norm weights and, on the CPU, prepare every projection for the
        `projection` kernel (`Linear`; "auto": the one this CPU runs fastest, timed here);
        call again after changing weights. The kernel chosen is `self.projection` (and, for "auto", logged
        with each kernel's time)."""
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.pack()
        if any(p.device.type != "cpu" for p in self.parameters()):
            return self
        if self.dtype == torch.float32:
            cpu_fused.available()  # built now (or found in its cache), not inside the first step
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if projection == "auto":
            projection, seconds = fastest_projection(linears, self.projection_probe())
            log.info("projections: %s (timed at load: %s)", projection,
                     ", ".join(f"{k} {1e3 * s:.2f} ms" for k, s in seconds.items()))
        else:
            for m in linears:
                m.pack(projection)
        self.projection = projection
        return self
