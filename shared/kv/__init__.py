"""KV state: layer routing, pools (paged FULL, paged SWA, SWA rings, aux), manifests and
transfer plans. See docs/kv_state.md for the contract; the modules, one job each:

    routing     route_layers(cfg, mode) -> LayerRouting: layer id -> PoolKey(owner, kind)
    budget      bytes per token / per slot from the routing; plan_capacity(cfg, byte_budget, ...)
    store       KVStore: component tensors + allocate / extend / rollback / free / rows
    allocator   IdPool: page / slot ids, handed out as contiguous runs where possible
    host_memory huge_page_zeros: CPU pool tensors on 2 MiB huge pages (fast NIXL copies)
    components  Record (what travels: frozen msgspec Structs, typed in proto/), Component
                (identity, geometry, regions), Allocation (per-request record)
    manifest    Manifest, validate_manifest, fingerprint
    plan        make_plan(prefill, decode) -> TransferPlan; plan.descriptors(L, src, dst)
    aux         the aux row: request tag, first token, hidden-state tail
"""
import importlib

# Re-exports resolve lazily (PEP 562), so `import baton.shared.kv.plan` in the registry or the
# router does not pull in torch through the store.
_HOME = {
    "allocator": ("KVError", "OutOfCapacity"),
    "aux": ("AuxLayout", "AuxRecord", "pack_aux", "unpack_aux"),
    "budget": ("Capacity", "full_bytes_per_token", "plan_capacity", "sliding_bytes_per_slot"),
    "components": ("Allocation", "Component", "ComponentId", "Geometry", "Record", "Region"),
    "descriptors": ("Descriptor", "PlanError"),
    "manifest": ("Manifest", "ManifestError", "fingerprint", "validate_manifest"),
    "plan": ("Pair", "TransferPlan", "make_plan"),
    "routing": ("AUX", "DRAFT", "FULL", "SWA", "SWA_RING", "TARGET", "LayerRouting", "PoolKey", "route_layers"),
    "store": ("FreeCapacity", "KVStore"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


__all__ = [
    "AUX", "DRAFT", "FULL", "SWA", "SWA_RING", "TARGET", "Allocation", "AuxLayout", "AuxRecord",
    "Capacity", "Component", "ComponentId", "Descriptor", "FreeCapacity",
    "Geometry", "KVError", "KVStore", "LayerRouting", "Manifest", "ManifestError",
    "OutOfCapacity", "Pair", "PlanError", "PoolKey", "Record", "Region", "TransferPlan",
    "full_bytes_per_token", "fingerprint", "make_plan", "pack_aux", "plan_capacity",
    "route_layers", "sliding_bytes_per_slot", "unpack_aux", "validate_manifest",
]
