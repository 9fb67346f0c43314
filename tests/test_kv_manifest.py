"""Components, manifests and start-up validation (seed 000: draft state registration)."""
import msgpack
import pytest
import torch
from msgspec.structs import replace

from baton.proto.codec import decode, encode
from baton.proto.errors import BatonError
from baton.proto.internal import Capacity, WorkerRegistration
from baton.shared.kv import KVStore, ManifestError, fingerprint, validate_manifest
from baton.shared.model.config import FULL as F, SLIDING as S, ModelConfig

pytestmark = pytest.mark.unit
W, PS, K = 8, 4, 3


def make_cfg(layer_types=(S, S, F, S), mtp_layer_types=(S,)) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=6, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, num_hidden_layers=len(layer_types),
                       layer_types=tuple(layer_types), sliding_window=W,
                       num_nextn_predict_layers=len(mtp_layer_types),
                       mtp_layer_types=tuple(mtp_layer_types))


CFG = make_cfg()


def make_manifest(mode, cfg=CFG, draft=True, role="decode"):
    store = KVStore(cfg, mode=mode, num_pages=16, page_size=PS, num_slots=2, max_draft_tokens=K,
                    draft_enabled=draft)
    store.check_integrity()
    return store, store.manifest(f"{role}-0", "sha256:model", role=role)


def edit(manifest, name, *, layer_ids=None, kind=None, **geometry):
    """The manifest with one component's identity or geometry changed."""
    comps = []
    for c in manifest.components:
        if c.name == name:
            ident = replace(c.ident, **{k: v for k, v in (("layer_ids", layer_ids), ("kind", kind))
                                        if v is not None})
            c = replace(c, ident=ident, geometry=replace(c.geometry, **geometry))
        comps.append(c)
    return replace(manifest, components=tuple(comps))


def region_owner(store, addr):
    """The component whose tensor holds `addr`."""
    for key, data in store.data.items():
        start = data.data_ptr()
        if start <= addr < start + data.numel() * data.element_size():
            return key.name
    return "aux/AUX" if store.aux.data_ptr() <= addr < store.aux.data_ptr() + store.aux.numel() \
        else None


class TestDraftStateRegistration:
    """Paged and ring modes register target and draft sliding state as separate components."""

    @pytest.mark.parametrize("mode,kind", [("paged", "SWA"), ("ring", "SWA_RING")])
    def test_draft_sliding_state_is_its_own_component(self, mode, kind):
        store, m = make_manifest(mode)
        validate_manifest(CFG, m)
        assert [c.name for c in m.components] == ["target/FULL", f"target/{kind}",
                                                  f"draft/{kind}", "aux/AUX"]
        target, draft = m.component(f"target/{kind}"), m.component(f"draft/{kind}")
        assert target.ident.layer_ids == (0, 1, 3) and draft.ident.layer_ids == (4,)
        assert target.geometry.window == draft.geometry.window == W
        assert len(draft.regions) == len(target.regions) == 1  # item-major: one region each
        assert (target.geometry.layers_per_item, draft.geometry.layers_per_item) == (3, 1)
        assert target.geometry.item_bytes == 3 * target.geometry.item_rows * target.geometry.row_bytes
        for comp in m.components:  # every region lies in its own component's tensor
            assert {region_owner(store, r.addr) for r in comp.regions} == {comp.name}
        if mode == "paged":
            assert draft.geometry.index_map == target.geometry.index_map is not None
        else:
            assert draft.geometry.item_rows == target.geometry.item_rows == W + K

    @pytest.mark.parametrize("mode", ["paged", "ring"])
    def test_no_draft_registers_target_only(self, mode):
        _, m = make_manifest(mode, draft=False, role="prefill")
        validate_manifest(CFG, m)
        assert all(c.ident.owner != "draft" for c in m.components)

    @pytest.mark.parametrize("mode", ["paged", "ring"])
    def test_full_attention_draft_layer_gets_a_draft_full_component(self, mode):
        cfg = make_cfg(mtp_layer_types=(F,))
        store, m = make_manifest(mode, cfg)
        validate_manifest(cfg, m)
        full = m.component("draft/FULL")
        assert full.ident.layer_ids == (4,)
        assert region_owner(store, full.regions[0].addr) == full.name
        assert all(c.ident.owner != "draft" or c.ident.kind == "FULL" for c in m.components)


class TestRefusals:
    def test_draft_layer_not_pure_swa(self):
        _, m = make_manifest("ring")
        with pytest.raises(ManifestError, match=r"draft/SWA_RING: draft layer 4 is full_attention, "
                                                r"not pure SWA"):
            validate_manifest(make_cfg(mtp_layer_types=(F,)), m)

    def test_draft_sliding_component_holding_a_target_layer(self):
        _, m = make_manifest("paged")
        with pytest.raises(ManifestError, match="draft/SWA holds layer 2, which is not a draft"):
            validate_manifest(CFG, edit(m, "draft/SWA", layer_ids=(2, 4)))

    @pytest.mark.parametrize("mode,other", [("ring", "SWA"), ("paged", "SWA_RING")])
    def test_draft_and_target_in_different_swa_modes(self, mode, other):
        _, m = make_manifest(mode)
        own = "SWA_RING" if mode == "ring" else "SWA"
        with pytest.raises(ManifestError, match="draft and target use different SWA modes"):
            validate_manifest(CFG, edit(m, f"draft/{own}", kind=other))

    @pytest.mark.parametrize("field,value", [("window", W + 1), ("item_rows", W + K + 1),
                                             ("num_items", 3)])
    def test_ring_geometry_differs(self, field, value):
        _, m = make_manifest("ring")
        with pytest.raises(ManifestError, match=rf"draft ring geometry differs .*{field}"):
            validate_manifest(CFG, edit(m, "draft/SWA_RING", **{field: value}))

    @pytest.mark.parametrize("change", [dict(index_map="full_to_swa@0xdead"), dict(num_items=1)])
    def test_paged_draft_not_sharing_the_mapping(self, change):
        _, m = make_manifest("paged")
        with pytest.raises(ManifestError, match="does not share the target's full->SWA mapping"):
            validate_manifest(CFG, edit(m, "draft/SWA", **change))

    def test_draft_full_must_share_page_tables(self):
        cfg = make_cfg(mtp_layer_types=(F,))
        _, m = make_manifest("ring", cfg)
        with pytest.raises(ManifestError, match="share the target's page tables"):
            validate_manifest(cfg, edit(m, "draft/FULL", num_items=15))

    def test_layers_must_match_the_routing(self):
        _, m = make_manifest("ring")
        with pytest.raises(ManifestError, match=r"target/SWA_RING holds layers \[0, 1\] but the "
                                                r"config routes layers \[0, 1, 3\]"):
            validate_manifest(CFG, edit(m, "target/SWA_RING", layer_ids=(0, 1)))
        with pytest.raises(ManifestError, match="target/FULL holds layers"):
            validate_manifest(make_cfg((S, F, F, S)), m)

    def test_missing_and_duplicate_components(self):
        _, m = make_manifest("ring")
        without_full = replace(m, components=m.components[1:])
        with pytest.raises(ManifestError, match="target/FULL is missing"):
            validate_manifest(CFG, without_full)
        with pytest.raises(ManifestError, match="aux/AUX is missing"):
            validate_manifest(CFG, replace(m, components=m.components[:-1]))
        with pytest.raises(ManifestError, match="aux/AUX is registered twice"):
            validate_manifest(CFG, replace(m, components=m.components + m.components[-1:]))

    @pytest.mark.parametrize("name,change,what", [
        ("target/FULL", dict(item_bytes=12), "item_bytes=12"),
        ("target/FULL", dict(head_dim=4), "head_dim=4"),
        ("target/FULL", dict(dtype="bfloat16"), "row_bytes"),
        ("target/SWA_RING", dict(window=4), "window=4"),
        ("aux/AUX", dict(item_rows=2), "item_rows=2"),
        ("target/SWA_RING", dict(order="layer_major"), "order=layer_major"),
        ("target/SWA_RING", dict(layers_per_item=1), "layers_per_item=1"),
    ])
    def test_wrong_geometry_names_the_component(self, name, change, what):
        _, m = make_manifest("ring", draft=False)
        with pytest.raises(ManifestError, match=rf"{name} has a wrong geometry: .*{what}"):
            validate_manifest(CFG, edit(m, name, **change))

    def test_ring_shorter_than_window(self):
        _, m = make_manifest("ring")
        m = edit(edit(m, "target/SWA_RING", item_rows=W - 1, item_bytes=3 * (W - 1) * 16),
                 "draft/SWA_RING", item_rows=W - 1, item_bytes=(W - 1) * 16)
        with pytest.raises(ManifestError, match="shorter than the window"):
            validate_manifest(CFG, m)

    def test_regions_must_cover_the_geometry(self):
        _, m = make_manifest("ring")
        comp = m.component("target/FULL")
        bad = replace(comp, regions=(replace(comp.regions[0], nbytes=8),))
        m = replace(m, components=(bad,) + m.components[1:])
        with pytest.raises(ManifestError, match="region 0 is 8 bytes"):
            validate_manifest(CFG, m)

    def test_one_region_per_layer_is_refused(self):
        """The per-layer layout (a region per layer) is not a manifest Baton serves."""
        _, m = make_manifest("ring")
        comp = m.component("target/SWA_RING")
        per_layer = replace(comp, regions=comp.regions * 3)
        m = replace(m, components=tuple(per_layer if c.name == comp.name else c for c in m.components))
        with pytest.raises(ManifestError, match=r"target/SWA_RING has a wrong geometry: 3 regions "
                                                r"\(expected one for the whole component\)"):
            validate_manifest(CFG, m)

    def test_mode_and_role(self):
        _, m = make_manifest("ring")
        with pytest.raises(ManifestError, match="mode"):
            validate_manifest(CFG, replace(m, mode="unified"))
        with pytest.raises(ManifestError, match="role"):
            validate_manifest(CFG, replace(m, role="router"))
        with pytest.raises(ManifestError, match="not a pool of this model in paged mode"):
            validate_manifest(CFG, replace(m, mode="paged"))


def registration(manifest) -> WorkerRegistration:
    return WorkerRegistration(worker_id="decode-0", instance_id="i", role="decode", manifest=manifest,
                              nixl_metadata=b"agent", capacity=Capacity(total_pages=16, page_size=PS,
                                                                        total_slots=2, max_seq_len=64))


def refused(plain: dict) -> str:
    with pytest.raises(BatonError) as caught:
        decode(msgpack.packb(plain), WorkerRegistration)
    return caught.value.message


@pytest.mark.parametrize("mode", ["ring", "paged"])
def test_manifest_survives_the_protocol(mode):
    _, m = make_manifest(mode)
    raw = encode(registration(m))
    assert isinstance(msgpack.unpackb(raw)["manifest"], dict)  # plain maps on the wire
    assert decode(raw, WorkerRegistration).manifest == m
    validate_manifest(CFG, decode(raw, WorkerRegistration).manifest)


def test_manifest_fields_are_type_checked():
    _, m = make_manifest("ring")
    plain = msgpack.unpackb(encode(registration(m)))
    plain["manifest"]["components"][0]["geometry"]["item_rows"] = "4"
    assert "'manifest.components[0].geometry.item_rows': expected int, got str" in refused(plain)
    plain = msgpack.unpackb(encode(registration(m)))
    plain["manifest"]["components"][0]["regions"][0]["extra"] = 1
    assert "unknown field 'manifest.components[0].regions[0].extra'" in refused(plain)
    plain = msgpack.unpackb(encode(registration(m)))
    del plain["manifest"]["worker_id"]
    assert "missing field 'manifest.worker_id'" in refused(plain)
    plain["manifest"] = [1, 2]
    assert "'manifest': expected a map, got list" in refused(plain)


def test_fingerprint_covers_config_and_weights():
    cfg = CFG.to_hf_dict()
    weights = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    fp = fingerprint(cfg, weights)
    assert fp.startswith("sha256:") and fp == fingerprint(dict(reversed(cfg.items())), weights)
    assert fp != fingerprint({**cfg, "sliding_window": W + 1}, weights)
    assert fp != fingerprint(cfg, {**weights, "a": torch.arange(6.0).view(3, 2)})
    assert fp != fingerprint(cfg, {**weights, "b": torch.zeros(2, dtype=torch.bfloat16)})
    assert fingerprint(cfg, b"file") != fingerprint(cfg, b"filf")
