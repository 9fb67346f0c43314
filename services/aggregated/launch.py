"""Start the aggregated service as its own process (for bench/sweep.py and tests), like
`baton up` starts the disaggregated services: `python -m baton.services.aggregated ...`."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.process import child_env, stop


def spawn(nats_url: str, args: list[str] = (), log_path: Path | None = None) -> subprocess.Popen:
    """`python -m baton.services.aggregated --nats-url URL *args`, output to `log_path`."""
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    cmd = [sys.executable, "-m", "baton.services.aggregated", "--nats-url", nats_url, *args]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(dict(os.environ)),
                            start_new_session=True)


async def wait_ready(nats_url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> float:
    """Until a generate request is answered; returns the seconds waited. Raises if it exited."""
    started = time.monotonic()
    bus = await Bus.connect(nats_url, "aggregated-wait")
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the aggregated service exited with code {process.returncode}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the aggregated service was not ready within {timeout_s:g} s")
            try:
                await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[0], max_tokens=2), GenerateReply,
                                  timeout=30.0)
                return time.monotonic() - started
            except BatonError:
                await asyncio.sleep(0.2)
    finally:
        await bus.close()


@contextlib.contextmanager
def running(nats_url: str, args: list[str] = (), log_path: Path | None = None,
            timeout_s: float = 120.0) -> Iterator[subprocess.Popen]:
    """The service process, ready, for the duration of the block."""
    process = spawn(nats_url, list(args), log_path)
    try:
        asyncio.run(wait_ready(nats_url, process, timeout_s))
        yield process
    finally:
        stop(process)
