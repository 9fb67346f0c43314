"""The load harness against real deployments: the disaggregated cluster (separate service
processes, NIXL) and the aggregated baseline's own process. A short run completes with zero
errors and writes valid (strict) JSON."""
import asyncio
import json

import pytest

from baton import loadtest
from baton.services.aggregated import launch
from baton.shared.bus import NatsServer
from e2e_cluster import running_cluster, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def check_result(path, levels: int, requests: int) -> dict:
    result = json.loads(path.read_text())  # strict JSON: NaN would have been written as null
    assert result["tool"] == "baton bench" and len(result["runs"]) == levels
    for run in result["runs"]:
        s = run["summary"]
        failures = [(r["index"], r["error"], r["error_message"]) for r in run["records"] if r["error"]]
        assert not failures and s["completed"] == s["requests"] == requests, failures
        assert len(run["records"]) == requests
        assert s["output_tokens"] > 0 and s["output_tokens_per_s"] > 0
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
        assert s["itl_ms"]["count"] > 0 and s["acceptance_length"] > 1.0
        assert s["goodput"]["requests"] == requests  # no SLO given: every success counts
    return result


def test_bench_against_the_disaggregated_cluster(tmp_path, capsys):
    with running_cluster() as cluster:
        out = tmp_path / "disagg.json"
        code = loadtest._cli(["--nats-url", cluster.nats_url, "--requests", "6", "--concurrency", "2",
                              "--input-len", "16:96", "--max-tokens", "12", "--warmup", "1", "--json", str(out)])
        assert code == 0
        check_result(out, levels=1, requests=6)
        asyncio.run(wait_all_free(cluster.nats_url))
    report = capsys.readouterr().out
    assert "TTFT ms" in report and "errors      none" in report


def test_bench_sweep_against_the_aggregated_process(tmp_path):
    with NatsServer(jetstream=False) as server:
        with launch.running(server.url, ["--threads", "1", "--num-slots", "16", "--num-pages", "512"],
                            log_path=tmp_path / "aggregated.log") as process:
            out = tmp_path / "agg.json"
            code = loadtest._cli(["--nats-url", server.url, "--requests", "4", "--concurrency", "1,2",
                                  "--max-tokens", "10", "--input-len", "32", "--no-progress", "--json", str(out),
                                  "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"])
            assert code == 0
            result = check_result(out, levels=2, requests=4)
            assert [run["concurrency"] for run in result["runs"]] == [1, 2]
        assert process.returncode == 0, (tmp_path / "aggregated.log").read_text()[-3000:]


def test_poisson_arrivals_with_a_duration(tmp_path):
    with NatsServer(jetstream=False) as server:
        with launch.running(server.url, ["--threads", "1", "--num-slots", "16", "--num-pages", "512"]):
            config = loadtest.BenchConfig(nats_url=server.url, requests=None, duration_s=1.5, rate=[4.0],
                                          input_len="16", max_tokens="6", warmup=0, progress=False)
            result = asyncio.run(loadtest.run_bench(config))
    run = result["runs"][0]
    sends = [r["sent"] for r in run["records"]]
    assert run["rate"] == 4.0 and run["summary"]["errors"] == {}
    assert 1 <= len(sends) <= 20 and max(sends) <= 1.5 + 0.5  # nothing sent after the duration


def test_draft_tokens_zero_turns_speculation_off_for_the_bench_requests(tmp_path):
    with NatsServer(jetstream=False) as server:
        with launch.running(server.url, ["--threads", "1", "--num-slots", "16", "--num-pages", "512"]):
            config = loadtest.BenchConfig(nats_url=server.url, requests=3, concurrency=[1], input_len="16",
                                          max_tokens="8", warmup=0, progress=False, draft_tokens=0)
            result = asyncio.run(loadtest.run_bench(config))
    s = result["runs"][0]["summary"]
    assert s["completed"] == 3 and s["output_tokens"] == 24
    assert s["spec"] == {"verify_steps": 0, "drafted": 0, "accepted": 0}
    assert "draft_tokens 0" in loadtest.format_report(result)
