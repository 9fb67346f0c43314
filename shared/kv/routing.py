"""Layer routing: which pool holds each layer, derived from per-layer attention metadata only.

Every target layer (ids 0..N-1) and every draft layer (ids N..N+M-1) maps to a `PoolKey`
(owner, kind). The kind of a layer follows from `cfg.attention_type(layer_id)` and the store's
sliding-window mode; nothing here looks at an architecture or class name, so a config with a
different sliding/full pattern or a full-attention draft layer routes without code changes:

    full_attention    -> (owner, FULL)      paged; draft FULL shares the target's page tables
    sliding_attention -> (owner, SWA)       mode "paged": SWA pages via the full->SWA mapping
                      -> (owner, SWA_RING)  mode "ring": one ring of R rows per request slot
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.shared.model.config import FULL as FULL_ATTENTION, ModelConfig

TARGET, DRAFT, AUX_OWNER = "target", "draft", "aux"
FULL, SWA, SWA_RING, AUX = "FULL", "SWA", "SWA_RING", "AUX"
MODES = ("ring", "paged")
SLIDING_KIND = {"ring": SWA_RING, "paged": SWA}


@dataclass(frozen=True, order=True)
class PoolKey:
    owner: str  # "target" | "draft" | "aux"
    kind: str  # FULL | SWA | SWA_RING | AUX

    @property
    def name(self) -> str:
        return f"{self.owner}/{self.kind}"


AUX_KEY = PoolKey(AUX_OWNER, AUX)


@dataclass(frozen=True)
class LayerRouting:
    mode: str
    by_layer: tuple[PoolKey, ...]  # by_layer[layer_id]: the pool of that layer

    def key_of(self, layer_id: int) -> PoolKey:
        if not 0 <= layer_id < len(self.by_layer):
            raise KeyError(f"layer {layer_id} does not exist "
                           f"(the model has {len(self.by_layer)} layers)")
        return self.by_layer[layer_id]

    def layers_of(self, key: PoolKey) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.by_layer) if k == key)

    def keys(self, draft_enabled: bool = True) -> tuple[PoolKey, ...]:
        """Pool keys in a fixed order: target before draft, FULL before sliding."""
        owners = (TARGET, DRAFT) if draft_enabled else (TARGET,)
        present = set(self.by_layer)
        return tuple(PoolKey(o, k) for o in owners for k in (FULL, SLIDING_KIND[self.mode])
                     if PoolKey(o, k) in present)


def route_layers(cfg: ModelConfig, mode: str = "ring") -> LayerRouting:
    """Map every target and draft layer to its pool from the config's attention metadata."""
    if mode not in MODES:
        raise ValueError(f"sliding-window mode must be one of {MODES}, got {mode!r}")
    keys = []
    for layer_id in range(cfg.num_hidden_layers + cfg.num_draft_layers):
        owner = TARGET if layer_id < cfg.num_hidden_layers else DRAFT
        full = cfg.attention_type(layer_id) == FULL_ATTENTION
        keys.append(PoolKey(owner, FULL if full else SLIDING_KIND[mode]))
    return LayerRouting(mode=mode, by_layer=tuple(keys))
