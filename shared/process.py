"""Child processes: ones that die with their parent (also when it is killed with SIGKILL), their
environment, and stopping one politely."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HUGEPAGE_MALLOC = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: malloc's heap and mmaps madvised for THP


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` (Linux; None elsewhere): the kernel sends the child
    SIGKILL when the parent dies. The kernel fires it when the *thread* that forked exits, so call
    Popen from a thread that lives as long as the process (`baton up` spawns from its main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: no signal would ever come
            os._exit(1)
    return preexec


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a Baton process we start: glibc's malloc asks for transparent huge pages for what
    it takes (where THP is `madvise` or `always`), so the engine's weights and small tensors sit on
    2 MiB pages rather than 4 KiB ones: a decode step 1.5-3% faster in paired processes, the same
    RSS (bench/malloc_pages.py; docs/benchmarks.md, stop 53). glibc reads it at start-up only, so
    it is set before the child runs; a `glibc.malloc.hugetlb` the caller chose is kept, and a
    glibc without the tunable (< 2.35) or another libc ignores it."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGEPAGE_MALLOC}" if tunables else HUGEPAGE_MALLOC}


def as_child_env() -> None:
    """Start this process again (same PID, same argv) under `child_env` unless it already runs so:
    for a bench whose in-process baseline must get the malloc the services it compares with get."""
    env = child_env(dict(os.environ))
    if env != dict(os.environ):
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def stop(process: subprocess.Popen, grace_s: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`; returns the exit code once it exited."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
