"""Who takes the CPU from Baton's engine threads: a scheduler trace of the running services.

    sudo python bench/preemption.py --seconds 3 --json out/preemption.json

Run it while load flows (e.g. `bench/sweep.py --systems disaggregated --concurrency 1` in another
shell). It finds this machine's Baton processes by their command line (`baton serve prefill |
decode | router | registry`, the aggregated baseline, nats-server), records the kernel's
`sched_switch` events for `--seconds` through tracefs (root only), and prints for each engine
thread (the thread of an engine process that used the most CPU in the window):
- its time on the CPU, and the time it was runnable but switched out (preempted: `prev_state` R),
- who ran on that CPU meanwhile, by service and thread (`main` is a service's event loop thread),
and each CPU's time by service. Every wake-up of another thread on an engine's core, e.g. its own
event loop publishing a chunk, shows up here as the engine's waiting time.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from baton.loadtest import write_json

TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
ENGINE_ROLES = ("prefill", "decode", "aggregated")
ROLES = (("nats-server", "nats"), ("serve prefill", "prefill"), ("serve decode", "decode"),
         ("serve router", "router"), ("serve registry", "registry"), ("services.aggregated", "aggregated"),
         ("sweep.py", "client"), ("baton bench", "client"))
SWITCH = re.compile(r"\[(\d+)\]\s.*?(\d+\.\d+): sched_switch: .*?prev_pid=(\d+) .*?prev_state=(\S+) ==> "
                    r".*?next_pid=(\d+)")


@dataclass(frozen=True)
class Switch:
    t: float
    cpu: int
    prev: int  # thread id leaving the CPU (0: idle)
    prev_runnable: bool  # it left while still runnable (preempted), not to sleep
    next: int  # thread id taking the CPU


@dataclass
class ThreadTime:
    on_cpu_s: float = 0.0
    waiting_s: float = 0.0  # runnable but switched out
    preemptions: int = 0
    instead: Counter = field(default_factory=Counter)  # thread id -> seconds it ran on our CPU while we waited


def parse(lines: Iterable[str]) -> Iterator[Switch]:
    """The sched_switch events of a tracefs `trace` text."""
    for line in lines:
        if m := SWITCH.search(line):
            cpu, t, prev, state, nxt = m.groups()
            yield Switch(float(t), int(cpu), int(prev), state.startswith("R"), int(nxt))


def account(switches: Iterable[Switch], watched: set[int]) -> tuple[dict[int, ThreadTime], dict[int, Counter], float]:
    """Per watched thread its ThreadTime; per CPU the seconds each thread ran; the window's length.
    A watched thread's wait runs from its preemption until it runs again (on any CPU); what ran
    meanwhile is counted on the CPU it was preempted on."""
    times = {tid: ThreadTime() for tid in watched}
    per_cpu: dict[int, Counter] = defaultdict(Counter)
    running: dict[int, tuple[int, float]] = {}  # cpu -> (thread, since)
    waiting: dict[int, tuple[int, float]] = {}  # watched thread -> (cpu it left, since)
    first = last = None
    for s in switches:
        first, last = first if first is not None else s.t, s.t
        if s.cpu in running:
            tid, since = running[s.cpu]
            per_cpu[s.cpu][tid] += s.t - since
            if tid in times:
                times[tid].on_cpu_s += s.t - since
            for w, (cpu, waited_since) in waiting.items():
                if cpu == s.cpu and tid != w:
                    times[w].instead[tid] += s.t - max(since, waited_since)
        if s.prev in times and s.prev_runnable:
            waiting[s.prev] = (s.cpu, s.t)
            times[s.prev].preemptions += 1
        if s.next in waiting:
            cpu, waited_since = waiting.pop(s.next)
            times[s.next].waiting_s += s.t - waited_since
            if cpu != s.cpu and cpu in running:  # resumed elsewhere: the part of the run it waited through
                runner, run_since = running[cpu]
                times[s.next].instead[runner] += s.t - max(run_since, waited_since)
        running[s.cpu] = (s.next, s.t)
    return times, per_cpu, (last - first) if first is not None else 0.0


def discover() -> dict[int, tuple[str, int]]:
    """Thread id -> (role, process id) for this machine's Baton services and nats-server."""
    threads = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            tids = [int(t.name) for t in (proc / "task").iterdir()]
        except OSError:
            continue
        role = next((r for key, r in ROLES if key in cmdline), None)
        if role is not None:
            threads.update({tid: (role, int(proc.name)) for tid in tids})
    return threads


def cpu_ticks(pid: int, tid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def engine_threads(threads: dict[int, tuple[str, int]], before: dict[int, int]) -> set[int]:
    """Per engine process, the thread that used the most CPU since `before`."""
    best: dict[int, tuple[int, int]] = {}
    for tid, (role, pid) in threads.items():
        if role in ENGINE_ROLES:
            used = cpu_ticks(pid, tid) - before.get(tid, 0)
            if pid not in best or used > best[pid][0]:
                best[pid] = (used, tid)
    return {tid for _, tid in best.values()}


def tracefs() -> Path:
    for path in TRACEFS:
        if (path / "trace").exists():
            return path
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS[0])], check=False, capture_output=True)
        if (TRACEFS[0] / "trace").exists():
            return TRACEFS[0]
    sys.exit("bench/preemption.py: needs tracefs (run as root; it mounts /sys/kernel/tracing if missing)")


def record(seconds: float, buffer_kb: int) -> list[str]:
    """`seconds` of sched_switch events, with the tracer's previous state restored after."""
    fs = tracefs()
    event, on = fs / "events/sched/sched_switch/enable", fs / "tracing_on"
    saved = {p: p.read_text().split()[0] for p in (event, on, fs / "buffer_size_kb")}  # "7 (expanded: 1408)"
    try:
        on.write_text("0")
        (fs / "buffer_size_kb").write_text(str(buffer_kb))
        (fs / "trace").write_text("")
        event.write_text("1")
        on.write_text("1")
        time.sleep(seconds)
        on.write_text("0")
        return (fs / "trace").read_text().splitlines()
    finally:
        for path, value in saved.items():
            path.write_text(value)


def name(tid: int, threads: dict[int, tuple[str, int]], engines: set[int]) -> str:
    if tid == 0:
        return "idle"
    role, pid = threads.get(tid, ("other", -1))
    kind = "engine" if tid in engines else "main" if tid == pid else "thread"
    return f"{role} {kind} {tid}" if role != "other" else f"other {tid}"


def report(times: dict[int, ThreadTime], per_cpu: dict[int, Counter], window: float,
           threads: dict[int, tuple[str, int]], engines: set[int], top: int) -> dict:
    out = {"window_s": round(window, 3), "engines": [], "cpus": {}}
    for tid, tt in sorted(times.items(), key=lambda kv: threads[kv[0]][0]):
        instead = [{"thread": name(t, threads, engines), "ms": round(s * 1000, 2)}
                   for t, s in tt.instead.most_common(top)]
        out["engines"].append({"thread": name(tid, threads, engines), "on_cpu_ms": round(tt.on_cpu_s * 1000, 1),
                               "waiting_ms": round(tt.waiting_s * 1000, 1), "preemptions": tt.preemptions,
                               "ran_instead": instead})
    for cpu, counter in sorted(per_cpu.items()):
        by_role: Counter = Counter()
        for tid, s in counter.items():
            by_role["idle" if tid == 0 else threads.get(tid, ("other", -1))[0]] += s
        out["cpus"][cpu] = {role: round(s * 1000, 1) for role, s in by_role.most_common()}
    return out


def print_report(out: dict) -> None:
    print(f"window {out['window_s']:.3f} s")
    print(f"{'engine thread':<28} {'on CPU ms':>10} {'waiting ms':>11} {'preempted':>10}   ran instead (ms)")
    for e in out["engines"]:
        instead = ", ".join(f"{i['thread']} {i['ms']:.1f}" for i in e["ran_instead"])
        print(f"{e['thread']:<28} {e['on_cpu_ms']:>10.1f} {e['waiting_ms']:>11.1f} {e['preemptions']:>10}   {instead}")
    for cpu, roles in out["cpus"].items():
        print(f"cpu {cpu}: " + ", ".join(f"{role} {ms:.1f} ms" for role, ms in roles.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--top", type=int, default=5, help="threads listed as running instead, per engine thread")
    ap.add_argument("--buffer-kb", type=int, default=20000, help="tracefs buffer per CPU")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    threads = discover()
    if not any(role in ENGINE_ROLES for role, _ in threads.values()):
        sys.exit("bench/preemption.py: no Baton engine process (prefill, decode, aggregated) runs on this machine")
    before = {tid: cpu_ticks(pid, tid) for tid, (_, pid) in threads.items()}
    lines = record(args.seconds, args.buffer_kb)
    engines = engine_threads(threads, before)
    times, per_cpu, window = account(parse(lines), engines)
    out = report(times, per_cpu, window, threads, engines, args.top)
    print_report(out)
    if args.json:
        write_json(out, args.json)


if __name__ == "__main__":
    main()
