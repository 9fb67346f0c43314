"""Start-up time of `baton up` and resident memory per service, and which services import torch.

    python bench/startup.py --runs 3 --json out/startup.json

Each run starts `baton up` as a user would, times it to its ready line (a warm-up request has
then been answered), reads every child's VmRSS from /proc, checks /proc/PID/maps for libtorch,
and stops it with SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def describe(pid: int) -> dict:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [w.decode() for w in cmdline if w]
    role = words[words.index("serve") + 1] if "serve" in words else Path(words[0]).name
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
    torch_loaded = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    return {"role": role, "pid": pid, "rss_mb": rss_kb / 1024, "imports_torch": torch_loaded}


def one_run() -> dict:
    log_dir = tempfile.mkdtemp(prefix="baton-startup-")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "baton", "up", "--log-dir", log_dir, "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        ready_s = time.monotonic() - t0
        if "ready" not in line:
            raise RuntimeError(f"baton up did not become ready: {line!r}; logs in {log_dir}")
        services = [describe(pid) for pid in children_of(proc.pid)]
        return {"ready_s": ready_s, "services": services}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = [one_run() for _ in range(args.runs)]
    ready = [r["ready_s"] for r in runs]
    print(f"baton up -> ready: median {statistics.median(ready):.2f} s over {len(ready)} runs "
          f"(min {min(ready):.2f}, max {max(ready):.2f})")
    print(f"{'service':<14} {'RSS MB':>8} {'torch':>6}")
    for s in sorted(runs[-1]["services"], key=lambda s: s["role"]):
        print(f"{s['role']:<14} {s['rss_mb']:>8.1f} {'yes' if s['imports_torch'] else 'no':>6}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "cpu_count": os.cpu_count()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
