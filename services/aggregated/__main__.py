"""`python -m baton.services.aggregated`: the aggregated baseline as its own process.

    python -m baton.services.aggregated --nats-url nats://127.0.0.1:4222 [--spec mtp|off] ...
    python -m baton.services.aggregated --embedded-nats      # start a nats-server too

Prints one line `baton aggregated ready: <url>` once it serves; SIGTERM / SIGINT stop it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

from baton.shared.config import DEFAULT_MODEL_DIR, ConfigError

from ..worker import WorkerConfig
from .engine import PREFILL_TOKENS

log = logging.getLogger("baton.aggregated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `baton serve` (worker options included) plus the aggregated ones."""
    from baton.cli import add_worker_options
    parser.add_argument("--nats-url", default=None, help="default: $BATON_NATS_URL, `baton up`'s, or localhost:4222")
    parser.add_argument("--embedded-nats", action="store_true", help="start a nats-server on a free port")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--log-level", default=os.environ.get("BATON_LOG_LEVEL", "INFO"))
    add_worker_options(parser)
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                        help="prompt tokens prefilled between two decode steps (at least one prompt)")


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The settings from the flags given, defaults for the rest: unlike `baton serve`, this process
    reads neither a config file nor BATON_<SECTION>_<KEY> variables. Raises ConfigError."""
    from baton.cli import effective_config
    return WorkerConfig.of("aggregated", effective_config(args, env={}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m baton.services.aggregated", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        config = worker_config(args)
    except ConfigError as exc:
        print(f"{ap.prog}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    from baton.proto.errors import BatonError
    from baton.services.runtime import run_service, setup_logging
    from baton.shared.bus import Bus, NatsServer

    from .service import serve
    setup_logging("aggregated", args.log_level)
    with contextlib.ExitStack() as stack:
        if args.embedded_nats:
            url = stack.enter_context(NatsServer()).url
        else:
            from baton.cli import default_nats_url
            url = args.nats_url or default_nats_url()

        async def run(stop: asyncio.Event) -> None:
            try:
                bus = await Bus.connect(url, "baton-aggregated")
            except BatonError as exc:
                log.error("%s", exc)
                raise SystemExit(1)
            ready = asyncio.get_running_loop().create_task(_announce(bus, url))
            await serve(stop, bus, config, args.prefill_tokens)
            ready.cancel()
            log.info("aggregated stopped")

        return run_service(run)


async def _announce(bus, url: str) -> None:
    """Print the ready line once the generate endpoint is up."""
    while not bus.endpoints:
        await asyncio.sleep(0.05)
    print(f"baton aggregated ready: {url}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
