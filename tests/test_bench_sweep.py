"""bench/sweep.py's rounds: which system goes first alternates, and the ratio table reads each
round's disaggregated / aggregated tok/s per level (pure logic, on made-up results)."""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SWEEP = Path(__file__).resolve().parents[1] / "bench" / "sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("bench_sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result(**tok_s: float) -> dict:
    return {"runs": [{"name": level.replace("c", "c="), "summary": {"output_tokens_per_s": v}}
                     for level, v in tok_s.items()]}


def test_ratios_per_level_and_round_with_their_median(sweep):
    rounds = [{"disaggregated": result(c1=90.0, c16=300.0), "aggregated": result(c1=100.0, c16=200.0)},
              {"disaggregated": result(c1=110.0, c16=330.0), "aggregated": result(c1=100.0, c16=300.0)},
              {"disaggregated": result(c1=95.0, c16=240.0), "aggregated": result(c1=100.0, c16=200.0)}]
    ratio = sweep.ratios(rounds)
    assert ratio == {"c=1": pytest.approx([0.9, 1.1, 0.95]), "c=16": pytest.approx([1.5, 1.1, 1.2])}
    table = sweep.format_ratios(ratio).splitlines()
    assert table[1].split()[0] == "c=1" and table[1].split()[-1] == "0.950"
    assert table[2].split()[0] == "c=16" and table[2].split()[-1] == "1.200"


def test_a_level_only_one_system_ran_has_no_ratio(sweep):
    rounds = [{"disaggregated": result(c1=90.0, c4=10.0), "aggregated": result(c1=100.0)}]
    assert sweep.ratios(rounds) == {"c=1": pytest.approx([0.9])}
    assert sweep.ratios([{"disaggregated": result(c1=90.0)}]) == {}


def test_both_systems_stay_up_and_each_level_alternates_which_goes_first(sweep, monkeypatch, tmp_path):
    started, order = [], []

    def start(name):
        @contextlib.contextmanager
        def up(args, log_dir):
            started.append(name)
            yield name
        return up

    async def bench(config):
        order.append((config.nats_url, config.concurrency))
        return result(**{f"c{config.concurrency[0]}": 1.0})
    monkeypatch.setattr(sweep, "STARTS", {"disaggregated": start("d"), "aggregated": start("a")})
    monkeypatch.setattr(sweep.loadtest, "run_bench", bench)
    args = sweep.parse_args(["--rounds", "3", "--concurrency", "1,4"])
    rounds = sweep.run_rounds(args, ["disaggregated", "aggregated"], tmp_path)
    assert started == ["d", "a"]  # once each, for the whole sweep
    assert order == [("d", [1]), ("a", [1]), ("a", [1]), ("d", [1]), ("d", [1]), ("a", [1]),
                     ("d", [4]), ("a", [4]), ("a", [4]), ("d", [4]), ("d", [4]), ("a", [4])]
    assert [list(r) for r in rounds] == [["disaggregated", "aggregated"]] * 3  # each round in the same order
    assert [run["name"] for run in rounds[2]["aggregated"]["runs"]] == ["c=1", "c=4"]  # a round holds every level
