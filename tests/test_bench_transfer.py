"""bench/transfer.py keeps working: two processes, real NIXL agents, small payloads, several
requests in flight. A smoke run (no timing is asserted): the script itself checks that every
write succeeded, that every request arrived, and that the last iteration's bytes landed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed (pip install -e '.[transfer]')")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "transfer.py"


@pytest.mark.parametrize("layout,shape,copy_threads", [("item", "churn", 0), ("item", "random", 2),
                                                       ("layer", "churn", 0)])
def test_transfer_bench_runs_with_requests_in_flight(tmp_path, layout, shape, copy_threads):
    out = tmp_path / "transfer.json"
    # 4 layers of 4 KiB pages: an item-major page is 16 KiB, so 64K and 1M are whole pages
    done = subprocess.run([sys.executable, str(BENCH), "--sizes", "64K,1M", "--shape", shape, "--layout", layout,
                           "--layers", "4", "--page-kib", "4",
                           "--inflight", "3", "--iters", "2", "--warmup", "1", "--copy-threads", str(copy_threads),
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["inflight"] == 3 and report["shape"] == shape and report["copy_threads"] == copy_threads
    assert report["layout"] == layout
    assert [row["payload_bytes"] for row in report["rows"]] == [64 << 10, 1 << 20]
    for row in report["rows"]:
        assert row["inflight"] == 3
        pages = row["payload_bytes"] // (16 << 10)  # runs of pages (+ the aux row), per layer if per-layer
        assert 2 <= row["descriptors"] <= (pages + 1 if layout == "item" else 4 * pages + 1)
        assert row["write_gbps"] > 0 and row["nixl_gbps"] > 0 and row["copy1_gbps"] > 0 and row["copyt_gbps"] > 0
        assert row["nixl_pages_gbps"] > 0


def test_write_soak_bench_runs_and_every_write_succeeds(tmp_path):
    out = tmp_path / "write_soak.json"
    # generous limits: a loaded CI machine must not turn a slow request into a failure here
    done = subprocess.run([sys.executable, str(BENCH.with_name("write_soak.py")), "--requests", "40",
                           "--deadline-s", "30", "--slow-s", "30", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] == 40 and report["slow"] == []
    assert 0 < report["p50_ms"] <= report["p99_ms"] <= report["max_ms"]
