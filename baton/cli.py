"""The `baton` command line: up, serve, generate, demo, config show, health.

Settings come from one typed config (baton.shared.config): defaults < TOML file (--config or
BATON_CONFIG) < environment (BATON_<SECTION>_<KEY>) < the flags below. A flag left out leaves the
lower layers alone, which is why every config-backed flag defaults to None here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from baton.shared import config as configuration
from baton.shared.config import DEFAULT_MODEL_DIR, Config, ConfigError

ROLES = ("registry", "router", "prefill", "decode", "http", "aggregated")  # aggregated: the baseline, not in compose


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# argparse dest -> config key, for every config-backed flag
FLAG_KEYS: dict[str, str] = {_dest(flag): dotted for flag, dotted in configuration.FLAGS.items()}
# flag -> key of the [worker] settings every worker command takes; not --worker-id: each process has its own
WORKER_FLAGS: dict[str, str] = {flag: dotted for flag, dotted in configuration.FLAGS.items()
                                if dotted.startswith("worker.") and dotted != "worker.id"}


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None,
                   help="TOML config file (default: $BATON_CONFIG); see `baton config show`")


def add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode workers ([worker] in the config)")
    for flag, dotted in WORKER_FLAGS.items():
        f, kind = configuration.keys()[dotted], configuration.type_of(dotted)
        g.add_argument(flag, type=None if kind is str else kind, choices=getattr(f.metadata["check"], "options", None),
                       help=f"{f.metadata['help']} (default {f.default})")


def add_http_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP frontend ([http] in the config)")
    g.add_argument("--http-host", help="bind address (default 127.0.0.1)")
    g.add_argument("--http-port", type=int, help="port (default 8000)")
    g.add_argument("--api-key", help="clients must send 'Authorization: Bearer KEY' (safer: $BATON_HTTP_API_KEY, "
                                     "which `ps` does not show)")
    g.add_argument("--api-key-file", help="file of accepted API keys, one per line")


def worker_argv(args) -> list[str]:
    """The [worker] flags `baton up` gives each prefill and decode child: every effective value, and
    threads, when not set, a share of the cores."""
    argv = []
    for flag, dotted in WORKER_FLAGS.items():
        value = getattr(args, _dest(flag))
        if dotted == "worker.threads":
            value = engine_threads(args)
        argv += [flag, str(value)]
    return argv


def engine_threads(args) -> int:
    """Torch threads of each engine `baton up` starts: worker.threads, or a share of the cores."""
    return args.threads or shared_host_threads(args.prefill + args.decode)


def up_engine_cpus(args) -> list[str] | None:
    """Each engine's CPUs for `baton up` (up.engine_cpus auto, worker.cpus not set), else None."""
    from baton.up import engine_cpus
    if args.engine_cpus != "auto" or args.cpus:
        return None
    return engine_cpus(args.prefill, args.decode, engine_threads(args))


def shared_host_threads(engines: int) -> int:
    """Torch threads for each of `engines` engine processes sharing this machine (`baton up`):
    the cores divided among them. Two processes each running one OpenMP team per core stall each
    other at every barrier (docs/benchmarks.md: one decode stream at 2 threads ran at 0.6x of 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, engines))


def default_nats_url() -> str:
    if os.environ.get("BATON_NATS_URL"):
        return os.environ["BATON_NATS_URL"]
    from baton.up import STATE_FILE
    if STATE_FILE.exists():
        return json.loads(STATE_FILE.read_text())["nats_url"]
    return "nats://127.0.0.1:4222"


def effective_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> Config:
    """The config for this command: the flags the user actually gave override file and env
    (`env`: None is os.environ)."""
    flags = {dotted: getattr(args, dest) for dest, dotted in FLAG_KEYS.items() if getattr(args, dest, None) is not None}
    return configuration.load(getattr(args, "config", None), env=env, flags=flags)


def apply_config(cfg: Config, args: argparse.Namespace) -> argparse.Namespace:
    """Write the effective values back onto the flags' attributes, so `baton up` and `baton serve`
    (and what they pass on to child processes) see one consistent set."""
    for dest, dotted in FLAG_KEYS.items():
        if hasattr(args, dest):
            setattr(args, dest, cfg.get(dotted))
    if hasattr(args, "model"):
        args.model = Path(cfg.model.path)
    if hasattr(args, "nats_url"):
        args.nats_url = cfg.nats.url or None
    if hasattr(args, "nats_port"):
        args.nats_port = cfg.up.nats_port or None
    args.settings = cfg
    return args


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving with speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start an embedded nats-server and every service; wait")
    add_config_option(up)
    up.add_argument("--nats-url", help="use this NATS server instead of starting one")
    up.add_argument("--nats-port", type=int, help="port for the embedded server (default: a free one)")
    up.add_argument("--prefill", type=int, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, help="decode workers (default 1)")
    up.add_argument("--model", type=Path, help=f"model directory (default {DEFAULT_MODEL_DIR})")
    up.add_argument("--log-dir", help="one log per service (default baton-logs)")
    up.add_argument("--ready-timeout", type=float, help="seconds (default 180)")
    up.add_argument("--no-auth", action="store_true",
                    help="no NATS users on the embedded server (default: generated users and permissions; "
                         "clients may only use baton.v1.* and their own reply inboxes)")
    up.add_argument("--http", action="store_true", default=None,
                    help="also start the OpenAI-compatible HTTP frontend (`baton serve http`)")
    up.add_argument("--engine-cpus", choices=("auto", "none"),
                    help="auto: each prefill and decode process on cores of its own when there is one for "
                         "every engine thread (default); none: wherever the OS puts them")
    add_http_options(up)
    add_worker_options(up)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=ROLES)
    add_config_option(serve)
    serve.add_argument("--nats-url", default=None)
    serve.add_argument("--model", type=Path)
    serve.add_argument("--worker-id")
    serve.add_argument("--log-level")
    add_http_options(serve)
    add_worker_options(serve)

    gen = sub.add_parser("generate", help="send one request and print the reply")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    # its own dest: `draft_tokens` is the worker config key, which `apply_config` would write here
    gen.add_argument("--draft-tokens", type=int, dest="request_draft_tokens",
                     help="at most this many drafts per step for this request (0: no speculation; "
                          "more than the deployment's --draft-tokens counts as that)")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--json", action="store_true", help="print the raw reply")
    gen.add_argument("--nats-url", default=None)
    gen.add_argument("--timeout", type=float, default=120.0)

    demo = sub.add_parser("demo", help="start everything, send a few requests, print them, stop")
    demo.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)

    bench = sub.add_parser("bench", help="load-test a running deployment over the public NATS API",
                           description="TTFT, ITL, latency percentiles, throughput, goodput and acceptance length "
                                       "of a running deployment (see docs/benchmarks.md).")
    from baton import loadtest
    loadtest.add_arguments(bench)

    cfg = sub.add_parser("config", help="inspect the configuration")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the effective config (file < env < flags) as TOML")
    add_config_option(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of annotated TOML")
    show.add_argument("--reveal", action="store_true", help="print secrets (passwords, tokens) unmasked")
    show.add_argument("--nats-url")
    show.add_argument("--model", type=Path)
    show.add_argument("--worker-id")
    show.add_argument("--log-level")
    show.add_argument("--log-dir")
    show.add_argument("--prefill", type=int)
    show.add_argument("--decode", type=int)
    show.add_argument("--http", action="store_true", default=None)
    add_http_options(show)
    add_worker_options(show)

    health = sub.add_parser("health", help="exit 0 when a service on this machine reports itself healthy "
                                           "(for container health checks)")
    health.add_argument("role", choices=ROLES)
    add_config_option(health)
    add_http_options(health)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from baton.demo import demo
        return demo(args)
    if args.command == "bench":
        from baton import loadtest
        return loadtest.main(args)
    try:
        cfg = effective_config(args)
    except ConfigError as exc:
        print(f"baton: invalid configuration: {exc}", file=sys.stderr)
        return 2
    apply_config(cfg, args)
    if args.command == "up":
        if args.config is not None:  # the children read the same file
            os.environ[configuration.CONFIG_ENV] = str(args.config.resolve())
        for dotted in ("http.api_key", "http.api_key_file"):  # to the frontend child, never on its command line
            if cfg.get(dotted):
                os.environ[configuration.env_name(dotted)] = cfg.get(dotted)
        from baton.up import run_up
        return run_up(args, worker_argv(args), up_engine_cpus(args))
    if args.command == "serve":
        from baton.serve import serve
        return serve(args, cfg)
    if args.command == "generate":
        from baton.client import generate
        return asyncio.run(generate(args, args.nats_url or default_nats_url()))
    if args.command == "config":
        print(json.dumps(configuration.as_dict(cfg, args.reveal), indent=2) if args.json
              else configuration.to_toml(cfg, args.reveal), end="\n" if args.json else "")
        return 0
    if args.command == "health":
        from baton.health import health_check
        ok, detail = health_check(args.role, cfg)
        print(f"baton {args.role}: {'healthy' if ok else 'unhealthy'}: {detail}", file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
