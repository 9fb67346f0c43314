"""The load harness's statistics and reporting, on synthetic streams of timestamps with known
answers (no processes)."""
import argparse
import dataclasses
import json
import math
import random

import numpy as np
import pytest

from baton import loadtest
from baton.loadtest import BenchConfig, LengthSpec, RequestRecord, describe, percentile, summarize

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("q,want", [(0, 1.0), (25, 1.75), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_linearly(q, want):
    assert percentile([4, 1, 3, 2], q) == pytest.approx(want)


def test_percentile_edge_cases_and_numpy_agreement():
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (1, 50, 90, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def synthetic() -> list[RequestRecord]:
    """Request i (0..4) is sent at t = i s, its first token comes after (i+1)*100 ms, then four
    more chunks of one token each (i+1)*10 ms apart. Request 5 fails with `busy`."""
    records = []
    for i in range(5):
        sent = float(i)
        arrivals = [sent + (i + 1) * 0.1 + j * (i + 1) * 0.01 for j in range(5)]
        rec = RequestRecord.from_timestamps(sent, arrivals, index=i)
        rec.spec = {"verify_steps": 2, "drafted": 6, "accepted": 3}
        records.append(rec)
    records.append(RequestRecord(index=5, sent=4.5, ended=4.6, error="busy", error_message="full"))
    return records


def test_summary_of_a_synthetic_stream_has_the_known_percentiles():
    s = summarize(synthetic(), slo_ttft_ms=350, slo_itl_ms=25)
    # TTFT: 100, 200, 300, 400, 500 ms
    assert s["ttft_ms"]["mean"] == pytest.approx(300)
    assert s["ttft_ms"]["p50"] == pytest.approx(300)
    assert s["ttft_ms"]["p90"] == pytest.approx(460)  # h = 3.6: 400 + 0.6 * 100
    assert s["ttft_ms"]["p99"] == pytest.approx(496)  # h = 3.96
    # ITL: four gaps of 10, 20, 30, 40 and 50 ms -> 20 samples
    assert s["itl_ms"]["count"] == 20
    assert s["itl_ms"]["mean"] == pytest.approx(30)
    assert s["itl_ms"]["p50"] == pytest.approx(30)
    assert s["itl_ms"]["p90"] == pytest.approx(50)
    assert s["itl_ms"]["min"] == pytest.approx(10) and s["itl_ms"]["max"] == pytest.approx(50)
    # E2E: (i+1) * 140 ms; TPOT: (i+1) * 10 ms
    assert s["e2e_ms"]["p50"] == pytest.approx(420)
    assert s["e2e_ms"]["p90"] == pytest.approx(644)  # 560 + 0.6 * 140
    assert s["tpot_ms"]["p50"] == pytest.approx(30)
    # window: first sent (0 s) -> last ended (request 4: 4 + 0.5 + 0.2 = 4.7 s)
    assert s["duration_s"] == pytest.approx(4.7)
    assert s["output_tokens"] == 25 and s["completed"] == 5 and s["requests"] == 6
    assert s["output_tokens_per_s"] == pytest.approx(25 / 4.7)
    assert s["requests_per_s"] == pytest.approx(5 / 4.7)
    assert s["errors"] == {"busy": 1}
    # goodput: TTFT <= 350 and TPOT <= 25 -> requests 0 and 1 (request 2's TPOT is 30 ms)
    assert s["goodput"]["requests"] == 2
    assert s["goodput"]["fraction"] == pytest.approx(2 / 6)
    # acceptance length: (15 accepted + 10 verify steps) / 10
    assert s["acceptance_length"] == pytest.approx(2.5)


def test_multi_token_chunks_count_tokens_and_chunk_gaps():
    rec = RequestRecord.from_timestamps(0.0, [0.05, 0.08, 0.14], tokens=[1, 4, 3], ended=0.15)
    assert rec.output_tokens == 8
    assert rec.ttft == pytest.approx(0.05)
    assert rec.itls == pytest.approx([0.03, 0.06])
    assert rec.tpot == pytest.approx(0.09 / 7)
    assert rec.e2e == pytest.approx(0.15)


def test_goodput_without_slos_counts_every_success():
    s = summarize(synthetic())
    assert s["goodput"]["requests"] == 5


def test_empty_run_is_reported_not_crashed():
    s = summarize([])
    assert s["requests"] == 0 and math.isnan(s["ttft_ms"]["p50"]) and s["acceptance_length"] is None
    assert describe([])["count"] == 0


@pytest.mark.parametrize("text,low,high,choices", [("128", 128, 128, ()), ("64:512", 64, 512, ()),
                                                   ("32,1024", 32, 1024, (32, 1024))])
def test_length_specs(text, low, high, choices):
    spec = LengthSpec.parse(text)
    assert (spec.low, spec.high, spec.choices) == (low, high, choices)
    rng = random.Random(1)
    draws = {spec.draw(rng) for _ in range(200)}
    assert min(draws) >= low and max(draws) <= high
    if choices:
        assert draws == set(choices)
    assert str(spec) == text


@pytest.mark.parametrize("text", ["0", "9:3", "a", "1:b", ""])
def test_bad_length_specs_are_refused(text):
    with pytest.raises(ValueError):
        LengthSpec.parse(text)


def test_held_out_prompts_have_the_asked_lengths():
    prompts = loadtest.make_prompts(6, LengthSpec.parse("10:40"), LengthSpec.parse("8"), seed=3)
    assert all(10 <= p.size <= 40 and p.max_tokens == 8 for p in prompts)
    again = loadtest.make_prompts(6, LengthSpec.parse("10:40"), LengthSpec.parse("8"), seed=3)
    assert [p.token_ids for p in prompts] == [p.token_ids for p in again]


def test_prompts_file_lines_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    texts = [p.text for p in loadtest.make_prompts(3, LengthSpec.parse("1"), LengthSpec.parse("4"),
                                                   prompts_file=tmp_path / "p.txt")]
    assert texts == ["first prompt", "second prompt", "first prompt"]
    texts = [p.text for p in loadtest.make_prompts(2, LengthSpec.parse("1"), LengthSpec.parse("4"),
                                                   prompts_file=tmp_path / "p.jsonl")]
    assert texts == ["one", "two"]


def test_levels_and_validation():
    assert BenchConfig(concurrency=[1, 2, 4]).levels() == [{"rate": None, "concurrency": c} for c in (1, 2, 4)]
    assert BenchConfig(rate=[0.5, 2.0]).levels() == [{"rate": 0.5, "concurrency": None},
                                                     {"rate": 2.0, "concurrency": None}]
    assert BenchConfig(rate=[1.0], concurrency=[3]).levels() == [{"rate": 1.0, "concurrency": 3}]
    with pytest.raises(ValueError):
        BenchConfig(requests=None).validate()
    with pytest.raises(ValueError):
        BenchConfig(rate=[1.0], concurrency=[1, 2]).validate()


def test_command_line_options_map_to_the_config():
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    args = parser.parse_args(["--nats-url", "nats://127.0.0.1:1", "--concurrency", "1,2,8", "--requests", "5",
                              "--input-len", "16:64", "--max-tokens", "4,8", "--slo-ttft-ms", "200"])
    config = loadtest.config_from_args(args)
    assert config.concurrency == [1, 2, 8] and config.requests == 5 and config.input_len == "16:64"
    assert config.max_tokens == "4,8" and config.slo_ttft_ms == 200 and config.draft_tokens is None
    capped = loadtest.config_from_args(parser.parse_args(["--nats-url", "x", "--draft-tokens", "0"]))
    assert capped.draft_tokens == 0
    with pytest.raises(ValueError, match="--draft-tokens"):
        dataclasses.replace(capped, draft_tokens=17).validate()
    duration_only = loadtest.config_from_args(parser.parse_args(["--nats-url", "x", "--duration", "3"]))
    assert duration_only.requests is None and duration_only.duration_s == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--concurrency", "0,2"])


def test_report_and_strict_json(tmp_path):
    records = synthetic()
    summary = summarize(records)
    result = {"config": vars(BenchConfig()) | {"prompts_file": None}, "machine": {},
              "runs": [{"rate": None, "concurrency": c, "name": f"c={c}", "summary": summary,
                        "records": [r.as_dict() for r in records]} for c in (1, 2)]}
    report = loadtest.format_report(result)
    assert "TTFT ms" in report and "busy: 1" in report and "c=2" in report
    path = tmp_path / "out" / "bench.json"
    loadtest.write_json(result, path)
    loaded = json.loads(path.read_text())  # strict: NaN was written as null
    assert loaded["runs"][0]["summary"]["ttft_ms"]["p50"] == pytest.approx(300)
    assert "| system |" in loadtest.markdown_table({"x": result})


def test_unreachable_deployment_exits_1(capsys):
    code = loadtest._cli(["--nats-url", "nats://127.0.0.1:9", "--requests", "1", "--no-progress", "--warmup", "0"])
    assert code == 1
    assert "unavailable" in capsys.readouterr().err


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    records = synthetic()
    result = {"runs": [{"rate": None, "concurrency": c, "name": f"c={c}", "summary": summarize(records),
                        "records": [r.as_dict() for r in records]} for c in (1, 2)]}
    paths = loadtest.plot({"a": result, "b": result}, tmp_path)
    assert [p.name for p in paths] == ["latency_cdf.png", "throughput.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
