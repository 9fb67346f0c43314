"""Child processes: ones that die with their parent (also when it is killed with SIGKILL), and
stopping one politely."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
