"""Qwen3-style building blocks: RMSNorm, RoPE, GQA attention with q/k norm, SwiGLU MLP.

Tensors are flattened over the batch: T = total new tokens in a forward, d = hidden size,
H / Hkv = query / key-value heads, D = head_dim. Attention itself (which keys a query sees,
where K/V are stored) is delegated to an `Attention` object so the same layer runs over
a dense no-cache batch (training, tests) and over paged / ring KV pools (serving).

Fewer, bigger ops: q, k and v are one projection (`qkv_proj`), gate and up are one
(`gate_up_proj`); the q and k norms and RoPE run over q and k together. The checkpoint keeps
the Hugging Face names (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`): `FusedLinear`
maps them to and from the fused weight in `state_dict` / `load_state_dict`, so checkpoints load
in `transformers` unchanged. Fusing changes no arithmetic: every output element is the same dot
product (tests/test_model_reference.py compares against `transformers`).
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels import cpu_fused

from .config import ModelConfig


class Attention(Protocol):
    def __call__(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; kv: [T, 2, Hkv, D] (K with RoPE applied, then V) for the new tokens -> out [T, H, D].

        Implementations store kv for the new tokens and attend over every key the query
        may see under the layer's attention type (causal, plus the window for sliding layers).
        """


class RMSNorm(nn.Module):
    """weight * x / rms(x) in fp32, as `transformers`' Qwen3RMSNorm (kernels/cpu_fused.py: one fused
    call on the CPU, its reference elsewhere)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_fused.rms_norm(x, self.weight, self.eps)


# the overload itself: calling the packet resolves it on every call (a few us, ~55 times a decode step)
PACKED_LINEAR = torch.ops.mkldnn._linear_pointwise.default
PROJECTION_KERNELS = ("onednn", "blas")  # what `Linear.pack` can run; "auto" picks one by timing it


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks weights of `dtype` on this CPU (bfloat16 needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; where it cannot, projections stay on F.linear, which runs bfloat16 anywhere)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype, device="cpu"), 4)
    except RuntimeError:
        return False
    return True


class Linear(nn.Linear):
    """A bias-free projection. After `pack(kernel)` (done by `load_model` on the CPU), inference
    runs through one of two kernels, whichever runs this CPU's decoder layers faster
    (`fastest_projection`): `onednn`, oneDNN's prepacked GEMM, or `blas`, torch.mm over the weight
    stored transposed ([in, out], contiguous). For the few-row products of decode the time is
    mostly reading the weight from memory, and which kernel streams it faster depends on the CPU:
    on the first AMD EPYC VMs this project ran on, oneDNN by 2-4x; on Intel Sapphire Rapids, BLAS by
    1.7x; on the AVX2 EPYC of stops 51-54, BLAS, whose fused layer path oneDNN lacks
    (docs/benchmarks.md). Results agree with F.linear to rounding (another summation order).
    Training and grad-enabled calls always use F.linear."""

    packed: torch.Tensor | None = None
    kernel: str | None = None

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, bias=False)

    def pack(self, kernel: str) -> None:
        """Prepare the current weight for `kernel` (call again after changing it)."""
        self.packed, self.kernel = self.packed_for(kernel), kernel

    def packed_for(self, kernel: str) -> torch.Tensor:
        """The current weight as `kernel` reads it."""
        weight = self.weight.detach()
        if kernel == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight, 4)
        if kernel == "blas":
            return weight.t().contiguous()  # [in, out]
        raise ValueError(f"projection kernel must be one of {PROJECTION_KERNELS}, got {kernel!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or torch.is_grad_enabled():
            return F.linear(x, self.weight)
        if self.kernel == "onednn":
            return PACKED_LINEAR(x, self.packed, None, "none", [], "")
        return x.mm(self.packed) if x.dim() == 2 else x.matmul(self.packed)  # [..., in] @ [in, out]


def fastest_projection(linears: list[Linear], run: Callable[[int], None], rows: tuple[int, ...] = (1, 16),
                       rounds: int = 5) -> tuple[str, dict]:
    """The kernel under which `run(r)` (the work the kernel choice changes, at r rows: decode's
    one-row drafts, a verify of several rows) takes the least CPU time here, and each candidate's
    best time. CPU time, and the candidates taking turns round by round after a warm-up round: the
    other services starting beside this one may take the core for a while, which neither counts nor
    slows all of one candidate's rounds. Best of `rounds`. Leaves `linears` packed for the winner."""
    dtype = linears[0].weight.dtype
    packs = {kernel: [m.packed_for(kernel) for m in linears]
             for kernel in PROJECTION_KERNELS if kernel != "onednn" or onednn_packs(dtype)}
    seconds = {kernel: float("inf") for kernel in packs}

    def use(kernel: str) -> None:
        for m, packed in zip(linears, packs[kernel]):
            m.packed, m.kernel = packed, kernel

    with torch.inference_mode():
        for i in range(rounds + 1):
            for kernel in packs:
                use(kernel)
                start = time.thread_time()
                for r in rows:
                    run(r)
                if i:
                    seconds[kernel] = min(seconds[kernel], time.thread_time() - start)
    best = min(seconds, key=seconds.get)
    use(best)
    return best, seconds


class FusedLinear(Linear):
    """One bias-free projection whose output is the concatenation of named parts.

    state_dict() lists the parts under their own names (`<prefix><part>.weight`, views of the
    fused weight), and load_state_dict() accepts them, so the fused layer reads and writes
    checkpoints of separate projections."""

    def __init__(self, d_in: int, parts: dict[str, int]) -> None:
        super().__init__(d_in, sum(parts.values()))
        self.parts = parts
        self._register_state_dict_hook(FusedLinear._split_parts)
        self._register_load_state_dict_pre_hook(self._join_parts)

    @staticmethod
    def _split_parts(module: "FusedLinear", state: dict, prefix: str, _meta) -> None:
        fused = state.pop(prefix + "weight")
        for name, rows in zip(module.parts, fused.split(list(module.parts.values()))):
            state[f"{_parent(prefix)}{name}.weight"] = rows

    def _join_parts(self, state: dict, prefix: str, *_args) -> None:
        names = [f"{_parent(prefix)}{name}.weight" for name in self.parts]
        if all(n in state for n in names):
            state[prefix + "weight"] = torch.cat([state.pop(n) for n in names])


def _parent(prefix: str) -> str:
    """'model.layers.0.self_attn.qkv_proj.' -> 'model.layers.0.self_attn.'"""
    return prefix[:prefix.rstrip(".").rfind(".") + 1]


class Rotary(nn.Module):
    """Default (unscaled) RoPE from a table computed once, exactly as `transformers` computes it
    in fp32 (position * inv_freq, then cos / sin). The rotation (`cpu_fused.qk_norm_rope`, with
    the q/k norms) is x * cos + roll(x, D/2) * sin_signed, with sin_signed = (-sin_1, sin_2):
    bitwise the same as x * cos + rotate_half(x) * sin."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta ** exponent), persistent=False)  # [D/2]
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0), persistent=False)
        self._grow(max_positions)

    def _grow(self, n: int) -> None:
        freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # [n, D/2]
        self.cos = torch.cat((freqs, freqs), dim=-1).cos()  # [n, D]
        self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # [n, D]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin_signed) in `dtype`, each [T, 1, D] (broadcast over heads).
        max_position: the largest position, when the caller knows it (no host sync here)."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        if max_position >= self.cos.shape[0]:
            self._grow(max(2 * self.cos.shape[0], max_position + 1))
        cos, sin = self.cos.index_select(0, positions)[:, None, :], self.sin_signed.index_select(0, positions)[:, None, :]
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))


class SelfAttention(nn.Module):
    packed_norm_weight: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, qd, kd = cfg.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(d, {"q_proj": qd, "k_proj": kd, "v_proj": kd})
        self.o_proj = Linear(qd, d)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Attention) -> torch.Tensor:
        T, H, Hkv = x.shape[0], self.heads, self.kv_heads
        qkv = self.qkv_proj.forward(x).view(T, H + 2 * Hkv, self.head_dim)  # [T, H + 2Hkv, D]
        # q and k heads normed and rotated: [T, H + Hkv, D]
        qk = cpu_fused.qk_norm_rope(qkv, self.qk_norm_weight(), *rope, self.q_norm.eps)
        out = attn(self.layer_id, qk[:, :H], torch.stack((qk[:, H:], qkv[:, H + Hkv:]), 1))  # [T, H, D]
        return self.o_proj.forward(out.reshape(T, H * self.head_dim))

    def qk_norm_weight(self) -> torch.Tensor:
        """[H + Hkv, D]: q_norm's weight for each query head, then k_norm's for each KV head (cached
        by `pack()` for inference)."""
        if self.packed_norm_weight is not None and not torch.is_grad_enabled():
            return self.packed_norm_weight
        return torch.cat((self.q_norm.weight.expand(self.heads, -1), self.k_norm.weight.expand(self.kv_heads, -1)))

    def pack(self) -> None:
        self.packed_norm_weight = None
        self.packed_norm_weight = self.qk_norm_weight().detach()


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = FusedLinear(d, {"gate_proj": hidden, "up_proj": hidden})
        self.down_proj = Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [T, 2 * hidden]
        return self.down_proj.forward(F.silu(gate_up[:, :self.hidden]) * gate_up[:, self.hidden:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_id)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Attention,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] -> [T, d], or [N, d] for `rows` [N] (the tokens whose output is wanted: the
        output projection and MLP run for those only; every token's K/V is stored either way)."""
        if self._fused(x):
            return self._fused_forward(x, rope, attn, rows)
        post = self.post_attention_layernorm
        a = self.self_attn.forward(self.input_layernorm.forward(x), rope, attn)  # [T, d]
        if rows is not None:
            x, a = x.index_select(0, rows), a.index_select(0, rows)
        x, h = cpu_fused.add_rms_norm(x, a, post.weight, post.eps)  # x + attention, its norm: [N, d] each
        return x + self.mlp.forward(h)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether this call runs as two fused CPU ops around the attention: projections packed for
        BLAS (the weights stored transposed, which the ops take) and an input the ops take."""
        a, mlp = self.self_attn, self.mlp
        return (a.qkv_proj.kernel == a.o_proj.kernel == mlp.gate_up_proj.kernel == mlp.down_proj.kernel == "blas"
                and cpu_fused.takes(x))

    def _fused_forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Attention,
                       rows: torch.Tensor | None) -> torch.Tensor:
        """`forward` in three calls instead of ~15 (at decode sizes a layer is mostly per-op cost):
        the same ops in the same order, so the same results bit for bit."""
        a, mlp, inorm, post = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        q, kv = cpu_fused.attention_input(x, inorm.weight, inorm.eps, a.qkv_proj.packed, a.qk_norm_weight(), *rope,
                                          a.q_norm.eps, a.kv_heads)  # [T, H, D], [T, 2, Hkv, D]
        out = attn(a.layer_id, q, kv)  # [T, H, D]
        if rows is not None:
            x, out = x.index_select(0, rows), out.index_select(0, rows)  # [N, d], [N, H, D]
        return cpu_fused.attention_output_mlp(x, out, a.o_proj.packed, post.weight, post.eps, mlp.gate_up_proj.packed,
                                              mlp.down_proj.packed)
