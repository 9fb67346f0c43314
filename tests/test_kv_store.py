"""KVStore: allocation, extension by verify tokens, rollback, free, addressing, aux rows."""
import pytest
import torch

from baton.shared.kv import (KVError, KVStore, OutOfCapacity, pack_aux, unpack_aux)
from baton.shared.kv.aux import first_token_at
from baton.shared.model.config import FULL as F, SLIDING as S, ModelConfig

pytestmark = pytest.mark.unit
W, PS, K = 8, 4, 3  # window, page size, max draft tokens; ring rows R = W + K = 11


def make_cfg(layer_types=(S, F, S), mtp_layer_types=(S,)) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=6, intermediate_size=8, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=2, num_hidden_layers=len(layer_types),
                       layer_types=tuple(layer_types), sliding_window=W,
                       num_nextn_predict_layers=len(mtp_layer_types),
                       mtp_layer_types=tuple(mtp_layer_types))


def make_store(mode, cfg=None, num_pages=40, num_slots=3, **kw) -> KVStore:
    return KVStore(cfg or make_cfg(), mode=mode, num_pages=num_pages, page_size=PS,
                   num_slots=num_slots, max_draft_tokens=K, **kw)


@pytest.fixture(params=["ring", "paged"])
def mode(request):
    return request.param


def write(store, rid, layer, positions, values):
    rows = store.rows(rid, layer, torch.tensor(positions))
    k, v = store.kv_buffer(layer)  # [total_rows, kv_heads, head_dim] each
    k[rows] = torch.tensor(values, dtype=torch.float32)[:, None, None]
    v[rows] = -torch.tensor(values, dtype=torch.float32)[:, None, None]


def read(store, rid, layer, positions):
    rows = store.rows(rid, layer, torch.tensor(positions))
    k, v = store.kv_buffer(layer)
    assert torch.equal(k[rows], -v[rows])
    return k[rows][:, 0, 0].tolist()


def test_allocate_extend_free_returns_capacity(mode):
    store = make_store(mode)
    full = store.free_capacity()
    alloc = store.allocate("a", 30)
    assert len(alloc.page_ids) == 8 and alloc.length == 0
    store.extend("a", 20)
    store.extend("a", 24)
    store.check_integrity()
    assert store.length("a") == 24
    store.free("a")
    store.check_integrity()
    assert store.free_capacity() == full


def test_full_rows_follow_the_page_table(mode):
    store = make_store(mode)
    store.allocate("x", 5)
    alloc = store.allocate("a", 30)
    store.extend("a", 30)
    rows = store.rows("a", 1, torch.arange(30))
    expected = [alloc.page_ids[p // PS] * PS + p % PS for p in range(30)]
    assert rows.tolist() == expected
    store.check_integrity()


def test_ring_rows_are_position_mod_ring_size():
    store = make_store("ring")
    store.allocate("x", 5)
    alloc = store.allocate("a", 40)
    store.extend("a", 37)
    R = W + K
    stride = store.item_stride(store.routing.key_of(0))  # a slot holds layers 0 and 2: 2 * R rows
    assert stride == 2 * R
    assert store.first_resident("a", 0) == 37 - R
    rows = store.rows("a", 0, torch.arange(37 - R, 37))
    assert rows.tolist() == [alloc.slot * stride + p % R for p in range(37 - R, 37)]
    assert sorted(rows.tolist()) == list(range(alloc.slot * stride, alloc.slot * stride + R))
    with pytest.raises(KVError, match="positions must lie in"):
        store.rows("a", 0, torch.tensor([37 - R - 1]))
    store.check_integrity()


def test_paged_swa_releases_pages_that_leave_the_window():
    store = make_store("paged")
    store.allocate("a", 64)
    free0 = store.swa.pool.num_free
    for n in range(1, 64):
        store.extend("a", n)
        store.check_integrity()
        alloc = store.allocation("a")
        mapped = [i for i, s in enumerate(alloc.swa_page_ids) if s >= 0]
        first = max(0, n - (W + K)) // PS
        assert mapped == list(range(first, -(-n // PS)))  # exactly the pages of the window
    assert store.swa.pool.num_free == free0  # mapping never takes beyond the reservation
    # the full->SWA mapping is the one addressing table of target and draft sliding layers
    pos = torch.arange(60, 63)
    target, draft = (store.item_stride(store.routing.key_of(layer)) for layer in (0, 3))
    assert torch.equal(store.rows("a", 0, pos) // target, store.rows("a", 3, pos) // draft)  # pages
    assert torch.equal(store.rows("a", 0, pos) % target, store.rows("a", 3, pos) % draft)
    store.free("a")
    store.check_integrity()


def test_verify_step_extend_and_rollback_keep_the_window(mode):
    """Write k+1 verify tokens, reject some, rewrite: every query window reads the right keys."""
    store = make_store(mode)
    store.allocate("a", 60)
    store.extend("a", 20)  # prefill chunk larger than k+1: write only resident positions
    start = store.first_resident("a", 0)
    truth = list(range(20))  # value of position p (latest accepted write)
    for layer in (0, 1, 2, 3):
        lo = 0 if layer == 1 else start
        write(store, "a", layer, list(range(lo, 20)), truth[lo:])
    for step, accepted in enumerate([0, 3, 1, 2, 0, 3, 3, 1]):
        n = store.length("a")
        store.extend("a", n + K + 1)
        drafts = [1000 * (step + 1) + i for i in range(K + 1)]
        for layer in (0, 1, 2, 3):
            write(store, "a", layer, list(range(n, n + K + 1)), drafts)
        store.rollback("a", n + accepted + 1)
        truth = truth[:n] + drafts[:accepted + 1]
        store.check_integrity()
        m = store.length("a")
        window = list(range(max(0, m - W + 1), m))
        for layer in (0, 2, 3):
            assert read(store, "a", layer, window) == truth[window[0]:]
        assert read(store, "a", 1, list(range(m))) == truth


def test_rollback_past_the_stored_window_is_refused(mode):
    store = make_store(mode)
    store.allocate("a", 60)
    store.extend("a", 40)
    with pytest.raises(KVError, match="no longer stored"):
        store.rollback("a", 30)
    store.rollback("a", 0)  # nothing is needed at length 0: a restart is fine
    store.extend("a", 4)
    store.check_integrity()


def test_full_only_model_rolls_back_anywhere(mode):
    store = make_store(mode, cfg=make_cfg((F, F), ()))
    store.allocate("a", 60)
    store.extend("a", 50)
    store.rollback("a", 3)
    store.check_integrity()


def test_bad_lengths_are_refused(mode):
    store = make_store(mode)
    store.allocate("a", 10)
    with pytest.raises(KVError, match="reserved 10"):
        store.extend("a", 11)
    store.extend("a", 6)
    with pytest.raises(KVError, match="cannot extend"):
        store.extend("a", 5)
    with pytest.raises(KVError, match="cannot roll back"):
        store.rollback("a", 7)
    with pytest.raises(KVError, match="already allocated"):
        store.allocate("a", 4)
    with pytest.raises(KVError, match="positive"):
        store.allocate("b", 0)
    with pytest.raises(KVError, match="not allocated"):
        store.free("zzz")
    with pytest.raises(KVError, match="positions must lie in"):
        store.rows("a", 1, torch.tensor([6]))
    store.check_integrity()


@pytest.mark.parametrize("short", ["pages", "slots", "swa"])
def test_out_of_capacity_is_all_or_nothing(short):
    kw = dict(num_pages=40, num_slots=3)
    if short == "pages":
        kw["num_pages"] = 10
    if short == "slots":
        kw["num_slots"] = 1
    if short == "swa":
        kw["num_swa_pages"] = 5  # one request's reservation is 4 SWA pages
    store = make_store("paged", **kw)
    store.allocate("a", 24)
    before = store.free_capacity()
    with pytest.raises(OutOfCapacity, match="cannot allocate request 'b'"):
        store.allocate("b", 24)
    assert store.free_capacity() == before
    store.check_integrity()
    store.free("a")
    store.allocate("b", 24)
    store.check_integrity()


def test_draft_disabled_registers_no_draft_storage(mode):
    store = make_store(mode, draft_enabled=False)
    assert all(key.owner == "target" for key in store.data)
    store.allocate("a", 8)
    store.extend("a", 8)
    with pytest.raises(KVError, match="draft is disabled"):
        store.rows("a", 3, torch.tensor([7]))
    with pytest.raises(KVError, match="no such layer"):
        store.kv_buffer(9)
    store.check_integrity()


def test_full_attention_draft_shares_the_target_page_table(mode):
    store = make_store(mode, cfg=make_cfg((S, F, S), (F,)))
    store.allocate("a", 20)
    store.extend("a", 20)
    pos = torch.arange(20)
    sliding = store.routing.by_layer[0].kind
    assert [k.name for k in store.data] == ["target/FULL", f"target/{sliding}", "draft/FULL"]
    assert torch.equal(store.rows("a", 3, pos), store.rows("a", 1, pos))
    assert store.kv_buffer(3)[0].data_ptr() != store.kv_buffer(1)[0].data_ptr()
    write(store, "a", 3, list(range(20)), list(range(100, 120)))
    write(store, "a", 1, list(range(20)), list(range(20)))
    assert read(store, "a", 3, list(range(20))) == list(range(100, 120))
    store.check_integrity()


def test_kv_buffer_views_share_storage_with_the_component(mode):
    """Item-major: a layer's rows are a view of the component; row i * item_stride + o is
    offset o of item i in that layer, and writing it touches no other layer."""
    store = make_store(mode)
    k, v = store.kv_buffer(2)
    key, index = store._layer[2]
    data = store.data[key]  # [items, layers, item_rows, 2, kv_heads, head_dim]
    assert index == 1 and data.shape[1] == 2
    item, offset = 1, 2
    k[item * store.item_stride(key) + offset] = 7.0
    v[item * store.item_stride(key) + offset] = -7.0
    assert data[item, index, offset, 0].eq(7.0).all() and data[item, index, offset, 1].eq(-7.0).all()
    assert data.abs().sum() == 7.0 * 2 * data[0, 0, 0, 0].numel()  # nothing else was written
    assert k.data_ptr() == data[0, index].data_ptr()  # a view, no copy
    store.check_integrity()


def test_aux_row_round_trip():
    store = make_store("ring")
    store.allocate("a", 10)
    hidden = torch.randn(5, 6)  # [n, hidden_size] oldest first
    tag = 2**64 - 3  # a u64 tag above the i64 range survives
    pack_aux(store.aux_row("a"), store.aux_layout, tag, 42, hidden)
    rec = unpack_aux(store.aux_row("a"), store.aux_layout)
    assert (rec.tag, rec.first_token) == (tag, 42)
    assert first_token_at(store.aux_row("a").data_ptr()) == 42  # what decode streams before unpacking
    assert torch.equal(rec.hidden, hidden)
    newest = unpack_aux(store.aux_row("a"), store.aux_layout, max_rows=2)
    assert torch.equal(newest.hidden, hidden[-2:])  # a prefix of the row holds the newest rows
    with pytest.raises(ValueError, match="does not fit"):
        pack_aux(store.aux_row("a"), store.aux_layout, 1, 1, torch.zeros(W + 1, 6))
    store.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_store_on_cuda_registers_vram(mode):
    store = make_store(mode, device="cuda")
    store.allocate("a", 30)
    store.extend("a", 20)
    write(store, "a", 0, list(range(20 - W, 20)), list(range(W)))  # CPU positions are moved
    assert read(store, "a", 0, list(range(20 - W, 20))) == list(range(W))
    store.rollback("a", 18)
    pack_aux(store.aux_row("a"), store.aux_layout, 5, 6, torch.ones(2, 6))
    assert unpack_aux(store.aux_row("a"), store.aux_layout).first_token == 6
    kinds = {c.name: (c.mem_kind, c.device_id) for c in store.manifest("w", "fp").components}
    assert kinds.pop("aux/AUX") == ("DRAM", 0) and store.aux.is_pinned()  # host rows on every device
    assert set(kinds.values()) == {("VRAM", torch.cuda.current_device())}
    store.free("a")
    store.check_integrity()
