"""Item-major KV stores on both sides of a real NIXL WRITE: prefill (a spawned child) and decode
(this process) each build a `KVStore` whose pools were churned by earlier requests, so a
request's pages are scattered; the plan made from the two manifests moves one descriptor per run
of whole items (every layer at once), and decode then reads, through its own rows, exactly the
random K/V prefill holds: every full layer at every position, every sliding layer (target and
the MTP draft's) over the window, with the ring window wrapping around its slot."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import random

import msgspec
import numpy as np
import pytest
import torch

from baton.shared.kv import KVStore, Manifest, make_plan
from baton.shared.kv.components import Allocation
from baton.shared.model.config import FULL as F, SLIDING as S, ModelConfig

pytestmark = pytest.mark.integration
pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed (pip install -e '.[transfer]')")

from baton.shared.transfer.regions import regions_of  # noqa: E402
from baton.shared.transfer import Descriptor, EventKind, TransferAgent  # noqa: E402

W, PS, K = 16, 4, 3  # ring rows R = W + K = 19
LENGTH = 60  # window 45..59 sits at ring rows 7..18, 0..2: it wraps
CFG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, num_hidden_layers=6,
                  layer_types=(S, S, F, S, F, S), sliding_window=W, num_nextn_predict_layers=1,
                  mtp_layer_types=(S,))
LAYERS = tuple(range(CFG.num_hidden_layers + 1))  # the draft layer (6) is a sliding ring too


def churned_store(mode: str, seed: int) -> KVStore:
    """A store after requests of 1..3 pages filled it and a random half of them left."""
    store = KVStore(CFG, mode=mode, num_pages=120, page_size=PS, num_slots=60, max_draft_tokens=K)
    rng, live = random.Random(seed), []
    while store.free_capacity().pages >= 3 and store.free_capacity().slots > 1:
        live.append(f"f{len(live)}")
        store.allocate(live[-1], rng.randint(1, 3 * PS))
    for rid in rng.sample(live, len(live) // 2):
        store.free(rid)
    store.allocate("r", LENGTH + K + 1)
    store.extend("r", LENGTH)
    store.check_integrity()
    return store


def needed(store: KVStore, layer: int) -> torch.Tensor:
    """Layer's K/V rows decode reads after the prompt: [n, 2, kv_heads, head_dim]."""
    start = 0 if CFG.attention_type(layer) == F else LENGTH - W + 1
    return store.kv_rows(layer)[store.rows("r", layer, torch.arange(start, LENGTH))]


# --- the prefill process ------------------------------------------------------------------------
def prefill_main(conn, mode: str) -> None:
    asyncio.run(_prefill(conn, mode))


async def _prefill(conn, mode: str) -> None:
    store = churned_store(mode, seed=1)
    gen = torch.Generator().manual_seed(0)
    for data in store.data.values():  # random bytes everywhere, not only in the request's rows
        data.copy_(torch.rand(data.shape, generator=gen))
    store.aux.copy_(torch.randint(0, 256, store.aux.shape, generator=gen, dtype=torch.uint8))
    manifest = store.manifest("prefill-kv", "sha256:m", role="prefill")
    async with TransferAgent("prefill-kv", regions_of(manifest)) as agent:
        want = {layer: needed(store, layer).numpy() for layer in LAYERS}
        conn.send((agent.metadata(), msgspec.msgpack.encode(manifest), msgspec.msgpack.encode(store.allocation("r")), want,
                   store.aux_row("r").numpy().tobytes()))
        peer, metadata, regions, descriptors, tag = await asyncio.to_thread(conn.recv)
        await agent.add_peer(peer, metadata, regions)
        result = await agent.write(peer, descriptors, tag, 30.0)
        conn.send((result.ok, result.error))
        await asyncio.to_thread(conn.recv)  # stop


# --- decode (this process) ----------------------------------------------------------------------
async def transfer(mode: str) -> None:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_main, args=(child_conn, mode), daemon=True)
    child.start()
    try:
        assert await asyncio.to_thread(conn.poll, 60), "prefill child did not start"
        metadata, raw_manifest, raw_alloc, want, src_aux = conn.recv()
        src_manifest, src_alloc = msgspec.msgpack.decode(raw_manifest, type=Manifest), msgspec.msgpack.decode(raw_alloc, type=Allocation)
        store = churned_store(mode, seed=2)
        manifest = store.manifest("decode-kv", "sha256:m", role="decode")
        plan = make_plan(src_manifest, manifest)
        dst_alloc = store.allocation("r")
        descs = plan.descriptors(LENGTH, src_alloc, dst_alloc)
        check_descriptor_counts(descs, plan, src_alloc, dst_alloc, mode)
        async with TransferAgent("decode-kv", regions_of(manifest)) as agent:
            await agent.add_peer("prefill-kv", metadata, regions_of(src_manifest))
            tag = 77
            aux = manifest.component("aux/AUX").geometry
            agent.arrivals.expect(tag, "prefill-kv", [p.src.name for p in plan.pairs if p.src.name != "aux/AUX"],
                                  dst_alloc.slot * aux.item_bytes, 30.0)
            conn.send(("decode-kv", agent.metadata(), regions_of(manifest),
                       [Descriptor(d.component_key, d.layer_index, d.src_offset, d.dst_offset, d.nbytes)
                        for d in descs], tag))
            event = await asyncio.wait_for(agent.arrivals.events.get(), 30.0)
            assert (event.kind, event.tag) == (EventKind.ARRIVED, tag)
            assert await asyncio.to_thread(conn.recv) == (True, "")
        for layer in LAYERS:
            assert np.array_equal(needed(store, layer).numpy(), want[layer]), f"layer {layer}"
        header_and_row = 24 + plan.aux_hidden_rows(LENGTH) * aux.row_bytes
        got_aux = store.aux_row("r").numpy().tobytes()
        assert got_aux[:8] == tag.to_bytes(8, "little") and got_aux[8:header_and_row] == src_aux[8:header_and_row]
        store.check_integrity()
        conn.send("stop")
    finally:
        child.join(20)
        if child.is_alive():
            child.kill()


def runs(pairs) -> int:
    pairs = sorted(pairs)
    return sum(1 for i, (s, d) in enumerate(pairs) if i == 0 or (s - pairs[i - 1][0], d - pairs[i - 1][1]) != (1, 1))


def check_descriptor_counts(descs, plan, src: Allocation, dst: Allocation, mode: str) -> None:
    """One descriptor per run of pages adjacent on both sides; one per ring slot; one aux row."""
    count = {name: sum(d.component_key == name for d in descs) for name in {d.component_key for d in descs}}
    pages = -(-LENGTH // PS)
    full = runs(zip(src.page_ids[:pages], dst.page_ids[:pages]))
    assert count["target/FULL"] == full and 1 < full < pages  # scattered, merged where adjacent
    if mode == "ring":
        assert count["target/SWA_RING"] == count["draft/SWA_RING"] == 1
    else:
        window = range((LENGTH - W + 1) // PS, pages)
        swa = runs((src.swa_page_ids[i], dst.swa_page_ids[i]) for i in window)
        assert count["target/SWA"] == count["draft/SWA"] == swa
    assert count["aux/AUX"] == 1 and len(descs) == sum(count.values())
    assert {p.src.name for p in plan.pairs} == set(count)


@pytest.mark.parametrize("mode", ["ring", "paged"])
def test_item_major_stores_transfer_byte_exact_across_processes(mode):
    asyncio.run(transfer(mode))
