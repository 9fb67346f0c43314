"""Layer routing from attention metadata (seed 002) and the memory budget that follows from it."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from baton.shared.kv import (DRAFT, FULL, SWA, SWA_RING, TARGET, KVStore, PoolKey,
                             full_bytes_per_token, plan_capacity, route_layers,
                             sliding_bytes_per_slot)
from baton.shared.kv.budget import kv_row_bytes, store_bytes
from baton.shared.model.config import FULL as F, SLIDING as S, ModelConfig

pytestmark = pytest.mark.unit
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "baton-tiny"


def make_cfg(layer_types, mtp_layer_types=(S,), window=64, **kw) -> ModelConfig:
    base = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64)
    base.update(kw)
    return ModelConfig(num_hidden_layers=len(layer_types), layer_types=tuple(layer_types),
                       sliding_window=window, num_nextn_predict_layers=len(mtp_layer_types),
                       mtp_layer_types=tuple(mtp_layer_types), **base)


# The design card's model (S S F S S F + one sliding MTP layer), a full-attention draft layer,
# and a different sliding/full pattern with two draft layers: one routing function for all.
CONFIGS = {
    "design_card": make_cfg((S, S, F, S, S, F)),
    "full_attention_draft": make_cfg((S, S, F, S, S, F), mtp_layer_types=(F,)),
    "other_pattern": make_cfg((F, S, S, S, F, F, S), mtp_layer_types=(S, F), window=16),
    "all_full_no_draft": make_cfg((F, F, F), mtp_layer_types=()),
}
EXPECTED = {  # (target FULL, target sliding, draft FULL, draft sliding) layer ids
    "design_card": ((2, 5), (0, 1, 3, 4), (), (6,)),
    "full_attention_draft": ((2, 5), (0, 1, 3, 4), (6,), ()),
    "other_pattern": ((0, 4, 5), (1, 2, 3, 6), (8,), (7,)),
    "all_full_no_draft": ((0, 1, 2), (), (), ()),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mode,sliding", [("ring", SWA_RING), ("paged", SWA)])
def test_routing_follows_metadata(name, mode, sliding):
    cfg, (tf, ts, df, ds) = CONFIGS[name], EXPECTED[name]
    routing = route_layers(cfg, mode)
    assert len(routing.by_layer) == cfg.num_hidden_layers + cfg.num_draft_layers
    assert routing.layers_of(PoolKey(TARGET, FULL)) == tf
    assert routing.layers_of(PoolKey(TARGET, sliding)) == ts
    assert routing.layers_of(PoolKey(DRAFT, FULL)) == df
    assert routing.layers_of(PoolKey(DRAFT, sliding)) == ds
    for layer_id in range(len(routing.by_layer)):
        key = routing.key_of(layer_id)
        assert key.owner == (TARGET if layer_id < cfg.num_hidden_layers else DRAFT)
        assert (key.kind == FULL) == (cfg.attention_type(layer_id) == F)
    targets = tuple(k for k in routing.keys() if k.owner == TARGET)
    assert routing.keys(draft_enabled=False) == targets


def test_routing_ignores_architecture_name():
    cfg = CONFIGS["design_card"]
    renamed = replace(cfg, architectures=("InklingForConditionalGenerationMTP",))
    assert route_layers(renamed) == route_layers(cfg)
    assert route_layers(renamed, "paged") == route_layers(cfg, "paged")


def test_shipped_checkpoint_routes_when_present():
    """`design_card` above has the shape scripts/train_model.py trains; this reads the real file."""
    if not (SHIPPED / "config.json").exists():
        pytest.skip("models/baton-tiny/config.json is not built yet")
    cfg = ModelConfig.load(SHIPPED)
    for mode in ("ring", "paged"):
        routing = route_layers(cfg, mode)
        for layer_id, key in enumerate(routing.by_layer):
            assert key.owner == (TARGET if layer_id < cfg.num_hidden_layers else DRAFT)
            assert (key.kind == FULL) == (cfg.attention_type(layer_id) == F)


def test_routing_refuses_unknown_mode_and_layer():
    with pytest.raises(ValueError, match="mode"):
        route_layers(CONFIGS["design_card"], "unified")
    with pytest.raises(KeyError, match="layer 7"):
        route_layers(CONFIGS["design_card"]).key_of(7)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_budget_counts_draft_layers_where_routed(name):
    cfg = CONFIGS[name]
    tf, ts, df, ds = EXPECTED[name]
    row = kv_row_bytes(cfg, torch.bfloat16)
    assert row == 2 * 2 * 64 * 2
    assert full_bytes_per_token(cfg, torch.bfloat16) == (len(tf) + len(df)) * row
    assert full_bytes_per_token(cfg, torch.bfloat16, draft_enabled=False) == len(tf) * row
    ring_rows = cfg.sliding_window + 3
    assert sliding_bytes_per_slot(cfg, "ring", 16, 3, torch.bfloat16) == \
        (len(ts) + len(ds)) * ring_rows * row
    assert sliding_bytes_per_slot(cfg, "ring", 16, 3, torch.bfloat16, draft_enabled=False) == \
        len(ts) * ring_rows * row


def test_paged_swa_budget_covers_the_window_in_pages():
    cfg = CONFIGS["design_card"]  # W = 64; span 67 positions touch at most 6 pages of 16
    row = kv_row_bytes(cfg, torch.float32)
    assert sliding_bytes_per_slot(cfg, "paged", 16, 3, torch.float32) == 5 * 6 * 16 * row


@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("name", ["design_card", "full_attention_draft", "other_pattern"])
def test_plan_capacity_matches_the_store_it_sizes(mode, name):
    cfg = make_cfg(CONFIGS[name].layer_types, CONFIGS[name].mtp_layer_types, window=8,
                   hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    budget = 400_000
    cap = plan_capacity(cfg, budget, mode=mode, page_size=4, max_draft_tokens=3,
                        tokens_per_request=50)
    assert 0 < cap.nbytes <= budget
    store = KVStore(cfg, mode=mode, num_pages=cap.num_pages, page_size=4,
                    num_slots=cap.num_slots, max_draft_tokens=3,
                    num_swa_pages=cap.num_swa_pages or None)
    assert store.nbytes() == cap.nbytes
    for i in range(cap.num_slots):  # exactly num_slots requests of 50 tokens fit
        store.allocate(f"r{i}", 50)
        store.extend(f"r{i}", 50)
    store.check_integrity()
    assert store.free_capacity().slots == 0
    bigger = store_bytes(cfg, mode=mode, num_pages=cap.num_pages + 13, page_size=4,
                         num_slots=cap.num_slots + 1, num_swa_pages=cap.num_swa_pages + 4,
                         dtype=torch.float32, draft_enabled=True, max_draft_tokens=3)
    assert bigger > budget  # one more request would not fit


def test_plan_capacity_refuses_a_budget_below_one_request():
    with pytest.raises(ValueError, match="does not hold one request"):
        plan_capacity(CONFIGS["design_card"], 1000, page_size=16, max_draft_tokens=3,
                      tokens_per_request=512)
