"""The `baton` command line: up, serve, generate, demo."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR

ROLES = ("registry", "router", "prefill", "decode")


def add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode workers")
    g.add_argument("--spec", choices=("mtp", "off"), default="mtp", help="speculative decoding with the MTP draft")
    g.add_argument("--draft-tokens", type=int, default=3, help="draft tokens per verify step (k)")
    g.add_argument("--draft-state", choices=("transfer", "rebuild", "cold"), default="transfer",
                   help="how decode's draft window starts: sent by prefill, rebuilt from hidden states, or empty")
    g.add_argument("--kv-mode", choices=("ring", "paged"), default="ring", help="sliding-window KV storage")
    g.add_argument("--num-pages", type=int, default=2048)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-slots", type=int, default=64, help="requests resident at once per worker")
    g.add_argument("--max-batch", type=int, default=64)
    g.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch default)")


def worker_argv(args) -> list[str]:
    return ["--spec", args.spec, "--draft-tokens", str(args.draft_tokens), "--draft-state", args.draft_state,
            "--kv-mode", args.kv_mode, "--num-pages", str(args.num_pages), "--page-size", str(args.page_size),
            "--num-slots", str(args.num_slots), "--max-batch", str(args.max_batch), "--threads", str(args.threads)]


def default_nats_url() -> str:
    if os.environ.get("BATON_NATS_URL"):
        return os.environ["BATON_NATS_URL"]
    from baton.up import STATE_FILE
    if STATE_FILE.exists():
        return json.loads(STATE_FILE.read_text())["nats_url"]
    return "nats://127.0.0.1:4222"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving with speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start an embedded nats-server and every service; wait")
    up.add_argument("--nats-url", help="use this NATS server instead of starting one")
    up.add_argument("--nats-port", type=int, help="port for the embedded server (default: a free one)")
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    up.add_argument("--log-dir", default=os.environ.get("BATON_LOG_DIR", "baton-logs"))
    up.add_argument("--ready-timeout", type=float, default=180.0)
    add_worker_options(up)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=ROLES)
    serve.add_argument("--nats-url", default=None)
    serve.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    serve.add_argument("--worker-id", default="")
    serve.add_argument("--log-level", default=os.environ.get("BATON_LOG_LEVEL", "INFO"))
    add_worker_options(serve)

    gen = sub.add_parser("generate", help="send one request and print the reply")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--json", action="store_true", help="print the raw reply")
    gen.add_argument("--nats-url", default=None)
    gen.add_argument("--timeout", type=float, default=120.0)

    demo = sub.add_parser("demo", help="start everything, send a few requests, print them, stop")
    demo.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "up":
        from baton.up import run_up
        return run_up(args, worker_argv(args))
    if args.command == "serve":
        from baton.serve import serve
        return serve(args)
    if args.command == "generate":
        from baton.client import generate
        return asyncio.run(generate(args, args.nats_url or default_nats_url()))
    if args.command == "demo":
        from baton.demo import demo
        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
