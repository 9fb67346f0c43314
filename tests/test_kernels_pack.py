"""Pack/unpack of a request's rows (ring wrap-around, scattered pages) through a contiguous
staging buffer: Triton kernels against the torch references, bit for bit, on a real KVStore.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 set before the
kernel module is imported); with CUDA they run compiled.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from baton.kernels.pack import (pack_rows, pack_rows_reference, unpack_rows,  # noqa: E402
                                unpack_rows_reference)
from baton.kernels.pack_triton import pack_rows_triton, unpack_rows_triton  # noqa: E402
from baton.shared.kv.descriptors import needed_positions  # noqa: E402
from baton.shared.kv.routing import FULL as FULL_POOL  # noqa: E402
from baton.shared.kv.store import KVStore  # noqa: E402
from baton.shared.model.config import FULL, SLIDING, ModelConfig  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W, K, LENGTH = 6, 3, 29  # window, max draft tokens (ring rows W + K = 9), request length:
# the window 24..28 sits at ring rows 6, 7, 8, 0, 1
CFG = ModelConfig(vocab_size=31, hidden_size=16, intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                  layer_types=(SLIDING, FULL, SLIDING), sliding_window=W,
                  num_nextn_predict_layers=1, mtp_layer_types=(SLIDING,))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def make_store(mode: str, dtype: torch.dtype, skip: int, seed: int | None) -> KVStore:
    """A store whose request "r" holds LENGTH positions; `skip` earlier requests shift its slot
    and pages. seed: fill every byte with random bits (NaN patterns included), else zeros."""
    store = KVStore(CFG, mode=mode, num_pages=32, page_size=4, num_slots=4, max_draft_tokens=K,
                    dtype=dtype, device=DEVICE)
    for i in range(skip):
        store.allocate(f"other{i}", 3 + 5 * i)
    store.allocate("r", LENGTH + K + 1)
    for length in range(4, LENGTH + 1, 4):  # grow in steps, as decode does
        store.extend("r", length)
    store.extend("r", LENGTH)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in (*store.data.values(), store.aux):
            flat = bits(t).view(-1)
            info = torch.iinfo(flat.dtype)
            flat.copy_(torch.randint(info.min, info.max, flat.shape, dtype=flat.dtype, generator=gen))
    return store


def request_rows(store: KVStore, key) -> torch.Tensor:
    """Rows of the positions decode needs from this component (kv.descriptors), layer-independent."""
    window = None if key.kind == FULL_POOL else W
    positions = torch.from_numpy(needed_positions(key.kind, window, LENGTH))
    return store.rows("r", store.routing.layers_of(key)[0], positions)


def layer_views(store: KVStore, key) -> torch.Tensor:
    """Every layer of an item-major component as one strided [L, rows, E] view: [l] is
    store.kv_rows(layer l) flattened to rows, so store.rows() index it (no copy)."""
    items, L, item_rows = store.data[key].shape[:3]
    flat = store.data[key].view(items * L * item_rows, -1)  # [rows of every layer, E]
    E = flat.shape[1]
    return flat.as_strided((L, flat.shape[0] - (L - 1) * item_rows, E), (item_rows * E, E, 1))


def written(store: KVStore, key, rows: torch.Tensor) -> torch.Tensor:
    """[component rows] True at the rows `rows` name in any layer of the component."""
    items, L, item_rows = store.data[key].shape[:3]
    mask = torch.zeros(items * L * item_rows, dtype=torch.bool, device=DEVICE)
    for layer in range(L):
        mask[layer * item_rows + rows] = True
    return mask


@pytest.mark.parametrize("mode", ["ring", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_pack_then_unpack_every_component(mode, dtype):
    src, dst = make_store(mode, dtype, skip=0, seed=1), make_store(mode, dtype, skip=2, seed=None)
    wrapped = False
    for key in src.keys:
        rows_src, rows_dst = request_rows(src, key), request_rows(dst, key)
        wrapped |= bool((rows_src.diff() < 0).any())
        view_src, view_dst = layer_views(src, key), layer_views(dst, key)  # [L, rows, E], strided
        L = view_src.shape[0]
        staging = pack_rows_triton(view_src, rows_src, torch.empty(L, len(rows_src), view_src.shape[-1],
                                                                   dtype=dtype, device=DEVICE))
        assert torch.equal(bits(staging), bits(pack_rows_reference(view_src, rows_src))), key
        unpack_rows_triton(staging, view_dst, rows_dst)
        assert torch.equal(bits(view_dst[:, rows_dst]), bits(view_src[:, rows_src])), key
        untouched = ~written(dst, key, rows_dst)
        flat_dst = dst.data[key].view(untouched.numel(), -1)
        assert torch.all(bits(flat_dst[untouched]) == 0), f"{key}: rows outside the request changed"
    assert wrapped == (mode == "ring"), "the ring window must wrap around (ring mode only)"


def test_single_layer_view_and_aux_row():
    """[R, E] views: one layer of the draft ring, and the aux row (uint8) of the request's slot."""
    src, dst = make_store("ring", torch.float16, 0, seed=2), make_store("ring", torch.float16, 1, seed=None)
    layer = CFG.num_hidden_layers  # the MTP draft layer
    rows_src = src.rows("r", layer, torch.arange(LENGTH - W + 1, LENGTH))
    rows_dst = dst.rows("r", layer, torch.arange(LENGTH - W + 1, LENGTH))
    view_src = src.kv_rows(layer).view(len(src.kv_rows(layer)), -1)  # [R, E], as attention reads it
    view_dst = dst.kv_rows(layer).view(len(dst.kv_rows(layer)), -1)
    staging = pack_rows_triton(view_src, rows_src, torch.empty(len(rows_src), view_src.shape[1],
                                                               dtype=view_src.dtype, device=DEVICE))
    assert torch.equal(bits(staging), bits(view_src[rows_src]))
    unpack_rows_triton(staging, view_dst, rows_dst)
    assert torch.equal(bits(view_dst[rows_dst]), bits(view_src[rows_src]))
    aux_view = src.aux[0].to(DEVICE)  # [slots, item_bytes] uint8; the store keeps it in host memory on every device
    aux_rows = torch.tensor([src.allocation("r").slot], device=DEVICE)
    aux = pack_rows_triton(aux_view, aux_rows, torch.empty(1, src.aux.shape[2], dtype=torch.uint8, device=DEVICE))
    assert torch.equal(aux[0].cpu(), src.aux_row("r"))


def test_dispatch_and_validation(monkeypatch):
    view = torch.randn(20, 8, device=DEVICE)
    rows = torch.tensor([7, 19, 0, 3], device=DEVICE)
    monkeypatch.delenv("BATON_KERNELS", raising=False)
    assert torch.equal(pack_rows(view, rows), view[rows])
    monkeypatch.setenv("BATON_KERNELS", "triton")
    out = torch.empty(4, 8, device=DEVICE)
    assert pack_rows(view, rows, out=out) is out and torch.equal(out, view[rows])
    dst = torch.zeros_like(view)
    assert unpack_rows(out, dst, rows) is dst and torch.equal(dst[rows], view[rows])
    monkeypatch.setenv("BATON_KERNELS", "torch")
    dst.zero_()
    unpack_rows_reference(out, dst, rows)
    assert torch.equal(dst[rows], view[rows])
    with pytest.raises(ValueError, match="staging must be"):
        pack_rows(view, rows, out=torch.empty(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="must match the view"):
        unpack_rows(out.half(), dst, rows)
    with pytest.raises(ValueError, match="row view"):
        pack_rows(view[0], rows)
