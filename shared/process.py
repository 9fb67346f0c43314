"""Child processes that die with their parent, also when the parent is killed with SIGKILL."""
from __future__ import annotations

import ctypes
import os
import signal
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
