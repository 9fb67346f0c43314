"""Memory budgeting that follows from the layer routing.

Bytes are counted where layers are routed: every FULL layer (target and draft) costs one K/V row
per token of a page; every sliding layer (target and draft) costs `span = W + max_draft_tokens`
rows per request slot (a ring), or the SWA pages that cover such a span (paged SWA); the aux row
costs `AuxLayout.item_bytes` per slot. `plan_capacity` turns a byte budget into pool sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from baton.shared.kv.aux import AuxLayout
from baton.shared.kv.routing import FULL, route_layers
from baton.shared.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

# Element sizes by dtype name, so the control plane (registry, router) validates geometry
# without importing torch.
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
Dtype = Union["torch.dtype", str]


def dtype_name(dtype: Dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def element_size(dtype: Dtype) -> int:
    name = dtype_name(dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}")
    return DTYPE_BYTES[name]


def kv_row_bytes(cfg: ModelConfig, dtype: Dtype) -> int:
    """One position of one layer: K and V, [2, kv_heads, head_dim]."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * element_size(dtype)


def reservation(prompt_tokens: int, max_tokens: int, draft_tokens: int) -> int:
    """Positions a request may ever write: its prompt, its outputs, and one verify block beyond
    (the last step may verify `draft_tokens` drafts past the final output)."""
    return prompt_tokens + max_tokens + draft_tokens + 1


def sliding_span(cfg: ModelConfig, max_draft_tokens: int) -> int:
    """Positions a sliding layer keeps per request: the window plus one verify step's lookahead.

    A ring of W + k rows written k+1 rows at a time only overwrites positions no later query reads,
    so rejecting drafts is a rewind of the length. It is also the ring size R.
    """
    return cfg.sliding_window + max_draft_tokens


def swa_pages_per_request(span: int, page_size: int, num_tokens: int | None = None) -> int:
    """Most SWA pages a request ever maps: pages touching `span` consecutive positions."""
    pages = -(-(span - 1) // page_size) + 1
    return pages if num_tokens is None else min(pages, -(-num_tokens // page_size))


def aux_layout(cfg: ModelConfig) -> AuxLayout:
    return AuxLayout(hidden_size=cfg.hidden_size, hidden_rows=cfg.sliding_window)


def layer_counts(cfg: ModelConfig, mode: str, draft_enabled: bool) -> tuple[int, int]:
    """(number of FULL layers, number of sliding layers), target plus routed draft layers."""
    routing = route_layers(cfg, mode)
    keys = routing.keys(draft_enabled)
    full = sum(len(routing.layers_of(k)) for k in keys if k.kind == FULL)
    sliding = sum(len(routing.layers_of(k)) for k in keys if k.kind != FULL)
    return full, sliding


def full_bytes_per_token(cfg: ModelConfig, dtype: Dtype, draft_enabled: bool = True) -> int:
    full, _ = layer_counts(cfg, "ring", draft_enabled)
    return full * kv_row_bytes(cfg, dtype)


def sliding_bytes_per_slot(cfg: ModelConfig, mode: str, page_size: int, max_draft_tokens: int,
                           dtype: Dtype, draft_enabled: bool = True) -> int:
    """Sliding-window bytes one request needs, however long its prompt (per-window cost)."""
    _, sliding = layer_counts(cfg, mode, draft_enabled)
    span = sliding_span(cfg, max_draft_tokens)
    rows = span if mode == "ring" else swa_pages_per_request(span, page_size) * page_size
    return sliding * rows * kv_row_bytes(cfg, dtype)


def prefix_cache_bytes(cfg: ModelConfig, entries: int, max_draft_tokens: int, dtype: Dtype) -> int:
    """The prefix cache's snapshot slots (prefix_cache.py): per entry, the target's sliding layers'
    K/V and the hidden states (float32) of `span` positions. Its pages are the store's."""
    _, target_sliding = layer_counts(cfg, "ring", draft_enabled=False)
    span = sliding_span(cfg, max_draft_tokens)
    return entries * span * (target_sliding * kv_row_bytes(cfg, dtype) + cfg.hidden_size * 4)


@dataclass(frozen=True)
class Capacity:
    num_pages: int
    num_slots: int
    num_swa_pages: int  # 0 in ring mode
    nbytes: int


def store_bytes(cfg: ModelConfig, *, mode: str, num_pages: int, page_size: int, num_slots: int,
                num_swa_pages: int, dtype: Dtype, draft_enabled: bool,
                max_draft_tokens: int) -> int:
    """Bytes a KVStore of this shape allocates (all component tensors)."""
    full, sliding = layer_counts(cfg, mode, draft_enabled)
    row = kv_row_bytes(cfg, dtype)
    sliding_rows = (num_slots * sliding_span(cfg, max_draft_tokens) if mode == "ring"
                    else num_swa_pages * page_size)
    return (full * num_pages * page_size * row + sliding * sliding_rows * row
            + num_slots * aux_layout(cfg).item_bytes)


def plan_capacity(cfg: ModelConfig, byte_budget: int, *, mode: str = "ring", page_size: int,
                  max_draft_tokens: int, tokens_per_request: int,
                  dtype: Dtype = "float32", draft_enabled: bool = True) -> Capacity:
    """Pool sizes for as many requests of `tokens_per_request` tokens as fit in `byte_budget`."""
    pages_per_request = -(-tokens_per_request // page_size)
    per_request = (pages_per_request * page_size * full_bytes_per_token(cfg, dtype, draft_enabled)
                   + sliding_bytes_per_slot(cfg, mode, page_size, max_draft_tokens, dtype,
                                            draft_enabled)
                   + aux_layout(cfg).item_bytes)
    requests = byte_budget // per_request
    if requests == 0:
        raise ValueError(f"a byte budget of {byte_budget} does not hold one request of "
                         f"{tokens_per_request} tokens ({per_request} bytes)")
    swa = requests * swa_pages_per_request(sliding_span(cfg, max_draft_tokens), page_size)
    shape = dict(mode=mode, num_pages=requests * pages_per_request, page_size=page_size,
                 num_slots=requests, num_swa_pages=swa if mode == "paged" else 0)
    nbytes = store_bytes(cfg, dtype=dtype, draft_enabled=draft_enabled,
                         max_draft_tokens=max_draft_tokens, **shape)
    return Capacity(num_pages=shape["num_pages"], num_slots=requests,
                    num_swa_pages=shape["num_swa_pages"], nbytes=nbytes)
