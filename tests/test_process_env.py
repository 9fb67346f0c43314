"""The environment Baton starts its processes with (shared/process.py child_env, as_child_env)."""
import os
import subprocess
import sys

from baton.shared.process import HUGEPAGE_MALLOC, child_env


def test_child_env_turns_on_huge_page_malloc():
    assert child_env({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_child_env_keeps_the_callers_other_tunables():
    env = child_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


def test_child_env_keeps_a_hugetlb_setting_the_caller_chose():
    mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2"}
    env = child_env(mine)
    assert env == mine and env is not mine


def test_as_child_env_starts_the_process_again_under_it_with_the_same_arguments():
    script = ("import os, sys; from baton.shared.process import as_child_env; as_child_env(); "
              "print(os.getpid(), os.environ['GLIBC_TUNABLES'], sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen([sys.executable, "-c", script, "a", "b c"], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out == f"{proc.pid} {HUGEPAGE_MALLOC} ['a', 'b c']\n"  # execve: the same PID, printed once
