"""Worker manifests: every KV component a worker registers, plus the model fingerprint.

A manifest is a `Record` (components.py): it travels typed in the protocol's
`WorkerRegistration.manifest`, decoded and type-checked by proto's codec (never pickle).
`validate_manifest(cfg, m)` runs at start-up and refuses, with a
`ManifestError` naming the component, anything a transfer would silently get wrong (seed 000):
  - a draft sliding-window component holding a layer that is not sliding (draft not pure SWA);
  - draft and target sliding state in different modes (SWA vs SWA_RING);
  - a draft ring whose geometry (window, ring size, slots) differs from the target ring;
  - a paged draft SWA that does not share the target's full->SWA page mapping;
  - components whose layers or geometry disagree with the config's routing, or that are not
    stored item-major (one region per component, every layer in each item).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from baton.shared.kv.aux import HEADER_BYTES
from baton.shared.kv.budget import aux_layout, kv_row_bytes
from baton.shared.kv.components import ITEM_MAJOR, Component, Record
from baton.shared.kv.routing import (AUX_KEY, DRAFT, FULL, MODES, SWA, SWA_RING, TARGET,
                                     route_layers)
from baton.shared.model.config import SLIDING, ModelConfig

if TYPE_CHECKING:
    import torch

ROLES = ("prefill", "decode")


class ManifestError(ValueError):
    """A manifest that cannot be served; the message names the component and the problem."""


class Manifest(Record):
    worker_id: str
    role: str  # "prefill" | "decode"
    fingerprint: str  # model fingerprint: hash of config and weights
    mode: str  # sliding-window storage: "ring" | "paged"
    components: tuple[Component, ...]

    def component(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)


def fingerprint(config_dict: Mapping, weights: "Mapping[str, torch.Tensor] | bytes") -> str:
    """sha256 of the canonical config JSON and of the weights (tensors by name, or file bytes)."""
    h = hashlib.sha256(json.dumps(config_dict, sort_keys=True, default=list).encode())
    if isinstance(weights, (bytes, bytearray, memoryview)):
        h.update(bytes(weights))
    else:
        import torch  # tensors only on workers; the registry hashes nothing

        for name in sorted(weights):
            t = weights[name].detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def validate_manifest(cfg: ModelConfig, manifest: Manifest) -> None:
    """Raise ManifestError unless `manifest` is a complete, consistent description for `cfg`."""
    if manifest.mode not in MODES:
        raise ManifestError(f"manifest mode {manifest.mode!r} is not one of {MODES}")
    if manifest.role not in ROLES:
        raise ManifestError(f"manifest role {manifest.role!r} is not one of {ROLES}")
    by_name: dict[str, Component] = {}
    for comp in manifest.components:
        if comp.name in by_name:
            raise ManifestError(f"component {comp.name} is registered twice")
        by_name[comp.name] = comp
    _check_draft_against_target(cfg, by_name)
    routing = route_layers(cfg, manifest.mode)
    for comp in manifest.components:
        if comp.key == AUX_KEY:
            _check_aux(cfg, comp)
        elif comp.key not in routing.keys(draft_enabled=True):
            raise ManifestError(f"component {comp.name} is not a pool of this model in "
                                f"{manifest.mode} mode")
        else:
            if comp.ident.layer_ids != routing.layers_of(comp.key):
                raise ManifestError(
                    f"component {comp.name} holds layers {list(comp.ident.layer_ids)} but the "
                    f"config routes layers {list(routing.layers_of(comp.key))} to it")
            _check_kv_geometry(cfg, comp)
    draft_present = any(c.ident.owner == DRAFT for c in manifest.components)
    for key in (*routing.keys(draft_enabled=draft_present), AUX_KEY):
        if key.name not in by_name:
            why = ("every worker registers the aux row" if key == AUX_KEY else
                   f"the config routes layers {list(routing.layers_of(key))} to it")
            raise ManifestError(f"component {key.name} is missing: {why}")


def _check_draft_against_target(cfg: ModelConfig, by_name: dict[str, Component]) -> None:
    """Seed 000: the draft's state can travel only if it matches the target's storage."""
    target = next((c for c in by_name.values()
                   if c.ident.owner == TARGET and c.ident.kind in (SWA, SWA_RING)), None)
    for draft in by_name.values():
        if draft.ident.owner == DRAFT and draft.ident.kind in (SWA, SWA_RING):
            _check_pure_swa(cfg, draft)
            if target is not None:
                _check_shared_sliding(draft, target)
    draft_full, target_full = by_name.get(f"{DRAFT}/{FULL}"), by_name.get(f"{TARGET}/{FULL}")
    if draft_full is None:
        return
    d = draft_full.geometry
    if target_full is None or (d.num_items, d.item_rows) != (target_full.geometry.num_items,
                                                             target_full.geometry.item_rows):
        raise ManifestError(f"component {draft_full.name}: draft full-attention pages must share "
                            f"the target's page tables (same page count and page size as "
                            f"{TARGET}/{FULL})")


def _check_pure_swa(cfg: ModelConfig, draft: Component) -> None:
    first, end = cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_draft_layers
    for layer_id in draft.ident.layer_ids:
        if not first <= layer_id < end:
            raise ManifestError(f"component {draft.name} holds layer {layer_id}, which is not a "
                                f"draft layer of this model")
        if cfg.attention_type(layer_id) != SLIDING:
            raise ManifestError(f"component {draft.name}: draft layer {layer_id} is "
                                f"{cfg.attention_type(layer_id)}, not pure SWA; a draft "
                                f"sliding-window component may hold only sliding_attention layers")


def _check_shared_sliding(draft: Component, target: Component) -> None:
    if draft.ident.kind != target.ident.kind:
        raise ManifestError(f"component {draft.name}: draft and target use different SWA modes "
                            f"({draft.ident.kind} vs {target.name})")
    d, t = draft.geometry, target.geometry
    if draft.ident.kind == SWA_RING:
        diff = [f"{f} {getattr(d, f)} != {getattr(t, f)}"
                for f in ("window", "item_rows", "num_items") if getattr(d, f) != getattr(t, f)]
        if diff:
            raise ManifestError(f"component {draft.name}: draft ring geometry differs from "
                                f"{target.name} (window, ring size, rows): {', '.join(diff)}")
    elif (d.index_map, d.num_items, d.item_rows) != (t.index_map, t.num_items, t.item_rows):
        raise ManifestError(
            f"component {draft.name}: paged draft SWA does not share the target's full->SWA "
            f"mapping ({d.index_map!r}, {d.num_items} pages of {d.item_rows} vs "
            f"{t.index_map!r}, {t.num_items} pages of {t.item_rows} in {target.name})")


def _check_kv_geometry(cfg: ModelConfig, comp: Component) -> None:
    g = comp.geometry
    try:
        row = kv_row_bytes(cfg, g.dtype)
    except ValueError as exc:
        raise ManifestError(f"component {comp.name}: {exc}") from exc
    window = None if comp.ident.kind == FULL else cfg.sliding_window
    layers = len(comp.ident.layer_ids)
    expected = dict(kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, row_bytes=row,
                    header_bytes=0, item_bytes=layers * g.item_rows * row, window=window,
                    order=ITEM_MAJOR, layers_per_item=layers)
    wrong = [f"{k}={getattr(g, k)} (expected {v})"
             for k, v in expected.items() if getattr(g, k) != v]
    if comp.ident.kind == SWA_RING and g.item_rows < cfg.sliding_window:
        wrong.append(f"ring of {g.item_rows} rows is shorter than the window {cfg.sliding_window}")
    _check_regions(comp, wrong)


def _check_aux(cfg: ModelConfig, comp: Component) -> None:
    g, layout = comp.geometry, aux_layout(cfg)
    expected = dict(dtype="float32", item_rows=layout.hidden_rows, row_bytes=layout.row_bytes,
                    item_bytes=layout.item_bytes, header_bytes=HEADER_BYTES, order=ITEM_MAJOR,
                    layers_per_item=0)
    wrong = [f"{k}={getattr(g, k)} (expected {v})"
             for k, v in expected.items() if getattr(g, k) != v]
    if comp.ident.layer_ids:
        wrong.append(f"layer ids {list(comp.ident.layer_ids)} (expected none)")
    _check_regions(comp, wrong, layout.block_bytes)  # registered in blocks, not rows (kv/aux.py)


def _check_regions(comp: Component, wrong: list[str], unit: int | None = None) -> None:
    """One region holding every item; NIXL's items are `unit` bytes (default: one item)."""
    g = comp.geometry
    unit = g.item_bytes if unit is None else unit
    if len(comp.regions) != 1:
        wrong.append(f"{len(comp.regions)} regions (expected one for the whole component)")
    wrong += [f"region {i} is {r.nbytes} bytes of {r.item_bytes}-byte items (expected "
              f"{g.num_items * g.item_bytes} bytes of {unit})"
              for i, r in enumerate(comp.regions)
              if (r.nbytes, r.item_bytes) != (g.num_items * g.item_bytes, unit)]
    if wrong:
        raise ManifestError(f"component {comp.name} has a wrong geometry: {'; '.join(wrong)}")
