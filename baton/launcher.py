"""Start Baton's worker processes by forking one that has imported them already.

A prefill or decode worker started as `python -m baton serve <role>` spends ~1.5 s of CPU importing
torch, nats-py and Baton before it does anything of its own (docs/benchmarks.md, stop 63): `baton
up` paid it for every worker and again for every restart. `Launcher` starts `python -m
baton.launcher` once; that process imports them and then forks a worker per request, so a
restarted decode is registered again in about a second instead of 2.5-3.5 s. (The router and the
registry never load torch; `baton up` starts them fresh, so they stay small.)

Each service still is its own process, as `python -m baton serve` would make it: its own session,
its own log file on stdout and stderr, its own environment, and a process title that reads as its
command line (`ps`). It is killed by the kernel when the launcher dies, which is killed when its
client dies (PR_SET_PDEATHSIG both times); a launcher its client closes exits, and what it
started with it. `LaunchedProcess` answers as `subprocess.Popen` does (`poll`, `wait`, `send_signal`,
`returncode`): the launcher reaps its children and reports each exit status.

Protocol, one JSON object per line: the client writes `{"argv", "env", "log", "append"}`; the
launcher answers `{"pid", "args"}` (or `{"error"}`) and, whenever a child ends, `{"exited", "code"}` (the
code as `Popen.returncode` gives it: negative for a signal).

Only the environment a service reads while it runs differs between its forks: what a library
reads as it is imported or loaded (glibc's malloc tunables, OpenMP's variables) is the
launcher's. So one launcher serves one environment: `baton up` starts one for its cluster, the
tests one per environment they start clusters in (tests/e2e_cluster.py).
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from baton.shared.process import PR_SET_PDEATHSIG, die_with_parent

PRELOADED = ("torch", "nats", "baton.cli", "baton.serve", "baton.services.worker", "baton.services.prefill.service",
             "baton.services.decode.service")
SPAWN_TIMEOUT_S = 240.0  # the first answer waits for the launcher's imports, on a loaded machine too
TITLE_ROOM = 1024  # bytes of command line the launcher keeps for its children's titles


class LauncherError(RuntimeError):
    pass


class LaunchedProcess:
    """A process the launcher forked; the part of `subprocess.Popen`'s interface Baton uses."""

    def __init__(self, launcher: "Launcher", pid: int, args: list[str]):
        self._launcher, self.pid, self.args = launcher, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._launcher.collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._launcher.collect(min(left, 0.05))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """Client side: the launcher process, started at once with `env`; it imports while the
    caller goes on, and the first `spawn` waits for that. Methods may be called from any thread."""

    def __init__(self, env: dict[str, str]):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "baton.launcher", " " * TITLE_ROOM], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, start_new_session=True, preexec_fn=die_with_parent())
        self._lock = threading.Lock()
        self._buffer = b""
        self._answers: deque[dict] = deque()
        self._children: dict[int, LaunchedProcess] = {}

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, append: bool = False) -> LaunchedProcess:
        """`baton <argv>` in a new process of its own, stdout and stderr to `log`."""
        request = json.dumps({"argv": argv, "env": env, "log": str(log), "append": append}) + "\n"
        with self._lock:
            try:
                self._proc.stdin.write(request.encode())
                self._proc.stdin.flush()
            except OSError as exc:
                raise LauncherError(f"the launcher is gone (exit code {self._proc.poll()}): {exc}") from None
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while not self._answers:
                if self._proc.stdout.closed or time.monotonic() > deadline:
                    raise LauncherError(f"the launcher did not start `baton {' '.join(argv[:2])}` "
                                        f"(exit code {self._proc.poll()})")
                self._read(deadline - time.monotonic())
            answer = self._answers.popleft()
        if "error" in answer:
            raise LauncherError(answer["error"])
        return self._children[answer["pid"]]

    def collect(self, timeout_s: float) -> None:
        """Take the exits the launcher reported, waiting up to `timeout_s` for one."""
        with self._lock:
            self._read(timeout_s)

    def close(self, grace_s: float = 10.0) -> None:
        """End the launcher; a child still running is killed with it."""
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        with self._lock:
            while not self._proc.stdout.closed:
                self._read(1.0)

    def _read(self, timeout_s: float) -> None:
        """Lock held: what the launcher wrote by `timeout_s`. At its end every child left is dead
        too (the kernel killed it with the launcher): each gets SIGKILL's return code."""
        stdout = self._proc.stdout
        if stdout.closed or not select.select([stdout], [], [], max(0.0, timeout_s))[0]:
            return
        data = os.read(stdout.fileno(), 65536)
        if not data:
            stdout.close()
            for child in self._children.values():
                if child.returncode is None:
                    child.returncode = -signal.SIGKILL
            return
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            self._on_message(json.loads(line))

    def _on_message(self, message: dict) -> None:
        if "exited" in message:
            child = self._children.get(message["exited"])
            if child is not None:
                child.returncode = message["code"]
            return
        if "pid" in message:
            self._children[message["pid"]] = LaunchedProcess(self, message["pid"], message["args"])
        self._answers.append(message)


# --- the launcher process ----------------------------------------------------------------------
def main() -> int:
    answers = os.dup(1)  # the protocol's own fd: whatever a library prints goes to stderr instead
    os.dup2(2, 1)
    for name in PRELOADED:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd turns it into a readable pipe
    children: set[int] = set()
    pending = b""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(children, answers)
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                _start(json.loads(line), children, answers, (wake_r, wake_w, answers))
    return 0  # the client closed us: the kernel kills what is left with us (PR_SET_PDEATHSIG)


def _tell(answers: int, message: dict) -> None:
    os.write(answers, json.dumps(message).encode() + b"\n")


def _reap(children: set[int], answers: int) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _tell(answers, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _start(request: dict, children: set[int], answers: int, own_fds: tuple[int, ...]) -> None:
    """Fork the service `request` names; its log is open (created) before the answer, as Popen's is."""
    args = [sys.executable, "-m", "baton", *request["argv"]]
    what = f"`baton {' '.join(request['argv'][:2])}`"
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC),
                      0o644)
    except OSError as exc:
        return _tell(answers, {"error": f"cannot open the log of {what}: {exc}"})
    launcher = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(log)
        return _tell(answers, {"error": f"cannot start {what}: {exc}"})
    if pid == 0:
        os._exit(_become(request, args, launcher, log, own_fds))
    os.close(log)
    children.add(pid)
    _tell(answers, {"pid": pid, "args": args})


def _become(request: dict, args: list[str], launcher: int, log: int, own_fds: tuple[int, ...]) -> int:
    """In the forked child of `launcher`: become the service `args` names, `log` its stdout and
    stderr; returns its exit code."""
    try:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # the launcher died before prctl: no signal would ever come
            return 1
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(source, target)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        _set_title(args)
        sys.argv = args[2:]
        from baton.cli import main as baton
        code = baton(request["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - the service's own crash, reported as Python would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr, flush=True)  # SystemExit("message"), as Python exits with it
    return 1


def _set_title(args: list[str]) -> None:
    """Write `args` over this process's command line (in the room the launcher's own last
    argument keeps), so that `ps` and /proc/<pid>/cmdline name the service, not the launcher."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48 and 49)
    text = b"\0".join(arg.encode() for arg in args)[:end - start - 1]
    ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)


if __name__ == "__main__":
    sys.exit(main())
