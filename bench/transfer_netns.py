"""NIXL WRITE bandwidth between two "hosts" (network namespaces, UCX over TCP), next to a same-run
raw TCP stream of the same bytes between the same two namespaces (issue 29).

    sudo .venv/bin/python bench/transfer_netns.py --json out/transfer_netns.json

Builds tests/multihost.py's topology with two hosts (a: sender, b: receiver; 10.77.<x>.1 and
10.77.<x>.2 on a bridge in its own namespace, optional `--delay-ms` netem where the kernel has it),
then runs this script again in each namespace with `UCX_TLS=tcp,self UCX_NET_DEVICES=eth0`:
the receiver registers one buffer of the largest size with a NIXL agent configured as Baton's are
(`create_agent`: UCX backend, no NIXL progress thread, so the receiver progresses it itself, as
decode's NIXL thread does: UCX's TCP transport emulates a put with active messages that the
target must progress), the sender one of the same size. For each size, each iteration times, back
to back:
  nixl   one WRITE of S bytes as `--desc-kib` descriptors (0: one descriptor) from prepared lists:
         post, poll to DONE (NIXL's DONE over TCP includes the flush answered by the receiver)
  tcp    the same S bytes over one already-connected TCP socket (`sendall`; the receiver
         `recv_into`s the same buffer and answers one byte once it has all of them)
Columns are medians in GB/s (1e9 B/s) and ratio = nixl / tcp. The receiver checks the bytes of
the last WRITE of each size (a sample of pages) against the sender's.
Needs root and iproute2 (the same as `pytest -m multihost`).
"""
from __future__ import annotations

import argparse
import json
import selectors
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONTROL_PORT, DATA_PORT = 7701, 7702
SIZES = "1M,4M,16M,64M,256M"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _agent(name: str):
    sys.path.insert(0, str(ROOT))
    from baton.shared.transfer.nixl_thread import create_agent
    return create_agent(name)


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _recv_msg(sock: socket.socket) -> dict:
    return json.loads(_recv_exact(sock, int.from_bytes(_recv_exact(sock, 4), "big")))


# --- receiver (host b) --------------------------------------------------------------------------
def receiver(addr: str, size: int) -> None:
    agent = _agent("bench-recv")
    buf = np.zeros(size, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    meta = agent.get_agent_metadata()
    control_l = socket.create_server((addr, CONTROL_PORT))
    data_l = socket.create_server((addr, DATA_PORT))
    print(f"receiver ready on {addr}", flush=True)
    control, _ = control_l.accept()
    data, _ = data_l.accept()
    data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send_msg(control, {"metadata": meta.hex(), "addr": buf.ctypes.data, "size": buf.nbytes})
    control.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    pending = b""
    view = memoryview(buf)
    try:
        while True:
            agent.get_new_notifs()  # progress UCX: over TCP the puts land only while we do
            if not sel.select(timeout=0):
                continue
            try:
                chunk = control.recv(1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return
            pending += chunk
            while len(pending) >= 4 and len(pending) >= 4 + int.from_bytes(pending[:4], "big"):
                n = int.from_bytes(pending[:4], "big")
                msg, pending = json.loads(pending[4:4 + n]), pending[4 + n:]
                if msg["op"] == "tcp":  # S bytes on the data socket into the buffer, then one byte back
                    got, want = 0, msg["bytes"]
                    while got < want:
                        got += data.recv_into(view[got:want], want - got)
                    data.sendall(b"k")
                elif msg["op"] == "check":  # the bytes at these offsets
                    sample = [int(buf[o:o + 64].astype(np.uint64).sum()) for o in msg["offsets"]]
                    control.setblocking(True)
                    _send_msg(control, {"sums": sample})
                    control.setblocking(False)
                elif msg["op"] == "quit":
                    return
    finally:
        agent.deregister_memory(reg)


# --- sender (host a) ----------------------------------------------------------------------------
def sender(peer: str, sizes: list[int], iters: int, warmup: int, desc_kib: int) -> list[dict]:
    agent = _agent("bench-send")
    src = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8)
    reg = agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    control = _connect(peer, CONTROL_PORT)
    data = _connect(peer, DATA_PORT)
    data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    info = _recv_msg(control)
    name = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
    name = name.decode() if isinstance(name, bytes) else name
    agent.make_connection(name)
    rows = []
    for size in sizes:
        step = desc_kib * 1024 if desc_kib else size
        offsets = np.arange(0, size, step, dtype=np.uint64)
        lengths = np.minimum(step, size - offsets).astype(np.uint64)
        zeros = np.zeros(len(offsets), dtype=np.uint64)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.stack([offsets + src.ctypes.data, lengths, zeros], 1), "DRAM")
        remote = agent.prep_xfer_dlist(name, np.stack([offsets + info["addr"], lengths, zeros], 1), "DRAM")
        index = np.arange(len(offsets), dtype=np.int32)
        nixl_s, tcp_s = [], []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            handle = agent.make_prepped_xfer("WRITE", local, index, remote, index)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            t1 = time.perf_counter()
            assert state == "DONE", state
            handle.release()
            _send_msg(control, {"op": "tcp", "bytes": size})
            t2 = time.perf_counter()
            data.sendall(memoryview(src)[:size])
            assert _recv_exact(data, 1) == b"k"
            t3 = time.perf_counter()
            if i >= warmup:
                nixl_s.append(t1 - t0)
                tcp_s.append(t3 - t2)
        # the TCP copy overwrote the same bytes: WRITE once more, then compare a sample
        handle = agent.make_prepped_xfer("WRITE", local, index, remote, index)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        handle.release()
        sample = sorted({0, size - 64, *np.random.default_rng(size).integers(0, size - 64, 14).tolist()})
        _send_msg(control, {"op": "check", "offsets": sample})
        want = [int(src[o:o + 64].astype(np.uint64).sum()) for o in sample]
        assert _recv_msg(control)["sums"] == want, f"bytes differ after the WRITE of {size}"
        local.release()
        remote.release()
        nixl, tcp = size / statistics.median(nixl_s) / 1e9, size / statistics.median(tcp_s) / 1e9
        rows.append({"bytes": size, "descriptors": len(offsets), "nixl_gbps": round(nixl, 3),
                     "tcp_gbps": round(tcp, 3), "ratio": round(nixl / tcp, 3),
                     "nixl_ms": round(statistics.median(nixl_s) * 1e3, 3), "tcp_ms": round(statistics.median(tcp_s) * 1e3, 3)})
        print(json.dumps(rows[-1]), flush=True)
    _send_msg(control, {"op": "quit"})
    agent.remove_remote_agent(name)
    agent.deregister_memory(reg)
    return rows


def _connect(peer: str, port: int, timeout_s: float = 30.0) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((peer, port), timeout=timeout_s)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# --- orchestration (root namespace) -------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=SIZES, help="payloads, comma-separated (K/M/G suffixes)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--desc-kib", type=int, default=0, help="descriptor size in KiB (0: one descriptor per WRITE)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="tc netem delay on each host (if the kernel has it)")
    ap.add_argument("--ucx-tls", default="tcp,self")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.role == "receiver":
        return receiver(args.addr, max(sizes))
    if args.role == "sender":
        rows = sender(args.addr, sizes, args.iters, args.warmup, args.desc_kib)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import multihost
    if reason := multihost.available():
        sys.exit(f"cannot build the namespaces: {reason}")
    env = {"UCX_TLS": args.ucx_tls, "UCX_NET_DEVICES": "eth0", "PYTHONPATH": str(ROOT)}
    me = [sys.executable, str(Path(__file__).resolve()), "--sizes", args.sizes, "--iters", str(args.iters),
          "--warmup", str(args.warmup), "--desc-kib", str(args.desc_kib)]
    with multihost.Topology(("a", "b"), delay_ms=args.delay_ms or None) as net:
        a, b = net.host("a"), net.host("b")
        recv = b.popen([*me, "--role", "receiver", "--addr", b.addr], label="receiver", env=env)
        rows_file = net.log_dir / "rows.json"
        send = a.popen([*me, "--role", "sender", "--addr", b.addr, "--json", str(rows_file)], label="sender", env=env)
        try:
            send.wait(1800)
        except subprocess.TimeoutExpired:
            send.kill()
        try:
            recv_rc = recv.wait(30)
        except subprocess.TimeoutExpired:
            recv_rc = None  # the topology's teardown kills it
        if send.returncode != 0 or not rows_file.exists():
            multihost.print_logs(net)
            sys.exit(f"sender exited {send.returncode}, receiver {recv_rc}")
        rows = json.loads(rows_file.read_text())
        delay = f"{args.delay_ms:g} ms netem" if args.delay_ms and not net.delay_error else "no delay"
    print(f"\nNIXL WRITE a -> b over UCX {args.ucx_tls} vs raw TCP, two network namespaces ({delay}); "
          f"medians of {args.iters}")
    print(f"{'bytes':>10} {'descs':>6} {'nixl GB/s':>10} {'tcp GB/s':>9} {'ratio':>6} {'nixl ms':>9} {'tcp ms':>9}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['descriptors']:>6} {r['nixl_gbps']:>10.3f} {r['tcp_gbps']:>9.3f} {r['ratio']:>6.2f} "
              f"{r['nixl_ms']:>9.2f} {r['tcp_ms']:>9.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ucx_tls": args.ucx_tls, "delay": delay, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
