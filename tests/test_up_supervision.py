"""`baton up` as a user runs it, supervising its children: a decode killed -9 under load is restarted
while the other keeps serving (replies exact); a crash loop is given up on with a clear message;
SIGKILL of `baton up` leaves no process behind, the nats-server included."""
from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.config import cpu_ids
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared import wake_latency
from baton.shared.process import stop
from baton.up import engine_cpus
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import print_logs, until, until_sync, worker_loads

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
WORKER_FLAGS = ["--threads", "1", "--num-pages", "512", "--num-slots", "16"]


@dataclass
class Up:
    proc: subprocess.Popen
    log_dir: Path
    lines: queue.Queue
    output: list[str] = field(default_factory=list)
    nats_url: str = ""

    def wait_for(self, pattern: str, timeout_s: float) -> str:
        """The first line of `baton up`'s output from now on that matches `pattern`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout_s:g} s: {self.output}")
            self.output.append(line)
            if re.search(pattern, line):
                return line

    def read_all(self) -> str:
        """Everything it printed, once it exited."""
        self.proc.wait(60)
        with contextlib.suppress(queue.Empty):
            while True:
                self.output.append(self.lines.get(timeout=5))
        return "".join(self.output)


@contextlib.contextmanager
def baton_up(tmp: Path, *flags: str, env: dict[str, str] = {}):
    env = {**os.environ, "BATON_STATE": str(tmp / "up.json"), **env}
    proc = subprocess.Popen([sys.executable, "-m", "baton", "up", "--no-auth", "--log-dir", str(tmp / "logs"),
                             *WORKER_FLAGS, *flags], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    up = Up(proc, tmp / "logs", lines)
    try:
        up.nats_url = re.search(r"baton ready: (\S+)", up.wait_for("^baton ready:", 300)).group(1)
        yield up
    except BaseException:
        print("".join(up.output))
        print_logs(str(up.log_dir))
        raise
    finally:
        stop(proc, grace_s=60)


def stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name: [state, ppid, ...] (fields 3 on)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def descendants(pid: int) -> dict[int, str]:
    """Live processes below `pid` (its children, theirs, ...): pid -> command line. `baton up`'s
    workers are its launcher's children (baton/launcher.py)."""
    parent, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            state, ppid = stat_fields(entry.name)[:2]
            if entry.name.isdigit() and state != "Z":
                parent[int(entry.name)] = int(ppid)
                cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    found, below = {}, [pid]
    while below:
        above = below.pop()
        for child in [p for p, pp in parent.items() if pp == above]:
            found[child] = cmdline[child]
            below.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def prompts(count: int) -> list[list[int]]:
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    return [heldout_prompts(tok, 1, 40, seed=seed)[0] for seed in range(count)]


async def answer(bus: Bus, prompt: list[int], max_tokens: int):
    """(token ids, text, finish reason), or the BatonError. Past end of text (ignore_eos), so a
    request runs its max_tokens and a kill can land while it decodes."""
    try:
        reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=prompt, max_tokens=max_tokens,
                                                                     ignore_eos=True), GenerateReply, timeout=180)
    except BatonError as exc:
        return exc
    return reply.token_ids, reply.text, reply.finish_reason


async def decodes(url: str) -> dict[str, tuple]:
    return {wid: load for wid, load in (await worker_loads(url)).items() if load[0] == "decode"}


LOADED = pytest.mark.parametrize("busy", [0, 2], ids=["idle", "loaded"])


@contextlib.contextmanager
def busy_loops(count: int):
    """`count` processes spinning on a core each (a loaded machine), killed on exit."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@LOADED
def test_one_of_two_decodes_killed_is_restarted_and_no_request_is_lost(tmp_path, busy):
    with busy_loops(busy), baton_up(tmp_path, "--decode", "2") as up:
        async def run():
            async with await Bus.connect(up.nats_url, "test") as bus:
                batch = prompts(8)
                before = await asyncio.gather(*(answer(bus, p, 600) for p in batch))
                assert all(isinstance(r, tuple) for r in before), before
                old = set(await decodes(up.nats_url))
                during = [asyncio.create_task(answer(bus, p, 600)) for p in batch]
                await until(lambda: _all_active(up.nats_url), 60, "both decodes decoding")
                os.kill(next(pid for pid, cmd in descendants(up.proc.pid).items() if "serve decode" in cmd), signal.SIGKILL)
                started = time.monotonic()
                assert await asyncio.gather(*during) == before  # whole replies, finish reasons too
                await until(lambda: _replaced(up.nats_url, old), 60, "the killed decode registered again")
                print(f"the killed decode was back {time.monotonic() - started:.1f} s after the kill")
                assert await asyncio.gather(*(answer(bus, p, 600) for p in batch)) == before
        asyncio.run(run())
        assert up.proc.poll() is None
        slot = up.wait_for(r"decode-\d exited \(signal SIGKILL\); restarting in 0.5 s", 5).split()[1]
        up.wait_for(f"{slot} restarted", 5)


async def _all_active(url: str) -> bool:
    return all(load[5] > 0 for load in (await decodes(url)).values())


async def _replaced(url: str, old: set[str]) -> bool:
    """One of the `old` decode ids is gone and a new one took its place."""
    now = set(await decodes(url))
    return len(now) == 2 and len(now & old) == 1


@LOADED
def test_sigkill_of_baton_up_leaves_no_process(tmp_path, busy):
    with busy_loops(busy), baton_up(tmp_path) as up:
        kids = descendants(up.proc.pid)
        assert any("nats-server" in cmd for cmd in kids.values()), kids
        assert sum("baton serve" in cmd for cmd in kids.values()) == 4, kids
        assert sum("baton.launcher" in cmd for cmd in kids.values()) == 1, kids
        os.kill(up.proc.pid, signal.SIGKILL)
        try:
            until_sync(lambda: not any(alive(pid) for pid in kids), 30, f"every child of baton up gone: {kids}",
                       every_s=0.05)
        finally:  # what a failure left behind
            for pid in filter(alive, kids):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("fork_workers", ["true", "false"])
def test_the_workers_are_forked_from_a_launcher_unless_told_otherwise_and_the_light_services_never_load_torch(
        tmp_path, fork_workers):
    """`up.fork_workers` (baton/launcher.py): prefill and decode are the children of one launcher
    that imported torch once, or each a fresh child of `baton up`; the router and the registry
    always start fresh, so they never have torch in memory."""
    with baton_up(tmp_path, env={"BATON_UP_FORK_WORKERS": fork_workers}) as up:
        kids = descendants(up.proc.pid)
        roles = {role: pid for pid, cmd in kids.items() for role in ("prefill", "decode", "router", "registry")
                 if f"baton serve {role}" in cmd}
        launchers = [pid for pid, cmd in kids.items() if "baton.launcher" in cmd]
        workers_parent = launchers[0] if fork_workers == "true" else up.proc.pid
        assert len(launchers) == (fork_workers == "true")
        assert {role: parent_of(pid) for role, pid in roles.items()} == {
            "prefill": workers_parent, "decode": workers_parent, "router": up.proc.pid, "registry": up.proc.pid}
        assert {role: "libtorch" in Path(f"/proc/{pid}/maps").read_text() for role, pid in roles.items()} == {
            "prefill": True, "decode": True, "router": False, "registry": False}


def parent_of(pid: int) -> int:
    return int(stat_fields(pid)[1])


def cpus_of(pid: int) -> set[frozenset[int]]:
    """The CPUs (`Cpus_allowed_list`) of each thread of process `pid`, one set per distinct list."""
    return {frozenset(cpu_ids(re.search(r"Cpus_allowed_list:\s*(\S+)", (task / "status").read_text()).group(1)))
            for task in Path(f"/proc/{pid}/task").iterdir()}


def holds_wake_latency(pid: int) -> bool:
    """Whether process `pid` has the PM QoS device open (`shared/wake_latency.py`)."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd) == str(wake_latency.CPU_LATENCY_QOS) for fd in fds.iterdir())


def test_baton_up_gives_each_engine_its_own_cores_hugepage_malloc_and_the_wake_latency_asked(tmp_path):
    """Every service starts with glibc's malloc on huge pages (child_env). Where there is a core
    for each engine thread (here 1 thread each), prefill runs on the lowest and decode on the
    highest, every thread of each; the other services run anywhere. --cpu-wake-latency-us 0:
    each engine holds the PM QoS request open (where this user may; else each says it could not)."""
    want = engine_cpus(1, 1, 1)
    anywhere = {frozenset(os.sched_getaffinity(0))}
    with baton_up(tmp_path, "--cpu-wake-latency-us", "0") as up:
        ready = "".join(line for line in up.output if line.startswith("baton ready:"))
        kids = descendants(up.proc.pid)
        roles = {role: pid for pid, cmd in kids.items() for role in ("prefill", "decode", "router", "registry")
                 if f"baton serve {role}" in cmd}
        for role, pid in roles.items():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ, role
        may = os.access(wake_latency.CPU_LATENCY_QOS, os.W_OK)
        assert {role: holds_wake_latency(pid) for role, pid in roles.items()} == {
            "prefill": may, "decode": may, "router": False, "registry": False}
        if not may:
            logs = "".join(f.read_text() for f in up.log_dir.glob("*.log"))
            assert logs.count("cpu_wake_latency_us 0 not applied") == 2, logs
        if want is None:  # a single core: the OS places them
            assert "engines on CPUs" not in ready, ready
            assert all(cpus_of(pid) == anywhere for pid in roles.values())
            return
        assert f"engines on CPUs: prefill {want[0]}, decode {want[1]};" in ready, ready
        assert cpus_of(roles["prefill"]) == {frozenset(cpu_ids(want[0]))}
        assert cpus_of(roles["decode"]) == {frozenset(cpu_ids(want[1]))}
        assert cpus_of(roles["router"]) == cpus_of(roles["registry"]) == anywhere


def test_a_service_crashing_in_a_loop_is_given_up_on(tmp_path):
    with baton_up(tmp_path) as up:  # the only decode, killed each time it comes back
        seen, killed = {}, set()
        deadline = time.monotonic() + 240
        while up.proc.poll() is None:
            assert time.monotonic() < deadline, f"baton up still running after {len(killed)} kills"
            seen |= descendants(up.proc.pid)
            for pid, cmd in seen.items():
                if "serve decode" in cmd and pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            assert len(killed) <= 6, "still restarting after its 6th exit"
            time.sleep(0.05)
        output = up.read_all()
        assert up.proc.returncode == 1, output
        assert len(killed) == 6, killed
        assert "giving up on decode-2: it exited 6 times within 60 s (last: signal SIGKILL)" in output, output
        assert "no decode left (given up on)" in output, output
        until_sync(lambda: not any(alive(pid) for pid in seen), 30, f"every child of baton up gone: {seen}",
                   every_s=0.05)
