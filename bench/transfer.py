"""NIXL WRITE bandwidth between two processes, next to same-run in-process copies of the same bytes.

    python bench/transfer.py --json out/transfer.json

The sender (this process) and the receiver (a spawned child), each on uvloop as the services
are, hold a KV-like pool of `--layers` layers with `--page-kib` bytes per layer and page, plus an
aux region, laid out per `--layout`:
  item   (default, Baton's KVStore) one region, item-major: a page holds every layer
         (layers x page-kib bytes), so a run of pages adjacent on both sides is one descriptor.
         A payload of S bytes is ceil(S / (layers * page)) pages (at least one).
  layer  the per-layer layout Baton had before, for an A/B: one region per layer; a payload is
         min(layers, S / page) layers of S / (layers * page) pages each, one descriptor per run
         per layer.
Each request's bytes and one aux row go through `TransferAgent.write` (prepared per-peer lists,
completion watched by the agent's NIXL thread) as the descriptors Baton's transfer plan makes: one
per run of pages adjacent on both sides (`merge_runs`). `--shape` picks the page ids, on each side:
  random      drawn at random (per layer in the layer layout): nothing merges (the worst case)
  churn       one page table for all layers, as the KV store allocates it (`IdPool`) after random
              requests came and went, fresh each iteration
  contiguous  0..n-1: one descriptor (per layer in the layer layout; a fresh pool)
`--inflight N` starts N requests' `write()`s together, on disjoint pages (one churned pool for all of
them), as a prefill worker under load does: their fixed costs overlap with each other's copies.
The byte columns then count all N payloads (S below is N x the payload).
Every timed copy starts after a sweep over a buffer twice the size of the last-level cache, so
none of them finds the bytes that the one before it moved still cached (a 16 MiB payload fits in a
32 MiB L3). Pools are on 2 MiB huge pages, as the KV store allocates them (`--small-pages`: torch's own 4 KiB
pages, to see what huge pages are worth); the copy baselines always are. Columns (GB/s = 1e9 B/s, medians):
  descs    descriptors of one request's WRITE list: its KV runs plus the aux row
  write    S / time of `write()` (post to every WRITE DONE; the last one, with --inflight)
  arrive   S / time from `write()` start to the receiver's (last) ARRIVED event
  nixl     the same descriptors (all requests' together) as one WRITE by a second, bare NIXL
           agent in this process: prepared lists, post, poll to DONE on one thread, no
           notification, no Baton: NIXL's own ceiling for this shape
  nixl/pg  the same bytes as `nixl`, one descriptor per item (as Baton's prepared per-item lists
           send whole items): what a descriptor costs
  cma      the same descriptors copied by raw process_vm_writev calls (1024 iovecs per call):
           the ceiling of UCX's cma transport for this shape, without NIXL or Baton
  copy1    contiguous copy of S bytes in this process on one thread (`np.copyto`, a memcpy; a
           NIXL WRITE over cma is one copying thread too)
  copyN    contiguous `dst.copy_(src)` of S bytes with torch (default thread count)
  copyT    the same on as many threads as the WRITE copies on (`--copy-threads`, at least 1):
           a memcpy with the same cores
  ratio    write / copy1;  ratioN  write / copyN;  ratioT  write / copyT
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

try:
    import uvloop  # the loop the services run on
except ImportError:  # e.g. a GPU image's own Python (bench/gpu_check.sh): asyncio's own loop
    uvloop = None

from baton.shared.kv.allocator import IdPool
from baton.shared.kv.descriptors import merge_runs
from baton.shared.kv.host_memory import huge_page_zeros
from baton.shared.transfer import AUX_KEY, Descriptor, EventKind, Region, TransferAgent
from baton.shared.transfer.nixl_thread import create_agent

KV = "target/FULL"
AUX_BYTES = 4096
SIZES = "64K,256K,1M,4M,16M,64M,256M"
SHAPES = ("random", "churn", "contiguous")
LAYOUTS = ("item", "layer")
CHURN_ROUNDS = 8
COLUMNS = {"write": "write_gbps", "arrive": "arrive_gbps", "nixl": "nixl_gbps", "nixl/pg": "nixl_pages_gbps",
           "cma": "cma_gbps",
           "copy1": "copy1_gbps", "copyN": "copyn_gbps", "copyT": "copyt_gbps", "ratio": "ratio",
           "ratioN": "ratio_n", "ratioT": "ratio_t"}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def make_pools(layout: str, layers: int, pages: int, page: int, fill: bool, huge: bool,
               aux_rows: int) -> dict[tuple[str, int], np.ndarray]:
    """Byte arrays by region key: item layout one KV region [pages * layers * page] (item-major),
    layer layout one [pages * page] per layer; and the aux region."""
    zeros = host_zeros if huge else lambda n: torch.zeros(n, dtype=torch.uint8)
    regions = 1 if layout == "item" else layers
    pools = {(KV, i): zeros(pages * page * layers // regions).numpy() for i in range(regions)}
    pools[AUX_KEY, 0] = zeros(aux_rows * AUX_BYTES).numpy()
    rng = np.random.default_rng(0)
    for a in pools.values():  # touch every page now: real pools are resident
        a[:] = rng.integers(0, 256, a.size, dtype=np.uint8) if fill else 0
    return pools


def host_zeros(nbytes: int) -> torch.Tensor:
    return huge_page_zeros((nbytes,), torch.uint8)  # [nbytes], as the KV store allocates pools


def regions_of(pools, item: int) -> list[Region]:
    """`item`: bytes of one KV item (a page of every layer, or of one layer)."""
    return [Region(key, layer, a.ctypes.data, a.nbytes, AUX_BYTES if key == AUX_KEY else item)
            for (key, layer), a in pools.items()]


# --- receiver process -------------------------------------------------------------------------
def receiver(conn, layout: str, layers: int, pages: int, page: int, huge: bool, aux_rows: int) -> None:
    pools = make_pools(layout, layers, pages, page, fill=False, huge=huge, aux_rows=aux_rows)
    run(_receive(conn, pools, item_bytes(layout, layers, page)))


def run(coro):
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


async def received(conn):
    """The next message on the pipe, waited for by the event loop (as a service waits on its
    sockets: no polling that would take CPU from the WRITE being measured)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        if not conn.poll():
            await ready
    finally:
        loop.remove_reader(conn.fileno())
        os.set_blocking(conn.fileno(), True)  # uvloop made it non-blocking; recv() reads whole messages
    return conn.recv()


async def _receive(conn, pools, item: int) -> None:
    async with TransferAgent("bench-decode", regions_of(pools, item)) as agent:
        conn.send((agent.metadata(), regions_of(pools, item)))
        while True:
            op, *args = await received(conn)
            if op == "stop":
                return
            if op == "expect":  # [(tag, aux_offset)], components: ack now, report the last event later
                for tag, aux_offset in args[0]:
                    agent.arrivals.expect(tag, "bench-send", args[1], aux_offset, 30.0)
                conn.send("ok")
                kinds = {(await agent.arrivals.events.get()).kind.value for _ in args[0]}
                conn.send((sorted(kinds), time.monotonic()))
            elif op == "read":  # (component, layer, offset, nbytes)
                key, layer, offset, nbytes = args
                conn.send(pools[key, layer][offset:offset + nbytes].tobytes())


# --- sender -----------------------------------------------------------------------------------
def item_bytes(layout: str, layers: int, page: int) -> int:
    return layers * page if layout == "item" else page


def pages_per_layer(layout: str, payload: int, layers: int, page: int) -> int:
    """Pages of one request (item layout: each holds every layer)."""
    if layout == "item":
        return max(1, -(-payload // (layers * page)))
    return max(1, payload // (layers_used(layout, payload, layers, page) * page))


def layers_used(layout: str, payload: int, layers: int, page: int) -> int:
    """Regions a request touches: the one item-major region, or some layer regions."""
    return 1 if layout == "item" else max(1, min(layers, payload // page))


def plan(layout: str, payload: int, layers: int, pages: int, page: int, rng, shape: str,
         inflight: int) -> list[list[Descriptor]]:
    """The descriptors of `inflight` requests of `payload` bytes each, on disjoint pages; request
    i's aux row is row i on both sides."""
    used, per_layer = layers_used(layout, payload, layers, page), pages_per_layer(layout, payload, layers, page)
    item = item_bytes(layout, layers, page)
    requests: list[list[Descriptor]] = [[] for _ in range(inflight)]
    for layer in range(used):
        if shape == "random" or layer == 0:
            tables = [page_tables(shape, per_layer, inflight, pages, rng) for _ in range(2)]  # src, dst
        for out, src, dst in zip(requests, *tables):
            out += [Descriptor(KV, layer, s * item, d * item, n * item) for s, d, n in merge_runs(src, dst)]
    return [out + [Descriptor(AUX_KEY, 0, i * AUX_BYTES, i * AUX_BYTES, AUX_BYTES)] for i, out in enumerate(requests)]


def page_tables(shape: str, n: int, count: int, pages: int, rng) -> list[np.ndarray]:
    """`count` disjoint page tables of n pages each."""
    if shape == "random":
        return list(rng.choice(pages, n * count, replace=False).reshape(count, n))
    if shape == "contiguous":
        return list(np.arange(n * count).reshape(count, n))
    pool = churned(pages, n * count, rng)
    return [np.array(pool.take(n)) for _ in range(count)]


def churned(pages: int, need: int, rng) -> IdPool:
    """A pool after CHURN_ROUNDS of: requests of 1..pages/8 pages arrive until one does not fit,
    then a random half of the live ones leaves; then random ones leave until `need` pages are free."""
    pool, live = IdPool(pages, "pages"), []
    for _ in range(CHURN_ROUNDS):
        while (n := int(rng.integers(1, max(2, pages // 8) + 1))) <= pool.num_free:
            live.append(pool.take(n))
        for i in sorted(rng.choice(len(live), len(live) // 2, replace=False), reverse=True):
            pool.give(live.pop(i))
    while pool.num_free < need:
        pool.give(live.pop(int(rng.integers(len(live)))))
    return pool


def per_page(descriptors: list[Descriptor], page: int) -> list[Descriptor]:
    """The same bytes as one descriptor per item (and one for a shorter tail)."""
    return [Descriptor(d.component_key, d.layer_index, d.src_offset + at, d.dst_offset + at, min(page, d.nbytes - at))
            for d in descriptors for at in range(0, d.nbytes, page)]


def llc_bytes() -> int:
    """The last-level cache's size from sysfs (32 MiB if it cannot be read)."""
    texts = [f.read_text().strip() for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    return max((parse_size(t) for t in texts if t[:-1].isdigit() and t[-1] in "KMG"), default=32 << 20)


class CacheSweep:
    """Evicts the caches before a timed copy: writes one byte per 64 B line of a buffer twice the
    size of the last-level cache."""

    def __init__(self):
        self.buffer = np.zeros(2 * llc_bytes(), np.uint8)

    def __call__(self) -> None:
        self.buffer[::64] += 1


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def spans(descriptors: list[Descriptor], local: dict, remote: dict) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each descriptor; `local`/`remote` map a
    region key to its base address on each side."""
    return [(local[d.component_key, d.layer_index] + d.src_offset,
             remote[d.component_key, d.layer_index] + d.dst_offset, d.nbytes) for d in descriptors]


def cma_seconds(pid: int, descriptors: list[Descriptor], local: dict, remote: dict) -> float:
    """Time to copy `descriptors` into process `pid` with process_vm_writev, as UCX's cma does."""
    n, copies = len(descriptors), spans(descriptors, local, remote)
    src = (_IoVec * n)(*[_IoVec(a, size) for a, _, size in copies])
    dst = (_IoVec * n)(*[_IoVec(b, size) for _, b, size in copies])
    writev = ctypes.CDLL(None, use_errno=True).process_vm_writev
    size = ctypes.sizeof(_IoVec)
    t0 = time.monotonic()
    for i in range(0, n, 1024):
        k = min(1024, n - i)
        at = (ctypes.addressof(src) + i * size, ctypes.addressof(dst) + i * size)
        if writev(pid, ctypes.c_void_p(at[0]), k, ctypes.c_void_p(at[1]), k, 0) < 0:
            raise OSError(ctypes.get_errno(), "process_vm_writev")
    return time.monotonic() - t0


class RawNixl:
    """A second NIXL agent in this process, outside Baton: the same memory, each measured WRITE
    made from one-off prepared lists of the descriptors (prepared before the clock starts), posted
    and polled to DONE on the calling thread with nothing else in the way, no notification: what
    NIXL itself does with this shape."""

    def __init__(self, pools, peer_metadata: bytes, copy_threads: int):
        self.agent = create_agent("bench-raw", copy_threads)  # configured as the sender's agent is
        self.reg = self.agent.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in pools.values()], "DRAM")
        name = self.agent.add_remote_agent(peer_metadata)
        self.peer = name.decode() if isinstance(name, bytes) else name
        self.agent.make_connection(self.peer)

    def seconds(self, descriptors: list[Descriptor], local: dict, remote: dict) -> float:
        copies = np.array(spans(descriptors, local, remote), dtype=np.uint64)  # [n, 3]: src, dst, bytes
        zeros = np.zeros(len(copies), dtype=np.uint64)  # device id
        src = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack([copies[:, 0], copies[:, 2], zeros], 1), "DRAM")
        dst = self.agent.prep_xfer_dlist(self.peer, np.stack([copies[:, 1], copies[:, 2], zeros], 1), "DRAM")
        index = np.arange(len(descriptors), dtype=np.int32)
        t0 = time.monotonic()
        handle = self.agent.make_prepped_xfer("WRITE", src, index, dst, index)
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        seconds = time.monotonic() - t0
        assert state == "DONE", state
        for h in (handle, src, dst):
            h.release()
        return seconds

    def close(self) -> None:
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)


async def measure(agent: TransferAgent, conn, pools, payload: int, args, rng, tag: int) -> dict:
    """Each iteration times, back to back so they see the same machine load: `--inflight` requests'
    `write()`s started together, until the last one returns and arrives; their descriptors as one
    bare NIXL WRITE and as raw cma copies; a one-thread memcpy of as many bytes. The
    multi-threaded torch copies run afterwards: torch's OpenMP workers spin after a parallel op
    and would steal a core from the next WRITE."""
    times: dict[str, list[float]] = {k: [] for k in ("write", "arrive", "nixl", "nixl_pages", "cma", "copy1", "copyn",
                                                           "copyt")}
    counts = []  # descriptors per request (churn: each iteration has its own page tables)
    for i in range(args.warmup + args.iters):
        requests = plan(args.layout, payload, args.layers, args.pages, args.page_kib << 10, rng, args.shape,
                        args.inflight)
        nbytes = sum(x.nbytes for r in requests for x in r[:-1])  # all requests, aux rows aside
        counts += [len(r) for r in requests]
        if i == 0:
            src = host_zeros(nbytes).random_(0, 256)  # huge pages: memcpy's best case
            dst = host_zeros(nbytes)  # touched, like the receiver's pools
            src1, dst1 = src.numpy(), dst.numpy()
        tags = list(range(tag + 1, tag + 1 + len(requests)))
        tag = tags[-1]
        conn.send(("expect", [(t, r[-1].dst_offset) for t, r in zip(tags, requests)], [KV]))
        assert conn.recv() == "ok"
        args.sweep()
        t0 = time.monotonic()
        results = await asyncio.gather(*(agent.write("bench-decode", r, t, 30.0) for t, r in zip(tags, requests)))
        t1 = time.monotonic()
        kinds, arrived = await received(conn)
        assert all(r.ok for r in results) and kinds == [EventKind.ARRIVED.value], (results, kinds)
        every = [d for r in requests for d in r]
        pages = per_page(every, item_bytes(args.layout, args.layers, args.page_kib << 10))
        sample = {"write": t1 - t0, "arrive": arrived - t0}
        for key, measured in (("nixl", lambda: args.raw.seconds(every, args.local, args.remote)),
                              ("nixl_pages", lambda: args.raw.seconds(pages, args.local, args.remote)),
                              ("cma", lambda: cma_seconds(args.receiver_pid, every, args.local, args.remote)),
                              ("copy1", lambda: timed(np.copyto, dst1, src1))):
            args.sweep()
            sample[key] = measured()
        if i >= args.warmup:
            for k, v in sample.items():
                times[k].append(v)
    for key, threads in (("copyn", args.torch_threads), ("copyt", max(1, args.copy_threads))):
        torch.set_num_threads(threads)
        for i in range(args.warmup + args.iters):
            args.sweep()
            seconds = timed(dst.copy_, src)
            if i >= args.warmup:
                times[key].append(seconds)
    torch.set_num_threads(args.torch_threads)
    for r in requests:  # the last iteration's bytes arrived where they should
        d = r[-2]
        conn.send(("read", d.component_key, d.layer_index, d.dst_offset, d.nbytes))
        assert conn.recv() == pools[d.component_key, d.layer_index][d.src_offset:d.src_offset + d.nbytes].tobytes()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"payload_bytes": nbytes // len(requests), "inflight": len(requests),
            "descriptors": int(statistics.median(counts)),
            **{f"{k}_gbps": v for k, v in gbps.items()}, "ratio": gbps["write"] / gbps["copy1"],
            "ratio_n": gbps["write"] / gbps["copyn"], "ratio_t": gbps["write"] / gbps["copyt"],
            "write_ms": statistics.median(times["write"]) * 1e3,
            "tag": tag}


def timed(fn, *args) -> float:
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


async def send(args, conn, pools) -> list[dict]:
    rng = np.random.default_rng(1)
    rows, tag = [], 0
    async with TransferAgent("bench-send", regions_of(pools, item_bytes(args.layout, args.layers, args.page_kib << 10)),
                             copy_threads=args.copy_threads) as agent:
        meta, regions = conn.recv()
        await agent.add_peer("bench-decode", meta, regions)
        args.local = {r.key: r.addr for r in agent.table.regions}
        args.remote = {r.key: r.addr for r in regions}
        args.raw = RawNixl(pools, meta, args.copy_threads)
        try:
            for size in args.sizes.split(","):
                row = await measure(agent, conn, pools, parse_size(size), args, rng, tag)
                tag = row.pop("tag")
                rows.append(row)
                print(f"{row['payload_bytes'] / 2**20:9.3f} {row['descriptors']:6d} " + " ".join(
                    f"{row[k]:7.2f}" for k in COLUMNS.values()), flush=True)
        finally:
            args.raw.close()
    conn.send(("stop",))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=SIZES, help="payloads, comma-separated (K/M/G suffixes)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64,
                    help="page bytes per layer (64 KiB: 16 tokens x 8 KV heads x 128 dims x K,V x bf16)")
    ap.add_argument("--shape", choices=SHAPES, default="random", help="page ids on both sides (see above)")
    ap.add_argument("--layout", choices=LAYOUTS, default="item",
                    help="item: one item-major region, a page holds every layer (Baton's); layer: a region "
                         "per layer (the old layout, for an A/B)")
    ap.add_argument("--small-pages", action="store_true",
                    help="pools on torch's own allocation (4 KiB pages) instead of the KV store's huge pages")
    ap.add_argument("--inflight", type=int, default=1,
                    help="requests whose WRITEs are started together (a prefill worker under load); "
                         "GB/s then counts all of their bytes")
    ap.add_argument("--copy-threads", type=int, default=0,
                    help="the sender's and the bare NIXL agent's UCX copy threads (TransferAgent(copy_threads=)): "
                         "a WRITE's descriptors copy in parallel chunks; 0: on the NIXL thread")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    page = args.page_kib << 10
    if args.inflight < 1:
        ap.error("--inflight must be >= 1")
    if args.copy_threads < 0:
        ap.error("--copy-threads must be >= 0")
    # pages per layer region: every in-flight request's pages, 25% spare
    needed = max(pages_per_layer(args.layout, parse_size(s), args.layers, page) for s in args.sizes.split(","))
    args.pages = -(-needed * args.inflight * 5 // 4)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(child_conn, args.layout, args.layers, args.pages, page,
                                               not args.small_pages, args.inflight), daemon=True)
    child.start()
    args.receiver_pid = child.pid
    pools = make_pools(args.layout, args.layers, args.pages, page, fill=True, huge=not args.small_pages,
                       aux_rows=args.inflight)
    args.torch_threads = torch.get_num_threads()
    args.sweep = CacheSweep()
    print(f"layout {args.layout}, {args.layers} layers, pages {args.shape}, {args.page_kib} KiB per layer, "
          f"{'4 KiB' if args.small_pages else '2 MiB'} memory pages, "
          f"{args.inflight} request(s) in flight, copy threads {args.copy_threads}, "
          f"torch threads {args.torch_threads}, UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, "
          f"{'uvloop' if uvloop is not None else 'asyncio loop (no uvloop)'}")
    print(f"{'MiB':>9} {'descs':>6} " + " ".join(f"{c:>7}" for c in COLUMNS))
    rows = run(send(args, conn, pools))
    child.join(10)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        args.json.write_text(json.dumps({"bench": "transfer", "layout": args.layout, "layers": args.layers,
                                         "page_bytes": page,
                                         "shape": args.shape, "huge_pages": not args.small_pages, "iters": args.iters,
                                         "inflight": args.inflight, "copy_threads": args.copy_threads,
                                         "torch_threads": args.torch_threads, "ucx_env": env,
                                         "event_loop": "uvloop" if uvloop is not None else "asyncio",
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
