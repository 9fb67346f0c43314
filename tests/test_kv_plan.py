"""Transfer plans (seed 003): pairing by identity, refusals, and the exact bytes a request moves."""
import random

import pytest
import torch
from msgspec.structs import replace

from baton.proto.codec import decode, encode
from baton.proto.internal import PlanReply, ReserveReply
from baton.shared.kv import Allocation, KVStore, PlanError, make_plan, pack_aux, unpack_aux
from baton.shared.kv.budget import kv_row_bytes
from baton.shared.model.config import FULL as F, SLIDING as S, ModelConfig

pytestmark = pytest.mark.unit
W, PS, K = 8, 4, 3


def make_cfg(layer_types=(S, S, F, S), mtp_layer_types=(S,), window=W) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=6, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, num_hidden_layers=len(layer_types),
                       layer_types=tuple(layer_types), sliding_window=window,
                       num_nextn_predict_layers=len(mtp_layer_types),
                       mtp_layer_types=tuple(mtp_layer_types))


CFG = make_cfg()


def worker(role, mode="ring", cfg=CFG, draft=True, num_pages=80, num_slots=3, **kw):
    kw = {"page_size": PS, "max_draft_tokens": K, **kw}
    store = KVStore(cfg, mode=mode, num_pages=num_pages, num_slots=num_slots, draft_enabled=draft, **kw)
    return store, store.manifest(f"{role}-1", "sha256:m", role=role)


def names(plan):
    return [p.src.name for p in plan.pairs]


def expand(descs, item_bytes):
    """{(component, src_item, dst_item)} covered by KV descriptors (checks item alignment)."""
    out = set()
    for d in descs:
        ib = item_bytes[d.component_key]
        assert d.layer_index == 0 and d.src_offset % ib == d.dst_offset % ib == d.nbytes % ib == 0
        out |= {(d.component_key, d.src_offset // ib + i, d.dst_offset // ib + i) for i in range(d.nbytes // ib)}
    return out


def runs(pairs):
    """How many runs of (src, dst) item pairs, sorted by src, step by one on both sides."""
    pairs = sorted(pairs)
    return sum(1 for i, (s, d) in enumerate(pairs) if i == 0 or (s - pairs[i - 1][0], d - pairs[i - 1][1]) != (1, 1))


def prepare(store, rid, length, num_tokens=None, skip=0):
    """Allocate (after `skip` filler pages) and extend one request; return its record."""
    if skip:
        store.allocate(f"{rid}-filler", skip * PS)
    store.allocate(rid, num_tokens or length + 8)
    store.extend(rid, length)
    store.check_integrity()
    return store.allocation(rid)


class TestPairing:
    @pytest.mark.parametrize("mode", ["ring", "paged"])
    def test_same_shape_pairs_everything(self, mode):
        _, p = worker("prefill", mode)
        _, d = worker("decode", mode)
        plan = make_plan(p, d)
        assert names(plan) == [c.name for c in p.components]
        assert all(pair.src.name == pair.dst.name for pair in plan.pairs)
        assert plan.not_provided == () and plan.draft_state == "transfer"

    def test_swapped_component_order_pairs_by_identity(self):
        src_store, p = worker("prefill")
        dst_store, d = worker("decode")
        shuffled = replace(p, components=tuple(reversed(p.components)))
        rotated = replace(d, components=d.components[2:] + d.components[:2])
        plan, swapped = make_plan(p, d), make_plan(shuffled, rotated)
        for pair in swapped.pairs:
            assert pair.src == p.component(pair.src.name) and pair.dst == d.component(pair.src.name)
        a, b = prepare(src_store, "r", 30), prepare(dst_store, "r", 30, skip=2)
        assert sorted(swapped.descriptors(30, a, b), key=str) == sorted(plan.descriptors(30, a, b),
                                                                        key=str)

    @pytest.mark.parametrize("mode", ["ring", "paged"])
    def test_extra_decode_components_are_not_provided(self, mode):
        """Decode-only speculative decoding: prefill runs no draft layer."""
        _, p = worker("prefill", mode, draft=False)
        _, d = worker("decode", mode)
        plan = make_plan(p, d)
        kind = "SWA_RING" if mode == "ring" else "SWA"
        assert plan.not_provided == (f"draft/{kind}",)
        assert f"draft/{kind}" not in names(plan)
        assert plan.draft_state == "rebuild"
        assert [plan.aux_hidden_rows(n) for n in (1, 5, W, 100)] == [1, 5, W, W]

    def test_full_attention_draft_without_its_state_starts_cold(self):
        cfg = make_cfg(mtp_layer_types=(F,))
        _, p = worker("prefill", cfg=cfg, draft=False)
        _, d = worker("decode", cfg=cfg)
        plan = make_plan(p, d)
        assert plan.not_provided == ("draft/FULL",) and plan.draft_state == "cold"
        assert plan.aux_hidden_rows(100) == 1

    def test_no_draft_on_either_side(self):
        _, p = worker("prefill", draft=False)
        _, d = worker("decode", draft=False)
        plan = make_plan(p, d)
        assert plan.draft_state == "none" and plan.aux_hidden_rows(50) == 0

    def test_draft_state_travels_with_both_draft_layers(self):
        cfg = make_cfg(mtp_layer_types=(S, F))
        _, p = worker("prefill", cfg=cfg)
        _, d = worker("decode", cfg=cfg)
        plan = make_plan(p, d)
        assert {"draft/FULL", "draft/SWA_RING"} <= set(names(plan))
        assert plan.draft_state == "transfer" and plan.aux_hidden_rows(50) == 1

    def test_plan_and_allocation_survive_the_protocol(self):
        _, p = worker("prefill", "paged", draft=False)
        _, d = worker("decode", "paged")
        plan = make_plan(p, d)
        sent = PlanReply(prefill_worker_id="p", decode_worker_id="d", plan=plan)
        assert decode(encode(sent), PlanReply).plan == plan
        alloc = Allocation("r", 10, 5, 0, 1, (3, 4, 5), (0, 1, -1))
        sent = ReserveReply(request_id="r", decode_worker_id="d", allocation=alloc)
        assert decode(encode(sent), ReserveReply).allocation == alloc


class TestPlanRefusals:
    def test_prefill_component_without_decode_counterpart(self):
        _, p = worker("prefill")
        _, d = worker("decode", draft=False)
        with pytest.raises(PlanError, match=r"prefill component draft/SWA_RING has no decode "
                                            r"counterpart \(decode runs no draft layer\)"):
            make_plan(p, d)

    def test_different_sliding_modes(self):
        _, p = worker("prefill", "ring")
        _, d = worker("decode", "paged")
        with pytest.raises(PlanError, match=r"target/SWA_RING has no decode counterpart \(decode "
                                            r"registers target/SWA: .*different sliding-window"):
            make_plan(p, d)

    def test_different_model_fingerprint(self):
        _, p = worker("prefill")
        _, d = worker("decode")
        with pytest.raises(PlanError, match="model fingerprint differs"):
            make_plan(p, replace(d, fingerprint="sha256:other"))

    @pytest.mark.parametrize("mode,change,component,what", [
        ("ring", dict(max_draft_tokens=K + 1), "target/SWA_RING", "item_bytes 528 != 576"),
        ("paged", dict(page_size=8), "target/FULL", "item_bytes 64 != 128"),
        ("ring", dict(dtype=torch.bfloat16), "target/FULL", "dtype float32 != bfloat16"),
    ])
    def test_mismatched_item_sizes(self, mode, change, component, what):
        _, p = worker("prefill", mode)
        _, d = worker("decode", mode, **change)
        with pytest.raises(PlanError, match=rf"component {component}: prefill and decode "
                                            rf"geometry differ .*{what}"):
            make_plan(p, d)

    @pytest.mark.parametrize("change,what", [
        (dict(order="layer_major"), "order item_major != layer_major"),
        (dict(layers_per_item=1), "layers_per_item 3 != 1"),
    ])
    def test_a_peer_with_another_layout_is_refused_by_name(self, change, what):
        """Seed 003: the layout is geometry; a peer storing items another way is never paired."""
        _, p = worker("prefill")
        _, d = worker("decode")
        comp = d.component("target/SWA_RING")
        other = replace(comp, geometry=replace(comp.geometry, **change))
        d = replace(d, components=tuple(other if c is comp else c for c in d.components))
        with pytest.raises(PlanError, match=rf"component target/SWA_RING: prefill and decode "
                                            rf"geometry differ .*{what}"):
            make_plan(p, d)

    def test_different_layer_ids(self):
        _, p = worker("prefill")
        _, d = worker("decode")
        comp = d.component("target/SWA_RING")
        bad = replace(comp, ident=replace(comp.ident, layer_ids=(0, 1)))
        d = replace(d, components=tuple(bad if c.name == comp.name else c for c in d.components))
        with pytest.raises(PlanError, match=r"target/SWA_RING: prefill holds layers \[0, 1, 3\]"):
            make_plan(p, d)

    @pytest.mark.parametrize("missing", ["target/FULL", "aux/AUX"])
    def test_decode_needs_every_non_draft_component(self, missing):
        _, p = worker("prefill")
        _, d = worker("decode")
        p = replace(p, components=tuple(c for c in p.components if c.name != missing))
        with pytest.raises(PlanError, match=rf"decode component {missing} is not provided"):
            make_plan(p, d)

    def test_partial_draft_state_is_refused(self):
        cfg = make_cfg(mtp_layer_types=(S, F))
        _, p = worker("prefill", cfg=cfg)
        _, d = worker("decode", cfg=cfg)
        p = replace(p, components=tuple(c for c in p.components if c.name != "draft/FULL"))
        with pytest.raises(PlanError, match="only part of the draft state.*not supported"):
            make_plan(p, d)

    @pytest.mark.parametrize("side", ["prefill", "decode"])
    def test_mixed_memory_kinds_with_decode_only_speculation(self, side):
        _, p = worker("prefill", draft=False)
        _, d = worker("decode")
        mixed = lambda m: replace(m, components=(replace(m.components[0], mem_kind="VRAM"),)
                                  + m.components[1:])
        make_plan(mixed(p), mixed(worker("decode", draft=False)[1]))  # mixed kinds alone are fine
        pair = (mixed(p), d) if side == "prefill" else (p, mixed(d))
        with pytest.raises(PlanError, match=rf"not supported: {side} .* mixes memory kinds "
                                            r"\['DRAM', 'VRAM'\] together with decode-only"):
            make_plan(*pair)

    def test_kv_in_device_memory_with_host_aux_rows_pairs_in_every_draft_mode(self):
        """A GPU worker's manifest: KV components VRAM on its device, the aux rows DRAM (kv/store.py)."""
        on_gpu = lambda m: replace(m, components=tuple(c if c.ident.kind == "AUX" else
                                                       replace(c, mem_kind="VRAM", device_id=1)
                                                       for c in m.components))
        for draft in (True, False):  # transfer, and decode-only speculation (rebuild)
            plan = make_plan(on_gpu(worker("prefill", draft=draft)[1]), on_gpu(worker("decode")[1]))
            assert plan.draft_state == ("transfer" if draft else "rebuild")

    @pytest.mark.parametrize("side", ["prefill", "decode"])
    def test_host_memory_on_one_side_and_device_memory_on_the_other_is_refused_by_name(self, side):
        _, p = worker("prefill")
        _, d = worker("decode")
        gpu = lambda m: replace(m, components=tuple(replace(c, mem_kind="VRAM") for c in m.components))
        p, d = (gpu(p), d) if side == "prefill" else (p, gpu(d))
        first = p.components[0].name
        kinds = ("VRAM", "DRAM") if side == "prefill" else ("DRAM", "VRAM")
        with pytest.raises(PlanError, match=rf"component {first}: prefill holds it in {kinds[0]}, decode in "
                                            rf"{kinds[1]}; a transfer between host and device memory is not supported"):
            make_plan(p, d)

    def test_roles_and_duplicates(self):
        _, p = worker("prefill")
        _, d = worker("decode")
        with pytest.raises(PlanError, match="expected a prefill and a decode manifest"):
            make_plan(d, p)
        with pytest.raises(PlanError, match="registers aux/AUX twice"):
            make_plan(p, replace(d, components=d.components + d.components[-1:]))


class TestDescriptors:
    @pytest.mark.parametrize("mode", ["ring", "paged"])
    @pytest.mark.parametrize("length", [1, 2, W - 1, W, W + 1, 23, 30, 61])
    def test_descriptors_cover_the_items_of_exactly_the_needed_rows(self, mode, length):
        """Item-major: a descriptor moves whole items (every layer); the items moved are exactly
        those holding a needed row, one descriptor per run of them adjacent on both sides."""
        src_store, p = worker("prefill", mode)
        dst_store, d = worker("decode", mode)
        a, b = prepare(src_store, "r", length, skip=1), prepare(dst_store, "r", length, skip=3)
        plan = make_plan(p, d)
        descs = plan.descriptors(length, a, b)
        item_bytes = {c.name: c.geometry.item_bytes for c in p.components}
        expected, sliding = set(), p.components[1].ident.kind
        for name, layers in (("target/FULL", [2]), (f"target/{sliding}", [0, 1, 3]),
                             (f"draft/{sliding}", [4])):
            for layer in layers:
                start = 0 if name.endswith("FULL") else max(0, length - W + 1)
                pos = torch.arange(start, length)
                key = src_store.routing.key_of(layer)
                src = src_store.rows("r", layer, pos) // src_store.item_stride(key)
                dst = dst_store.rows("r", layer, pos) // dst_store.item_stride(key)
                expected |= {(name, s, t) for s, t in zip(src.tolist(), dst.tolist())}
        kv = [x for x in descs if x.component_key != "aux/AUX"]
        assert expand(kv, item_bytes) == expected
        for name in item_bytes:
            if name != "aux/AUX":
                pairs = {(s, t) for n, s, t in expected if n == name}
                assert len([x for x in kv if x.component_key == name]) == runs(pairs)
        aux = [x for x in descs if x.component_key == "aux/AUX"]
        assert len(aux) == 1 and aux[0].nbytes == 24 + 6 * 4  # header + h_{L-1}
        src_store.check_integrity()
        dst_store.check_integrity()

    def test_contiguous_pages_are_one_descriptor_for_every_layer_and_a_ring_slot_is_one(self):
        src_store, p = worker("prefill")
        dst_store, d = worker("decode")
        length = 37  # window 30..36 sits at ring rows 8, 9, 10, 0, 1, 2, 3 (R = 11): it wraps
        a, b = prepare(src_store, "r", length), prepare(dst_store, "r", length, skip=1)
        descs = make_plan(p, d).descriptors(length, a, b)

        def of(name, descs=descs):
            return [x for x in descs if x.component_key == name]

        full = p.component("target/FULL").geometry
        assert len(of("target/FULL")) == 1
        assert of("target/FULL")[0].nbytes == -(-length // PS) * full.item_bytes
        for name in ("target/SWA_RING", "draft/SWA_RING"):  # the whole slot, every layer
            ring = p.component(name).geometry
            assert [(x.src_offset, x.nbytes) for x in of(name)] == [(a.slot * ring.item_bytes, ring.item_bytes)]
        a, b = prepare(src_store, "q", 30), prepare(dst_store, "q", 30)  # window rows 1..7: no wrap
        assert len(of("target/SWA_RING", make_plan(p, d).descriptors(30, a, b))) == 1

    def test_runs_are_merged_across_pages_in_any_order(self):
        """Pages handed out in reverse still merge where both sides are contiguous."""
        src_store, p = worker("prefill")
        dst_store, d = worker("decode")
        a, b = prepare(src_store, "r", 16), prepare(dst_store, "r", 16)
        rev = lambda x, base: replace(x, page_ids=tuple(base + 3 - i for i in range(4)))
        descs = make_plan(p, d).descriptors(16, rev(a, 10), rev(b, 20))
        full = [x for x in descs if x.component_key == "target/FULL"]
        item = p.component("target/FULL").geometry.item_bytes
        assert len(full) == 1 and (full[0].src_offset, full[0].dst_offset) == (10 * item, 20 * item)

    @pytest.mark.parametrize("mode", ["ring", "paged"])
    def test_a_churned_pool_moves_one_descriptor_per_run_of_pages(self, mode):
        """After random requests came and went on both sides, a request's pages are scattered:
        the FULL (and paged SWA) descriptors are exactly the runs adjacent on both sides."""
        rng = random.Random(3)
        stores = [worker(role, mode, num_pages=160, num_slots=100) for role in ("prefill", "decode")]
        for store, _ in stores:  # fill with requests of 1..3 pages, then half of them leave
            live = []
            while store.free_capacity().pages >= 3 and store.free_capacity().slots > 1:
                live.append(f"f{len(live)}")
                store.allocate(live[-1], rng.randint(1, 3 * PS))
            for rid in rng.sample(live, len(live) // 2):
                store.free(rid)
        (src_store, p), (dst_store, d) = stores
        length = 90
        a, b = prepare(src_store, "r", length), prepare(dst_store, "r", length)
        plan, item_bytes = make_plan(p, d), {c.name: c.geometry.item_bytes for c in p.components}
        descs = plan.descriptors(length, a, b)
        full = [x for x in descs if x.component_key == "target/FULL"]
        pages = set(zip(a.page_ids[:-(-length // PS)], b.page_ids))
        assert runs(pages) == len(full) > 1  # scattered, yet not one per page
        assert expand(full, item_bytes) == {("target/FULL", s, t) for s, t in pages}
        if mode == "paged":
            window = [i for i, s in enumerate(a.swa_page_ids) if s >= 0 and i * PS + PS > length - W + 1]
            swa = {(a.swa_page_ids[i], b.swa_page_ids[i]) for i in window}
            assert len([x for x in descs if x.component_key == "target/SWA"]) == runs(swa)
        for store, _ in stores:
            store.check_integrity()

    @pytest.mark.parametrize("mode", ["ring", "paged"])
    def test_sliding_bytes_stay_constant_as_the_prompt_grows(self, mode):
        src_store, p = worker("prefill", mode, num_pages=200)
        dst_store, d = worker("decode", mode, num_pages=200)
        plan, row = make_plan(p, d), kv_row_bytes(CFG, torch.float32)
        moved = {}
        for length in (W, 4 * W, 16 * W):
            a = prepare(src_store, f"r{length}", length)
            b = prepare(dst_store, f"r{length}", length)
            descs = plan.descriptors(length, a, b)
            total = lambda pred: sum(x.nbytes for x in descs if pred(x.component_key))
            moved[length] = (total(lambda n: n.endswith("FULL")),
                             total(lambda n: "SWA" in n), total(lambda n: n == "aux/AUX"))
        # whole items: the ring slot (W + K rows), or the 2 SWA pages holding positions L-W+1..L-1
        sliding_rows = W + K if mode == "ring" else 2 * PS
        for length, (full, sliding, aux) in moved.items():
            assert full == length * row * 1  # one full layer: linear in L (L is whole pages here)
            assert sliding == sliding_rows * row * 4  # 3 target + 1 draft sliding layers: constant
            assert aux == moved[W][2]

    def test_decode_must_hold_the_positions(self):
        src_store, p = worker("prefill", "paged")
        dst_store, d = worker("decode", "paged")
        a = prepare(src_store, "r", 30)
        dst_store.allocate("r", 40)  # reserved but not extended to the prompt length
        with pytest.raises(PlanError, match=r"decode allocation of request 'r' holds positions "
                                            r"0\.\.-1 of target/FULL; the transfer needs 0\.\.29"):
            make_plan(p, d).descriptors(30, a, dst_store.allocation("r"))
        dst_store.check_integrity()

    def test_released_or_foreign_pages_are_refused(self):
        src_store, p = worker("prefill", "paged")
        dst_store, d = worker("decode", "paged")
        plan = make_plan(p, d)
        a, b = prepare(src_store, "r", 30), prepare(dst_store, "r", 30)
        released = replace(a, swa_page_ids=(-1,) * len(a.swa_page_ids))
        with pytest.raises(PlanError, match="prefill allocation .* target/SWA .* is released"):
            plan.descriptors(30, released, b)
        foreign = replace(b, page_ids=(10_000,) + b.page_ids[1:])
        with pytest.raises(PlanError, match="decode allocation .* points outside target/FULL"):
            plan.descriptors(30, a, foreign)
        src_store.check_integrity()


def region_bytes(store, name, layer_index):
    """The byte view of one region (what NIXL registers)."""
    if name == "aux/AUX":
        return store.aux[0].view(-1)
    assert layer_index == 0  # item-major: one region per component
    return {k.name: t for k, t in store.data.items()}[name].view(-1).view(torch.uint8)


@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("prefill_draft", [True, False])
def test_copying_the_descriptors_hands_decode_the_state_it_reads(mode, prefill_draft):
    """Play the transfer with byte copies: decode reads exactly what prefill wrote."""
    length, rng = 45, random.Random(0)
    src_store, p = worker("prefill", mode, draft=prefill_draft)
    dst_store, d = worker("decode", mode)
    plan = make_plan(p, d)
    a, b = prepare(src_store, "r", length, skip=2), prepare(dst_store, "r", length, skip=5)
    layers = [layer for layer in range(5) if prefill_draft or layer < 4]
    for layer in layers:  # prefill writes every position its storage keeps
        pos = torch.arange(src_store.first_resident("r", layer), length)
        k, v = src_store.kv_buffer(layer)
        k[src_store.rows("r", layer, pos)] = torch.rand(len(pos), 1, 2)
        v[src_store.rows("r", layer, pos)] = torch.rand(len(pos), 1, 2)
    hidden = torch.randn(min(length, W), 6)  # h_{L-W} .. h_{L-1}
    rows = plan.aux_hidden_rows(length)
    pack_aux(src_store.aux_row("r"), src_store.aux_layout, rng.getrandbits(64), 17, hidden[-rows:])
    for x in plan.descriptors(length, a, b):
        src = region_bytes(src_store, x.component_key, x.layer_index)
        dst = region_bytes(dst_store, x.component_key, x.layer_index)
        dst[x.dst_offset:x.dst_offset + x.nbytes] = src[x.src_offset:x.src_offset + x.nbytes]
    for layer in layers:
        start = 0 if CFG.attention_type(layer) == F else length - W + 1
        pos = torch.arange(start, length)
        for s_buf, d_buf in zip(src_store.kv_buffer(layer), dst_store.kv_buffer(layer)):
            assert torch.equal(d_buf[dst_store.rows("r", layer, pos)],
                               s_buf[src_store.rows("r", layer, pos)])
    got = unpack_aux(dst_store.aux_row("r"), dst_store.aux_layout, max_rows=rows)
    want = unpack_aux(src_store.aux_row("r"), src_store.aux_layout)
    assert (got.tag, got.first_token) == (want.tag, 17)
    assert torch.equal(got.hidden, hidden[-rows:])
    assert rows == (1 if prefill_draft else W)
    src_store.check_integrity()
    dst_store.check_integrity()
