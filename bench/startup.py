"""Start-up time of `baton up` and resident memory per service, which services import torch, and
what forking the workers from a launcher (`up.fork_workers`, baton/launcher.py) saves against
starting each as a fresh process, measured in the same run.

    python bench/startup.py --runs 3 --json out/startup.json

Each run starts `baton up` as a user would, once with each setting (alternating which goes
first), times it to its ready line (a warm-up request has then been answered), reads every
process below it (the launcher's children too) from /proc: VmRSS, PSS (its shared pages split
among the processes that share them: the launcher's with the workers it forked), libtorch in its
maps, and the CPU it has used (utime + stime), then kills one decode with SIGKILL and times `baton up`'s
restart of it, from the kill to the restarted decode's "registered as" line in its log (its
supervisor waits 0.5 s before a first restart); then stops it with SIGTERM.
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


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return children + [p for child in children for p in descendants(child)]


def describe(pid: int) -> dict:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [w.decode() for w in cmdline if w.strip()]
    role = (words[words.index("serve") + 1] if "serve" in words else
            words[words.index("-m") + 1] if "-m" in words else Path(words[0]).name)
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
    pss_kb = int(re.search(r"Pss:\s+(\d+)", Path(f"/proc/{pid}/smaps_rollup").read_text()).group(1))
    torch_loaded = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime (fields 14, 15)
    return {"role": role, "pid": pid, "rss_mb": rss_kb / 1024, "pss_mb": pss_kb / 1024, "imports_torch": torch_loaded,
            "cpu_s": cpu_s}


def one_run(fork_workers: bool) -> dict:
    log_dir = tempfile.mkdtemp(prefix="baton-startup-")
    env = {**os.environ, "BATON_UP_FORK_WORKERS": "true" if fork_workers else "false"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "baton", "up", "--log-dir", log_dir, "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        ready_s = time.monotonic() - t0
        if "ready" not in line:
            raise RuntimeError(f"baton up did not become ready: {line!r}; logs in {log_dir}")
        services = [describe(pid) for pid in descendants(proc.pid)]
        return {"fork_workers": fork_workers, "ready_s": ready_s, "services": services,
                "restart_s": restart(services, Path(log_dir))}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def restart(services: list[dict], log_dir: Path, timeout_s: float = 60.0) -> float:
    """SIGKILL the decode; seconds until its restart logged "registered as"."""
    log = next(log_dir.glob("decode-*.log"))
    before = log.read_text().count("registered as")
    os.kill(next(s["pid"] for s in services if s["role"] == "decode"), signal.SIGKILL)
    t0 = time.monotonic()
    while log.read_text().count("registered as") == before:
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the killed decode was not registered again within {timeout_s:g} s; see {log}")
        time.sleep(0.01)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = [one_run(fork) for i in range(args.runs) for fork in ((True, False) if i % 2 == 0 else (False, True))]
    for fork in (True, False):
        mine = [r for r in runs if r["fork_workers"] == fork]
        ready, restarts = [r["ready_s"] for r in mine], [r["restart_s"] for r in mine]
        cpu = [sum(s["cpu_s"] for s in r["services"]) for r in mine]
        print(f"\nup.fork_workers = {str(fork).lower()}, {len(mine)} runs: ready in {_spread(ready)} s; "
              f"CPU of every process at ready {_spread(cpu)} s; a killed decode registered again {_spread(restarts)} s "
              "after the kill")
        print(f"{'process':<38} {'RSS MB':>8} {'PSS MB':>8} {'torch':>6} {'CPU s':>6}")
        for s in sorted(mine[-1]["services"], key=lambda s: s["role"]):
            print(f"{s['role']:<38} {s['rss_mb']:>8.1f} {s['pss_mb']:>8.1f} {'yes' if s['imports_torch'] else 'no':>6} "
                  f"{s['cpu_s']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "cpu_count": os.cpu_count()}, indent=2) + "\n")


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


if __name__ == "__main__":
    main()
