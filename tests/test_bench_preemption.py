"""bench/preemption.py's accounting of a scheduler trace (pure logic, on made-up switches)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PREEMPTION = Path(__file__).resolve().parents[1] / "bench" / "preemption.py"
ENGINE, LOOP, OTHER = 10, 11, 20


@pytest.fixture(scope="module")
def pre():
    spec = importlib.util.spec_from_file_location("bench_preemption", PREEMPTION)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_tracefs_line_becomes_a_switch(pre):
    lines = [
        "          python-30670   [000] d..2. 40758.533435: sched_switch: prev_comm=python prev_pid=30670 "
        "prev_prio=120 prev_state=R+ ==> next_comm=python next_pid=30614 next_prio=120",
        "          <idle>-0       [001] d..2. 40695.273856: sched_switch: prev_comm=swapper/1 prev_pid=0 "
        "prev_prio=120 prev_state=S ==> next_comm=rcu_preempt next_pid=15 next_prio=120",
        "          <idle>-0       [001] dNH2. 40695.273848: sched_wakeup: comm=rcu_preempt pid=15 prio=120 target_cpu=001",
    ]
    assert list(pre.parse(lines)) == [pre.Switch(40758.533435, 0, 30670, True, 30614),
                                      pre.Switch(40695.273856, 1, 0, False, 15)]


def test_time_on_the_cpu_waiting_and_who_ran_instead(pre):
    S = pre.Switch
    switches = [S(0.0, 0, 0, False, ENGINE), S(0.0, 1, 0, False, OTHER),
                S(1.0, 0, ENGINE, True, LOOP),      # preempted by its loop on CPU 0
                S(1.5, 0, LOOP, False, ENGINE),     # back after 0.5 s
                S(2.0, 1, OTHER, False, 0),
                S(2.5, 0, ENGINE, True, OTHER),     # preempted again ...
                S(2.75, 1, 0, False, ENGINE),       # ... and resumed on CPU 1: the wait ends there
                S(3.0, 1, ENGINE, False, 0), S(3.0, 0, OTHER, False, 0)]
    times, per_cpu, window = pre.account(switches, {ENGINE})
    t = times[ENGINE]
    assert (t.on_cpu_s, t.waiting_s, t.preemptions) == (pytest.approx(2.25), pytest.approx(0.75), 2)
    assert dict(t.instead) == {LOOP: pytest.approx(0.5), OTHER: pytest.approx(0.25)}  # counted on the CPU it left
    assert per_cpu[0] == {ENGINE: pytest.approx(2.0), LOOP: pytest.approx(0.5), OTHER: pytest.approx(0.5)}
    assert per_cpu[1] == {OTHER: pytest.approx(2.0), 0: pytest.approx(0.75), ENGINE: pytest.approx(0.25)}
    assert window == pytest.approx(3.0)


def test_the_engine_thread_is_the_busiest_of_each_engine_process(pre, monkeypatch):
    threads = {100: ("prefill", 100), 101: ("prefill", 100), 102: ("prefill", 100),
               200: ("decode", 200), 201: ("decode", 200), 300: ("router", 300)}
    ticks = {100: 50, 101: 400, 102: 10, 200: 900, 201: 30, 300: 5000}
    monkeypatch.setattr(pre, "cpu_ticks", lambda pid, tid: ticks[tid])
    assert pre.engine_threads(threads, {101: 390}) == {100, 200}  # 101 used 10 ticks in the window
    assert pre.name(100, threads, {100}) == "prefill engine 100"
    assert pre.name(101, threads, {100}) == "prefill thread 101"
    assert pre.name(300, threads, set()) == "router main 300"
    assert pre.name(0, threads, set()) == "idle"
