"""Where engine processes run: `baton up` gives each prefill and decode process cores of its own
when there is one for every engine thread (`engine_cpus`), and a worker keeps every thread of
its process on `worker.cpus`; a CPU list that does not parse or names CPUs the process may not
use is a configuration error."""
import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from baton import cli
from baton.shared import config
from baton.shared.config import ConfigError, cpu_ids
from baton.up import engine_cpus

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("prefill, decode, threads, cpus, want", [
    (1, 1, 1, [0, 1], ["0", "1"]),
    (1, 1, 1, [0, 1, 2, 3], ["0", "3"]),  # decode from the top, prefill from the bottom
    (2, 2, 1, [0, 1, 2, 3], ["0", "1", "3", "2"]),
    (1, 1, 2, [0, 1, 2, 3], ["0,1", "2,3"]),
    (1, 1, 2, [2, 5, 7, 9], ["2,5", "7,9"]),  # the CPUs this process may use, not 0..n
    (1, 1, 1, [0], None),  # not a core for each engine: the OS places them
    (1, 2, 1, [0, 1], None),
    (1, 1, 2, [0, 1, 2], None),
    (1, 1, 0, [0, 1], None),
])
def test_engines_get_disjoint_runs_of_cores(prefill, decode, threads, cpus, want):
    assert engine_cpus(prefill, decode, threads, cpus) == want


def test_baton_up_places_engines_unless_told_not_to_or_given_cpus():
    args = Namespace(prefill=1, decode=1, threads=1, engine_cpus="auto", cpus="")
    assert cli.up_engine_cpus(args) == engine_cpus(1, 1, 1)
    assert cli.up_engine_cpus(Namespace(**{**vars(args), "engine_cpus": "none"})) is None
    assert cli.up_engine_cpus(Namespace(**{**vars(args), "cpus": "0"})) is None  # worker.cpus set by hand wins


@pytest.mark.parametrize("text, ids", [("", set()), ("3", {3}), ("0-2", {0, 1, 2}), ("0,2-3", {0, 2, 3}),
                                       (" 1, 4 ", {1, 4})])
def test_cpu_lists_parse_as_linux_writes_them(text, ids):
    assert cpu_ids(text) == ids


@pytest.mark.parametrize("text", ["x", "3-1", "1-", "-1", "0;1"])
def test_a_bad_cpu_list_names_the_key(text):
    with pytest.raises(ConfigError, match="worker.cpus: not a CPU list"):
        config.load(env={"BATON_WORKER_CPUS": text})


PLACE = """
import json, os, sys, threading
from baton.services.worker import use_cpus
from baton.shared.config import ConfigError, WorkerSection
started, stop = threading.Event(), threading.Event()
before = threading.Thread(target=lambda: (started.set(), stop.wait()))
before.start(); started.wait()
try:
    use_cpus(WorkerSection(cpus=sys.argv[1]))
except ConfigError as exc:
    print(json.dumps({"error": str(exc)})); stop.set(); sys.exit(0)
after = threading.Thread(target=stop.wait); after.start()
print(json.dumps({t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}))
stop.set()
"""


def place(cpus: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PLACE, cpus], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_worker_keeps_every_thread_on_its_cpus():
    """Threads that ran before the worker placed itself, and ones started after, all on worker.cpus."""
    cpu = min(os.sched_getaffinity(0))
    threads = place(str(cpu))
    assert len(threads) >= 3 and all(ids == [cpu] for ids in threads.values()), threads


def test_cpus_the_process_may_not_use_are_refused():
    outside = max(os.sched_getaffinity(0)) + 1
    assert "worker.cpus: %d names CPUs this process may not run on" % outside in place(str(outside))["error"]
