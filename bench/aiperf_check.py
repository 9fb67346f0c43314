"""NVIDIA aiperf against `baton up --http`: a fixed output length with `ignore_eos`, as aiperf
itself recommends, must give every request exactly that many tokens.

    .venv/bin/python bench/aiperf_check.py --osl 64 --requests 48 --concurrency 8 --json out/aiperf.json

aiperf 0.13 lives in its own venv (`--aiperf-venv`, default ~/.cache/baton/aiperf-venv), made
and filled with `pip install aiperf==0.13.0` when it does not import (it never touches Baton's
.venv). The run: a cluster with its HTTP door (tests/e2e_cluster.running_cluster), then

    aiperf profile --endpoint-type completions --streaming --osl N --extra-inputs ignore_eos:true
                   --tokenizer models/baton-tiny --request-count R --concurrency C

with `--use-server-token-count`, so aiperf takes each request's output length from the `usage`
Baton reports (by default aiperf re-tokenizes the streamed text with the checkpoint's tokenizer,
and a byte-level BPE splits a text differently from the tokens that generated it: 59..67 for 64,
whatever the server; `--client-counts` shows that). The script reads aiperf's per-request export:
every request's `output_sequence_length` must be N, none may fail, and aiperf must exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR  # noqa: E402

AIPERF = "aiperf==0.13.0"


def aiperf_bin(venv: Path) -> Path:
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(artifacts: Path) -> list[dict]:
    """aiperf's per-request export (one JSON object per line)."""
    path = max(artifacts.rglob("profile_export.jsonl"), key=lambda p: p.stat().st_mtime)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def output_length(record: dict) -> int | None:
    value = record.get("metrics", {}).get("output_sequence_length")
    return value["value"] if isinstance(value, dict) else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--osl", type=int, default=64, help="output tokens per request (aiperf's --osl)")
    ap.add_argument("--isl", type=int, default=128, help="synthetic prompt tokens (aiperf's --isl)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--client-counts", dest="server_counts", action="store_false",
                    help="let aiperf count output tokens by re-tokenizing the text (it then reports BPE "
                         "re-tokenization differences, not what the server generated)")
    ap.add_argument("--aiperf-venv", type=Path, default=Path.home() / ".cache" / "baton" / "aiperf-venv")
    ap.add_argument("--work", type=Path, default=Path("out/aiperf"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    exe = aiperf_bin(args.aiperf_venv)
    from e2e_cluster import running_cluster

    port = free_port()
    artifacts = args.work / f"run-{int(time.time())}"
    cmd = [str(exe), "profile", "--model", DEFAULT_MODEL_DIR.name, "--url", f"http://127.0.0.1:{port}",
           "--endpoint-type", "completions", "--streaming", "--tokenizer", str(DEFAULT_MODEL_DIR),
           "--isl", str(args.isl), "--osl", str(args.osl), "--extra-inputs", "ignore_eos:true",
           "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
           "--output-artifact-dir", str(artifacts), "--random-seed", "0", *(["--use-server-token-count"]
                                                                             if args.server_counts else [])]
    with running_cluster(http_port=port):
        print("+", " ".join(cmd), flush=True)
        started = time.time()
        code = subprocess.run(cmd, env={**os.environ, "NO_COLOR": "1"}).returncode
        wall = time.time() - started
    rows = records(artifacts)
    lengths = [output_length(r) for r in rows]
    errors = [r.get("error") for r in rows if r.get("error")]
    exact = sum(1 for n in lengths if n == args.osl)
    print(f"\naiperf exit code {code}; {len(rows)} requests exported, {len(errors)} with errors; "
          f"{exact} of {len(rows)} have exactly {args.osl} output tokens; wall {wall:.0f} s")
    if exact != len(rows):
        print("output lengths:", sorted(set(lengths)))
    result = {"osl": args.osl, "isl": args.isl, "requests": args.requests, "concurrency": args.concurrency,
              "aiperf_exit": code, "exported": len(rows), "errors": errors[:5], "exact": exact,
              "lengths": sorted(set(lengths)), "wall_s": wall}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    ok = code == 0 and not errors and len(rows) == args.requests and exact == len(rows)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
