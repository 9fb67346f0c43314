"""Transfer plans: pair a prefill manifest with a decode manifest, then list the bytes to copy.

`make_plan(prefill, decode)` (seed 003) pairs components by identity (owner/kind), never by
position, and checks geometry. Decode may register components prefill does not provide
(decode-only speculative decoding: prefill runs no draft); they are listed in `not_provided`
and `draft_state` says how decode starts its draft window:
    "none"      decode has no draft components
    "transfer"  prefill provides every draft component; the draft state travels
    "rebuild"   no draft state travels, but the aux hidden tail (W rows) lets decode recompute
                its sliding draft window from target hidden states
    "cold"      no draft state and no way to rebuild it: the draft starts with an empty window
Refused with a PlanError naming the component: different model fingerprints; a prefill
component decode lacks; different layer ids or item sizes; a missing target or aux component;
a partial draft; a component in host memory on one side and device memory on the other (a CPU
prefill with a GPU decode: not verified on a GPU yet, so refused rather than assumed); mixed KV
memory kinds on one side together with decode-only speculation (seed 003; the aux rows, host
memory on every device, do not count).

`plan.descriptors(L, src_alloc, dst_alloc)` returns, for a request of L prompt tokens, the byte
runs to copy, one per run of whole items adjacent on both sides (items hold every layer): the
pages of FULL components from `dst_alloc.reused` (positions decode holds already, in pages shared
from its turn cache, are not sent) to L, the pages of the window (paged SWA) or the slot (ring)
of sliding components, and the aux header with the hidden rows decode needs (`aux_hidden_rows(L)`).
The layout (`order`, `layers_per_item`, `item_bytes`) is checked like the rest of the geometry.
"""
from __future__ import annotations

from baton.shared.kv.components import Allocation, Component, Record
from baton.shared.kv.descriptors import (Descriptor, PlanError, alloc_items, merge_runs,
                                         needed_positions)
from baton.shared.kv.manifest import Manifest
from baton.shared.kv.routing import AUX, AUX_OWNER, DRAFT, FULL

_GEOMETRY_FIELDS = ("order", "layers_per_item", "dtype", "item_rows", "row_bytes", "header_bytes",
                    "item_bytes", "window", "kv_heads", "head_dim")


class Pair(Record):
    src: Component  # prefill side
    dst: Component  # decode side


class TransferPlan(Record):
    prefill_worker: str
    decode_worker: str
    fingerprint: str
    pairs: tuple[Pair, ...]
    not_provided: tuple[str, ...]  # decode components prefill does not send
    draft_state: str  # "none" | "transfer" | "rebuild" | "cold"

    @property
    def components(self) -> list[str]:
        """Names ("owner/kind") of the components the plan transfers (decode waits for each)."""
        return [pair.src.name for pair in self.pairs]

    def aux_hidden_rows(self, length: int) -> int:
        """Hidden rows decode needs in the aux row: h_{L-1} to start drafting, W to rebuild."""
        if self.draft_state == "none":
            return 0
        aux = next((p.src for p in self.pairs if p.src.ident.kind == AUX), None)
        rows = aux.geometry.item_rows if self.draft_state == "rebuild" and aux else 1
        return min(length, rows)

    def descriptors(self, length: int, src_alloc: Allocation,
                    dst_alloc: Allocation) -> list[Descriptor]:
        out: list[Descriptor] = []
        for pair in self.pairs:
            g, name = pair.src.geometry, pair.src.name
            if pair.src.ident.kind == AUX:
                nbytes = g.header_bytes + self.aux_hidden_rows(length) * g.row_bytes
                out.append(Descriptor(name, 0, src_alloc.slot * g.item_bytes,
                                      dst_alloc.slot * g.item_bytes, nbytes))
                continue
            positions = needed_positions(pair.src.ident.kind, g.window, length)
            if pair.src.ident.kind == FULL:  # what decode holds already (its turn cache) stays
                positions = positions[positions >= dst_alloc.reused]
            runs = merge_runs(alloc_items(pair.src, src_alloc, positions, "prefill"),
                              alloc_items(pair.dst, dst_alloc, positions, "decode"))
            out += [Descriptor(name, 0, s * g.item_bytes, d * g.item_bytes, n * g.item_bytes)
                    for s, d, n in runs]
        return out


def make_plan(prefill: Manifest, decode: Manifest) -> TransferPlan:
    if prefill.fingerprint != decode.fingerprint:
        raise PlanError(f"model fingerprint differs: prefill {prefill.worker_id} has "
                        f"{prefill.fingerprint}, decode {decode.worker_id} has "
                        f"{decode.fingerprint}")
    if (prefill.role, decode.role) != ("prefill", "decode"):
        raise PlanError(f"expected a prefill and a decode manifest, got roles "
                        f"{prefill.role!r} and {decode.role!r}")
    src, dst = _by_name(prefill), _by_name(decode)
    not_provided = tuple(name for name in dst if name not in src)
    for side, manifest in (("prefill", prefill), ("decode", decode)):
        kinds = {c.mem_kind for c in manifest.components if c.ident.kind != AUX}
        if not_provided and len(kinds) > 1:
            raise PlanError(f"not supported: {side} {manifest.worker_id} mixes memory kinds "
                            f"{sorted(kinds)} together with decode-only speculative decoding "
                            f"({', '.join(not_provided)} not provided)")
    pairs = []
    for name, comp in src.items():
        if name not in dst:
            raise PlanError(f"prefill component {name} has no decode counterpart"
                            f"{_missing_hint(comp, decode)}")
        _check_pair(comp, dst[name])
        pairs.append(Pair(comp, dst[name]))
    for name in not_provided:
        if dst[name].ident.owner != DRAFT:
            raise PlanError(f"decode component {name} is not provided by prefill; only draft "
                            f"components may be missing (decode-only speculative decoding)")
    draft = [name for name, comp in dst.items() if comp.ident.owner == DRAFT]
    if not_provided and len(not_provided) != len(draft):
        raise PlanError(f"prefill provides only part of the draft state ({', '.join(not_provided)} "
                        f"missing); a partial draft transfer is not supported")
    return TransferPlan(prefill_worker=prefill.worker_id, decode_worker=decode.worker_id,
                        fingerprint=prefill.fingerprint, pairs=tuple(pairs),
                        not_provided=not_provided, draft_state=_draft_state(draft, not_provided,
                                                                           dst, src))


def _by_name(manifest: Manifest) -> dict[str, Component]:
    out: dict[str, Component] = {}
    for comp in manifest.components:
        if comp.name in out:
            raise PlanError(f"{manifest.role} {manifest.worker_id} registers {comp.name} twice")
        out[comp.name] = comp
    return out


def _missing_hint(comp: Component, decode: Manifest) -> str:
    same_owner = [c.name for c in decode.components if c.ident.owner == comp.ident.owner
                  and c.ident.kind != FULL and comp.ident.kind != FULL]
    if same_owner:
        return (f" (decode registers {', '.join(same_owner)}: prefill and decode use different "
                f"sliding-window modes)")
    if comp.ident.owner == DRAFT and not any(c.ident.owner == DRAFT for c in decode.components):
        return " (decode runs no draft layer)"
    return ""


def _check_pair(src: Component, dst: Component) -> None:
    if src.ident.layer_ids != dst.ident.layer_ids:
        raise PlanError(f"component {src.name}: prefill holds layers {list(src.ident.layer_ids)}, "
                        f"decode holds {list(dst.ident.layer_ids)}")
    diff = [f"{f} {getattr(src.geometry, f)} != {getattr(dst.geometry, f)}"
            for f in _GEOMETRY_FIELDS if getattr(src.geometry, f) != getattr(dst.geometry, f)]
    if len(src.regions) != len(dst.regions):
        diff.append(f"regions {len(src.regions)} != {len(dst.regions)}")
    if src.mem_kind != dst.mem_kind:
        raise PlanError(f"component {src.name}: prefill holds it in {src.mem_kind}, decode in {dst.mem_kind}; "
                        "a transfer between host and device memory is not supported (run prefill and decode "
                        "on the same kind of device)")
    if diff:
        raise PlanError(f"component {src.name}: prefill and decode geometry differ "
                        f"(prefill vs decode): {', '.join(diff)}")


def _draft_state(draft: list[str], not_provided: tuple[str, ...], dst: dict[str, Component],
                 src: dict[str, Component]) -> str:
    if not draft:
        return "none"
    if not not_provided:
        return "transfer"
    aux = src.get(f"{AUX_OWNER}/{AUX}")
    sliding = all(dst[n].ident.kind != FULL for n in not_provided)
    window = max((dst[n].geometry.window or 0) for n in not_provided)
    return "rebuild" if sliding and aux and aux.geometry.item_rows >= window else "cold"
