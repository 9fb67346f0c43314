"""Incremental decoding through the KV pools equals the no-cache forward (logits, not argmax)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.shared.engine.attention import Chunk, StoreAttention
from baton.shared.kv.store import KVStore
from tiny_model import dense_logits, tiny_model

pytestmark = pytest.mark.unit
W = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model(97, window=W)


def store_forward(model, store, chunks, ids_per_chunk) -> torch.Tensor:
    attn = StoreAttention(store, chunks, list(range(model.cfg.num_hidden_layers)))
    ids = torch.tensor([t for ids in ids_per_chunk for t in ids])
    return model.logits(model.forward_hidden(ids, attn.positions, attn))


@pytest.mark.parametrize("mode", ["ring", "paged"])
@torch.no_grad()
def test_chunked_prefill_then_batched_decode_equals_dense(model, mode):
    store = KVStore(model.cfg, mode=mode, num_pages=64, page_size=4, num_slots=4, max_draft_tokens=3)
    gen = torch.Generator().manual_seed(1)
    lengths = [3, W, 5 * W + 3]  # below, at and far above the window
    prompts = [torch.randint(0, 97, (L,), generator=gen).tolist() for L in lengths]
    total = 12
    for i, p in enumerate(prompts):
        store.allocate(f"r{i}", len(p) + total)
        for s in range(0, len(p), 7):  # chunks of 7 tokens: bigger than nothing, smaller than prompts
            piece = p[s:s + 7]
            out = store_forward(model, store, [Chunk(f"r{i}", s, len(piece))], [piece])
            ref = dense_logits(model, p[:s + len(piece)])[s:]
            assert (out - ref).abs().max() < 1e-4
    seqs = [list(p) for p in prompts]
    for step in range(total):
        chunks = [Chunk(f"r{i}", len(s), 1) for i, s in enumerate(seqs)]
        nxt = [[int(torch.randint(0, 97, (1,), generator=gen))] for _ in seqs]
        out = store_forward(model, store, chunks, nxt)  # [B, V]
        for i, s in enumerate(seqs):
            s.extend(nxt[i])
            assert (out[i] - dense_logits(model, s)[-1]).abs().max() < 1e-4, (mode, step, i)
    store.check_integrity()


@pytest.mark.parametrize("mode", ["ring", "paged"])
@torch.no_grad()
def test_verify_then_rollback_equals_dense(model, mode):
    """Write k+1 positions, keep only a of them (rewind), continue: logits stay exact."""
    store = KVStore(model.cfg, mode=mode, num_pages=64, page_size=4, num_slots=2, max_draft_tokens=3)
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, 97, (3 * W,), generator=gen).tolist()
    store.allocate("r", 200)
    store_forward(model, store, [Chunk("r", 0, len(seq))], [seq])
    for keep in [0, 3, 1, 2, 0, 3, 3]:
        block = torch.randint(0, 97, (4,), generator=gen).tolist()
        out = store_forward(model, store, [Chunk("r", len(seq), 4)], [block])
        ref = dense_logits(model, seq + block)[len(seq):]
        assert (out - ref).abs().max() < 1e-4
        seq += block[:keep + 1]
        store.rollback("r", len(seq))
        store.check_integrity()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["ring", "paged"]), k=st.integers(1, 5),
       accepts=st.lists(st.integers(0, 5), min_size=1, max_size=10), prompt_len=st.integers(1, 3 * W))
@torch.no_grad()
def test_random_accept_counts_keep_pool_contents_exact(model, mode, k, accepts, prompt_len):
    """Random verify blocks of k+1 tokens with random accept counts, as the decode loop drives
    the pools: the stored K/V rows of every committed position the next query can see equal the
    K/V recomputed from scratch, and the logits stay exact."""
    store = KVStore(model.cfg, mode=mode, num_pages=64, page_size=4, num_slots=2, max_draft_tokens=k)
    gen = torch.Generator().manual_seed(len(accepts) * 7 + k)
    seq = torch.randint(0, 97, (prompt_len,), generator=gen).tolist()
    store.allocate("r", 250)
    store_forward(model, store, [Chunk("r", 0, len(seq))], [seq])
    for a in accepts:
        a = min(a, k)
        block = torch.randint(0, 97, (k + 1,), generator=gen).tolist()
        out = store_forward(model, store, [Chunk("r", len(seq), k + 1)], [block])
        assert (out - dense_logits(model, seq + block)[len(seq):]).abs().max() < 1e-4
        seq += block[:a + 1]
        store.rollback("r", len(seq))
        store.check_integrity()
        assert_rows_equal_recomputed(model, store, seq)


def assert_rows_equal_recomputed(model, store, seq: list[int]) -> None:
    """K/V in the pools for the positions a query at len(seq) reads == a fresh no-cache forward's."""
    fresh = KVStore(model.cfg, mode=store.mode, num_pages=64, page_size=4, num_slots=2,
                    max_draft_tokens=store.max_draft_tokens)
    fresh.allocate("f", 250)
    store_forward(model, fresh, [Chunk("f", 0, len(seq))], [seq])
    for layer in range(model.cfg.num_hidden_layers):
        window = model.cfg.window_of(layer)
        lo = 0 if window is None else max(0, len(seq) - window + 1)
        positions = torch.arange(lo, len(seq))
        for got, want in zip(store.kv_buffer(layer), fresh.kv_buffer(layer)):
            a = got[store.rows("r", layer, positions)]
            b = want[fresh.rows("f", layer, positions)]
            assert (a - b).abs().max() < 1e-5, (layer, lo, len(seq))
