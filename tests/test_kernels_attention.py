"""Triton `chunk_attention` against the torch reference: verify/decode/prefill chunks over paged
full attention, paged SWA and rings (target and MTP draft), GQA, window edges, ring wrap.

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 is set here, before
the kernel module is imported (its @triton.jit functions read it when they are defined). With
CUDA (bench/gpu_check.sh) the same tests run compiled on the GPU. Shapes stay small: every
interpreted launch costs a fraction of a second.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from baton.kernels import attention as kernel_attention  # noqa: E402
from baton.kernels.attention import chunk_attention, chunk_attention_reference  # noqa: E402
from baton.kernels.chunk_attention_triton import (  # noqa: E402
    SPLIT_MAX, auto_num_splits, chunk_attention_triton, split_plan)

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rows_of(layout: str, positions: torch.Tensor, item: int, page_size: int, ring_rows: int,
            gen: torch.Generator, num_items: int) -> torch.Tensor:
    """Physical rows of a request's positions, as kv.store addresses them."""
    if layout == "ring":  # slot `item`, position p at row p % ring_rows of the slot
        return item * ring_rows + positions % ring_rows
    pages = torch.randperm(num_items, generator=gen)  # non-contiguous, shuffled page table
    return pages[positions // page_size] * page_size + positions % page_size


def make_batch(chunks, *, layout, window, H, Hkv, D, dtype, seed, page_size=4, draft_tokens=3,
               lookback=None):
    """chunks: [(start, n)] per sequence. Returns the chunk_attention arguments, built the way
    StoreAttention builds them (cached positions: the window before `start`, or all of them;
    `lookback` positions before `start` when given)."""
    gen = torch.Generator().manual_seed(seed)
    B, Q = len(chunks), max(n for _, n in chunks)
    ring_rows = (window or 0) + draft_tokens  # ring geometry: W + k rows per slot
    num_items = len(chunks) if layout == "ring" else 64
    item_rows = ring_rows if layout == "ring" else page_size
    data = torch.randn(num_items * item_rows, 2, Hkv, D, generator=gen).to(dtype)
    k_cache, v_cache = data[:, 0], data[:, 1]  # strided views, as KVStore.kv_buffer returns
    back = lookback or (None if window is None else window - 1)
    spans = [torch.arange(0 if back is None else max(0, s - back), s) for s, _ in chunks]
    M = max(1, max(len(sp) for sp in spans))
    old_rows = torch.zeros(B, M, dtype=torch.long)
    old_pos = torch.full((B, M), -1, dtype=torch.long)
    q_pos = torch.full((B, Q), -1, dtype=torch.long)
    for b, ((start, n), span) in enumerate(zip(chunks, spans)):
        old_pos[b, :len(span)] = span
        old_rows[b, :len(span)] = rows_of(layout, span, b, page_size, ring_rows, gen, num_items)
        q_pos[b, :n] = torch.arange(start, start + n)
    q = torch.randn(B, Q, H, D, generator=gen).to(dtype)
    k_new = torch.randn(B, Q, Hkv, D, generator=gen).to(dtype)
    v_new = torch.randn(B, Q, Hkv, D, generator=gen).to(dtype)
    args = (q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def reference_fp32(args):
    up = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return chunk_attention_reference(*up)


def assert_matches(args, out):
    q_pos, dtype = args[1], args[0].dtype
    valid = q_pos >= 0
    ref = reference_fp32(args)
    err = (out.float()[valid] - ref[valid]).abs().max().item()
    assert err < TOL[dtype], f"max error {err} ({dtype})"
    assert out.dtype == dtype and out.shape == args[0].shape
    assert torch.all(out[~valid] == 0), "padded queries must write zeros"


# a batch mixing long and short requests: decode (1 token, long context), verify (k+1 = 4),
# a prefill chunk with nothing cached, a short request whose window is not full yet
MIXED = [(37, 1), (21, 4), (0, 7), (3, 3)]


@pytest.mark.parametrize("layout,window", [("paged", None), ("paged", 6), ("ring", 6)],
                         ids=["full-paged", "swa-paged", "swa-ring"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mixed_batch_matches_reference(layout, window, dtype):
    # 6 query heads on 2 KV heads (group of 3, not a power of two), head_dim 24 (padded to 32)
    args = make_batch(MIXED, layout=layout, window=window, H=6, Hkv=2, D=24, dtype=dtype, seed=1)
    assert_matches(args, chunk_attention_triton(*args))


def item_major(args, layer: int, layers: int, item_rows: int):
    """The same batch with its cache inside an item-major component [items, layers, item_rows,
    2, Hkv, D] (random data in the other layers), read as KVStore.kv_rows(layer) reads it: a view
    from the layer's first row on, row item * layers * item_rows + offset."""
    q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, window = args
    per_layer = torch.stack((k_cache, v_cache), 1).view(-1, item_rows, 2, *k_cache.shape[1:]).cpu()  # [items, rows, 2, Hkv, D]
    data = torch.randn(per_layer.shape[0], layers, *per_layer.shape[1:]).to(per_layer.dtype)
    data[:, layer] = per_layer
    view = data.view(-1, *per_layer.shape[2:])[layer * item_rows:].to(DEVICE)  # [rows, 2, Hkv, D]
    rows = old_rows // item_rows * (layers * item_rows) + old_rows % item_rows
    return q, q_pos, k_new, v_new, view[:, 0], view[:, 1], rows, old_pos, window


@pytest.mark.parametrize("layout,window,item_rows", [("paged", None, 4), ("ring", 6, 9)],
                         ids=["full-paged", "swa-ring"])
@pytest.mark.parametrize("layer", [0, 2])
def test_item_major_layer_views_match_the_per_layer_cache(layout, window, item_rows, layer):
    """Strided layer views of an item-major component (docs/architecture.md) give both paths
    the same answer as a contiguous per-layer cache."""
    args = make_batch(MIXED, layout=layout, window=window, H=4, Hkv=2, D=16, dtype=torch.float32, seed=5)
    strided = item_major(args, layer, layers=3, item_rows=item_rows)
    assert_matches(args, chunk_attention_triton(*strided))
    valid = args[1] >= 0  # the reference's padded queries attend everything: compare valid ones
    assert torch.equal(chunk_attention_reference(*strided)[valid], chunk_attention_reference(*args)[valid])


@pytest.mark.parametrize("window", [None, 5])
def test_mqa_bf16_and_long_cache(window):
    """One KV head for 4 query heads; bf16 (cast to fp32 inside the kernel under the interpreter);
    enough cached keys for several key blocks."""
    chunks = [(150, 4), (70, 1)]
    args = make_batch(chunks, layout="paged", window=window, H=4, Hkv=1, D=16, dtype=torch.bfloat16, seed=2)
    assert_matches(args, chunk_attention_triton(*args, block_n=16))


@pytest.mark.parametrize("chunks,lookback", [([(40, 3)], 38), ([(0, 40)], None)],
                         ids=["cached-beyond-window", "long-prefill-chunk"])
def test_key_blocks_at_the_window_edge(chunks, lookback):
    """Key blocks wholly outside every query's window are skipped; a block whose newest key is
    exactly the oldest one visible (q_lo - W + 1) is not. Cached keys 2..39 in blocks of 16 end
    a block at 33 = 40 - 8 + 1; a 40-token chunk has query blocks starting past key blocks."""
    args = make_batch(chunks, layout="paged", window=8, H=4, Hkv=2, D=16, dtype=torch.float32,
                      seed=9, lookback=lookback)
    assert_matches(args, chunk_attention_triton(*args, block_n=16))


def test_window_boundary_exact():
    """Brute force, independent of the reference: query p sees p-W+1 .. p and nothing older.
    The value at p-W is huge, so a leak of one position across the boundary shows."""
    W, D = 4, 16
    # cached keys reach one position past the window (p - W exists in the cache); the kernel gets W
    args = make_batch([(9, 4), (2, 2)], layout="paged", window=W + 1, H=2, Hkv=1, D=D,
                      dtype=torch.float32, seed=3)
    q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, _ = args
    v_cache = v_cache.clone()
    v_cache[old_rows[0, 0]] = 1e3  # position 9 - W = 5: seen by no query of the chunk at 9..12
    out = chunk_attention_triton(q, q_pos, k_new, v_new, k_cache, v_cache, old_rows, old_pos, W)
    for b in range(2):
        keys = {int(p): (k_cache[r], v_cache[r]) for p, r in zip(old_pos[b], old_rows[b]) if p >= 0}
        keys.update({int(p): (k_new[b, j], v_new[b, j]) for j, p in enumerate(q_pos[b]) if p >= 0})
        for i, p in enumerate(q_pos[b].tolist()):
            if p < 0:
                continue
            seen = [keys[s] for s in range(max(0, p - W + 1), p + 1)]
            assert len(seen) == min(W, p + 1)
            for h in range(2):
                k = torch.stack([kv[0][0] for kv in seen])  # [n, D]
                v = torch.stack([kv[1][0] for kv in seen])
                w = torch.softmax(k @ q[b, i, h] / D ** 0.5, dim=0)
                assert torch.allclose(out[b, i, h], w @ v, atol=1e-5), (b, p, h)
    assert out.abs().max() < 100  # the 1e3 value at p - W never leaked


def test_draft_ring_wraps():
    """The MTP draft layer's ring: positions 35..39 of slot 2 live at rows 8, 0, 1, 2, 3 of the
    slot (ring of W + k = 9 rows); verify k+1 = 4 positions at 40..43 over a [layers, slots,
    ring_rows, 2, Hkv, D] tensor read through KVStore-style views."""
    W, k, slots, Hkv, D = 6, 3, 4, 2, 16
    R = W + k
    gen = torch.Generator().manual_seed(4)
    data = torch.randn(1, slots, R, 2, Hkv, D, generator=gen)  # one draft layer
    rows = data[0].view(-1, 2, Hkv, D)
    k_cache, v_cache = rows[:, 0], rows[:, 1]
    start, slot = 40, 2
    span = torch.arange(start - W + 1, start)  # 35..39
    ring = slot * R + span % R
    assert (ring.diff() < 0).any(), "the window must wrap around the ring"
    q_pos = torch.arange(start, start + k + 1)[None]  # [1, 4]
    q = torch.randn(1, k + 1, 4, D, generator=gen)
    k_new, v_new = torch.randn(2, 1, k + 1, Hkv, D, generator=gen)
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in
                 (q, q_pos, k_new, v_new, k_cache, v_cache, ring[None], span[None], W))
    assert_matches(args, chunk_attention_triton(*args))


def test_single_token_and_padding():
    """Decode of one token next to a padded sequence; a request with nothing cached at all."""
    args = make_batch([(12, 1), (0, 1), (5, 3)], layout="paged", window=None, H=4, Hkv=2, D=16,
                      dtype=torch.float32, seed=5)
    assert_matches(args, chunk_attention_triton(*args))
    q, q_pos, k_new, v_new, k_cache, v_cache, _, _, _ = args
    empty = torch.zeros(3, 0, dtype=torch.long, device=q.device)
    out = chunk_attention_triton(q, q_pos, k_new, v_new, k_cache, v_cache, empty, empty, 3)
    ref = reference_fp32((q, q_pos, k_new, v_new, k_cache, v_cache,
                          torch.zeros(3, 1, dtype=torch.long, device=q.device),
                          torch.full((3, 1), -1, dtype=torch.long, device=q.device), 3))
    valid = q_pos >= 0
    assert (out[valid] - ref[valid]).abs().max() < 2e-5


# split-K: one long request's cached keys in ranges of whole 16-key blocks, merged afterwards.
# 4 ranges over M = 230 keys (full) are 64+64+64+38, over M = 149 (window 150) 48+48+48+5; the
# short second request's later ranges hold only padding (they see nothing).
@pytest.mark.parametrize("layout,window", [("paged", None), ("paged", 150), ("ring", 150)],
                         ids=["full-paged", "swa-paged", "swa-ring"])
@pytest.mark.parametrize("Q", [1, 4], ids=["decode", "verify"])
def test_split_k_matches_reference(layout, window, Q):
    args = make_batch([(230, Q), (41, 1)], layout=layout, window=window, H=6, Hkv=2, D=24,
                      dtype=torch.float32, seed=10)
    M = args[6].shape[1]
    splits, keys = split_plan(M, 4, 16)
    assert splits == 4 and 0 < M - 3 * keys < keys, "uneven last range"
    assert_matches(args, chunk_attention_triton(*args, block_n=16, num_splits=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_k_ranges_that_see_nothing(dtype):
    """Window 8 far ahead of 299 cached keys in 5 ranges of 64 (the last 43): four ranges of the
    decode lie wholly behind its window, and the verify's last three hold only padding. They
    leave m = -inf, l = 0 and must merge to nothing, without NaNs."""
    args = make_batch([(300, 1), (120, 4)], layout="paged", window=8, H=4, Hkv=2, D=16,
                      dtype=dtype, seed=11, page_size=8, lookback=299)
    assert split_plan(args[6].shape[1], 5, 16) == (5, 64)
    out = chunk_attention_triton(*args, block_n=16, num_splits=5)
    assert not out.isnan().any()
    assert_matches(args, out)


def test_auto_split_rule():
    """Split only while the plain grid is small: 1 x 8192 keys on 8 KV heads is 8 programs, cut
    16 ways (512 keys each) to reach 128; 16 or 64 verifies fill the grid alone; a short context
    has too few blocks to share; the count is capped. Ranges tile 0..M-1 in whole blocks."""
    assert auto_num_splits(1, 1, 32, 8, 8192, block_n=32) == 16
    assert auto_num_splits(1, 4, 32, 8, 8192, block_n=32) == 16  # 4 queries x 4 heads: one tile
    assert auto_num_splits(16, 4, 32, 8, 8192, block_n=32) == 1
    assert auto_num_splits(64, 1, 32, 8, 8192, block_n=32) == 1
    assert auto_num_splits(1, 1, 32, 8, 256, block_n=32) == 1
    assert auto_num_splits(1, 1, 8, 1, 10 ** 6, block_n=32) == SPLIT_MAX
    for M, wanted in [(230, 4), (149, 4), (299, 5), (10, 8), (8192, 16), (1, 1)]:
        splits, keys = split_plan(M, wanted, 16)
        assert keys % 16 == 0 and splits <= wanted and (splits - 1) * keys < M <= splits * keys


def test_auto_rule_is_what_runs():
    """The default (num_splits=None) takes the rule's split for one long request: 300 keys of
    one KV head in blocks of 16 make 2 ranges, bit for bit the forced split."""
    args = make_batch([(300, 1)], layout="paged", window=None, H=4, Hkv=1, D=16,
                      dtype=torch.float32, seed=12, page_size=8)
    assert auto_num_splits(1, 1, 4, 1, args[6].shape[1], block_n=16) == 2
    out = chunk_attention_triton(*args, block_n=16)
    assert_matches(args, out)
    assert torch.equal(out, chunk_attention_triton(*args, block_n=16, num_splits=2))


def test_dispatch(monkeypatch):
    """The serving path calls the dispatch point; off CUDA it is the reference, bit for bit;
    BATON_KERNELS=triton forces the kernel (here: interpreted), =torch the reference."""
    from baton.shared.engine import attention as engine_attention
    assert engine_attention.chunk_attention is kernel_attention.chunk_attention
    args = make_batch(MIXED, layout="ring", window=6, H=4, Hkv=2, D=16, dtype=torch.float32, seed=6)
    monkeypatch.delenv("BATON_KERNELS", raising=False)
    auto = chunk_attention(*args)
    if DEVICE == "cpu":
        assert torch.equal(auto, chunk_attention_reference(*args))
    monkeypatch.setenv("BATON_KERNELS", "torch")
    assert torch.equal(chunk_attention(*args), chunk_attention_reference(*args))
    monkeypatch.setenv("BATON_KERNELS", "triton")
    assert torch.equal(chunk_attention(*args), chunk_attention_triton(*args))
    monkeypatch.setenv("BATON_KERNELS", "fast")
    with pytest.raises(ValueError, match="BATON_KERNELS"):
        chunk_attention(*args)


@pytest.mark.skipif(DEVICE == "cuda", reason="the engine's KVStore here is built on CPU")
@pytest.mark.parametrize("mode", ["ring", "paged"])
@torch.no_grad()
def test_store_forward_through_triton_equals_reference(mode, monkeypatch):
    """A verify step of the serving path (StoreAttention over a real KVStore, batch of a 4-token
    verify and a 1-token decode past the ring's wrap) gives the same logits through the kernel."""
    from baton.shared.engine.attention import Chunk, StoreAttention
    from baton.shared.kv.store import KVStore
    from baton.shared.model.config import FULL, SLIDING, ModelConfig
    from baton.shared.model.model import BatonLM

    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      layer_types=(SLIDING, FULL), sliding_window=5)
    torch.manual_seed(7)
    model = BatonLM(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 61, (L,), generator=gen).tolist() for L in (13, 6)]
    logits = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("BATON_KERNELS", "torch")  # prefill through the reference
        store = KVStore(cfg, mode=mode, num_pages=16, page_size=4, num_slots=2, max_draft_tokens=3)
        for i, p in enumerate(prompts):
            store.allocate(f"r{i}", 32)
            attn = StoreAttention(store, [Chunk(f"r{i}", 0, len(p))], [0, 1])
            model.forward_hidden(torch.tensor(p), attn.positions, attn)
        monkeypatch.setenv("BATON_KERNELS", kernels)
        chunks = [Chunk("r0", 13, 4), Chunk("r1", 6, 1)]
        attn = StoreAttention(store, chunks, [0, 1])
        ids = torch.tensor([3, 1, 4, 1, 5])
        logits[kernels] = model.logits(model.forward_hidden(ids, attn.positions, attn))
        store.check_integrity()
    assert (logits["triton"] - logits["torch"]).abs().max() < 1e-4
