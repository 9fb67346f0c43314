"""`baton up`: an embedded nats-server plus every service, each its own OS process.

Children run as `python -m baton serve <role> ...`, so a process listing shows which is which; the
prefill and decode workers are forked by one launcher that has imported torch and the workers
already (baton.launcher, `up.fork_workers`), each titled with that command line.
Ready means a request would succeed: the registry knows every worker and a warm-up request was
answered; then one line with the NATS URL is printed. A child that dies during start-up fails
`baton up` at once (most likely a configuration error); from ready on, baton.supervisor restarts
what exits. SIGINT/SIGTERM stop the children (router first, registry last), each with SIGTERM and
a grace period, then the server. Every child, the server too, is killed by the kernel when
`baton up` dies (PR_SET_PDEATHSIG), also on SIGKILL.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from baton.launcher import LaunchedProcess, Launcher
from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.bus.auth import Credentials, new_client, new_service, server_config
from baton.shared.bus.server import NatsServer
from baton.shared.metrics import FILE_ENV, PORT_ENV
from baton.shared.process import child_env, die_with_parent
from baton.supervisor import Supervisor

FORKED_ROLES = ("prefill", "decode")  # the ones that load torch; the light services start fresh without it
STATE_FILE = Path(os.environ.get("BATON_STATE", Path.home() / ".cache" / "baton" / "up.json"))


def client_options(url: str) -> dict:
    """`Bus.connect` options for the public API of the `baton up` running at `url`: the client
    credentials it generated (from its state file), or none if that server is not ours."""
    if not STATE_FILE.exists():
        return {}
    state = json.loads(STATE_FILE.read_text())
    if state.get("nats_url") != url or not state.get("client"):
        return {}
    return Credentials(**state["client"]).connect_options()


@dataclass
class Cluster:
    nats_url: str
    children: list[tuple[str, subprocess.Popen | LaunchedProcess]] = field(default_factory=list)
    commands: list[tuple[str, list[str]]] = field(default_factory=list)  # (role, args) of each child
    worker_ids: dict[int, str] = field(default_factory=dict)  # child index -> the id its current start got
    server: NatsServer | None = None
    log_dir: Path = Path(".")
    service: Credentials | None = None  # when this cluster's own server requires authentication
    client: Credentials | None = None
    launcher: Launcher | None = None  # forks the workers; None: each is started as a fresh process
    owns_launcher: bool = True  # stop() closes it

    def spawn(self, role: str, args: list[str], log_dir: Path) -> None:
        self.commands.append((role, args))
        self.children.append((role, self._popen(len(self.children), role, args, log_dir, "wb")))

    def respawn(self, index: int) -> None:
        """Start child `index` again with its command (a worker under a fresh id); same log file."""
        role, args = self.commands[index]
        self.children[index] = (role, self._popen(index, role, args, self.log_dir, "ab"))

    def _popen(self, index: int, role: str, args: list[str], log_dir: Path,
               log_mode: str) -> subprocess.Popen | LaunchedProcess:
        name = f"{role}-{index}"
        if role in ("prefill", "decode") and "--worker-id" not in args:  # never two instances of one id
            self.worker_ids[index] = f"{name}-{uuid.uuid4().hex[:6]}"
            args = ["--worker-id", self.worker_ids[index], *args]
        argv = ["serve", role, "--nats-url", self.nats_url, *args]
        env = child_env({**os.environ, PORT_ENV: "auto", FILE_ENV: str(log_dir / f"{name}.metrics.json")})
        if self.service is not None:
            env |= {"BATON_NATS_USER": self.service.user, "BATON_NATS_PASSWORD": self.service.password}
        if self.launcher is not None and role in FORKED_ROLES:
            return self.launcher.spawn(argv, env, log_dir / f"{name}.log", append=log_mode == "ab")
        cmd = [sys.executable, "-m", "baton", *argv]
        with open(log_dir / f"{name}.log", log_mode) as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=die_with_parent())

    def forget(self, index: int) -> None:
        """Deregister the worker child `index` ran (it exited), so routers and peers stop using it
        now, not when its lease runs out. Its id was this start's alone: no live instance is touched."""
        if index in self.worker_ids:
            asyncio.run(forget_worker(self.nats_url, self.worker_ids[index], self.service))

    @property
    def metrics(self) -> list[dict]:
        """{"role", "port", "pid"} of each live child's /metrics endpoint."""
        out = []
        for path in sorted(self.log_dir.glob("*.metrics.json")):
            entry = json.loads(path.read_text())
            out += [{"role": role, **entry} for role, p in self.children if p.pid == entry["pid"] and p.poll() is None]
        return out

    def dead(self) -> list[tuple[str, int]]:
        return [(role, p.returncode) for role, p in self.children if p.poll() is not None]

    def stop(self, grace_s: float = 20.0) -> None:
        """Every service (SIGTERM, then SIGKILL after `grace_s`), then the NATS server."""
        self.stop_services(grace_s)
        if self.launcher is not None and self.owns_launcher:
            self.launcher.close()
        if self.server is not None:
            self.server.stop()

    def stop_services(self, grace_s: float = 20.0) -> None:
        """SIGTERM the router first, the workers next, the registry last; SIGKILL after `grace_s`."""
        order = {"router": 0, "http": 0, "prefill": 1, "decode": 1, "registry": 2}
        for rank in sorted(set(order.values())):
            group = [p for role, p in self.children if order.get(role, 1) == rank and p.poll() is None]
            for p in group:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


async def forget_worker(url: str, worker_id: str, service: Credentials | None, timeout_s: float = 5.0) -> None:
    """Deregister every registered instance of `worker_id`; a failure is printed, not raised."""
    from baton.proto.internal import Ack, Deregistration, LookupReply, LookupRequest

    async def deregister() -> None:
        async with await Bus.connect(url, "baton-up", **(service.connect_options() if service else {})) as bus:
            reply = await bus.request(subjects.LOOKUP, LookupRequest(worker_id=worker_id), LookupReply, timeout=2.0)
            for worker in reply.workers:
                await bus.request(subjects.DEREGISTER, Deregistration(
                    worker_id=worker_id, instance_id=worker.registration.instance_id, reason="exited"), Ack, timeout=2.0)
    try:
        await asyncio.wait_for(deregister(), timeout_s)
    except (BatonError, OSError, asyncio.TimeoutError) as exc:  # its lease runs out instead
        print(f"baton: could not deregister {worker_id}: {exc}", file=sys.stderr, flush=True)


async def wait_ready(url: str, cluster: Cluster, prefill: int, decode: int, timeout_s: float,
                     warm_up: bool = True) -> float:
    """Until every worker registered and (with `warm_up`) a warm-up request succeeded; returns
    seconds waited. Raises if a child died."""
    from baton.proto.internal import LookupReply, LookupRequest
    started = time.monotonic()
    bus = await Bus.connect(url, "baton-up", **(cluster.service.connect_options() if cluster.service else {}))
    try:
        while True:
            if cluster.dead():
                raise RuntimeError(f"a service exited during start-up: {cluster.dead()}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"services not ready within {timeout_s:g} s")
            try:
                reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply, timeout=1.0)
                roles = [w.registration.role for w in reply.workers]
                if roles.count("prefill") >= prefill and roles.count("decode") >= decode:
                    if not warm_up:
                        return time.monotonic() - started
                    await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[0], max_tokens=2),
                                      GenerateReply, timeout=30.0)
                    return time.monotonic() - started
            except BatonError:
                pass
            await asyncio.sleep(0.2)
    finally:
        await bus.close()


def engine_cpus(prefill: int, decode: int, threads: int, cpus: Iterable[int] | None = None) -> list[str] | None:
    """Each engine process's own CPUs (its `--cpus`), in start order: prefill's, then decode's.
    Runs of `threads` of this process's CPUs (`cpus`: those instead), prefill's from the lowest
    and decode's from the highest (decode is the busiest engine; CPU 0 takes most interrupts).
    None when there is not a CPU for every engine thread: the OS places them then."""
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if threads < 1 or (prefill + decode) * threads > len(available):
        return None
    runs = [available[i * threads:(i + 1) * threads] for i in range(prefill)]
    runs += [available[len(available) - (i + 1) * threads:len(available) - i * threads] for i in range(decode)]
    return [",".join(map(str, run)) for run in runs]


def start_cluster(args, worker_args: list[str], auth: bool = False, cpus: list[str] | None = None,
                  launcher: Launcher | None = None, fork_workers: bool = True) -> Cluster:
    """The NATS server (unless --nats-url) and every service process; returns once they are
    started. With `auth`, the embedded server gets generated users (service, client) and subject
    permissions. `cpus`: each engine's CPU list (`engine_cpus`), or None to leave placement to the
    OS. `launcher`: the caller's, to fork the workers from and leave open; else, with
    `fork_workers` (`up.fork_workers`) on Linux, one of its own; else each starts fresh."""
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    server, service, client = None, None, None
    if getattr(args, "nats_url", None):
        url = args.nats_url
    else:
        config = None
        if auth:
            service, client = new_service(), new_client()
            config = log_dir / "nats-auth.conf"
            config.touch()
            config.chmod(0o600)
            config.write_text(server_config(service, [client]))
        server = NatsServer(port=getattr(args, "nats_port", None), store_dir=str(log_dir / "jetstream"),
                            config_file=config, die_with_parent=True).start()
        url = server.url
    own = launcher is None
    if own and fork_workers and sys.platform.startswith("linux"):
        launcher = Launcher(child_env(dict(os.environ)))
    cluster = Cluster(url, server=server, log_dir=log_dir, service=service, client=client,
                      launcher=launcher, owns_launcher=own)
    try:
        _spawn_services(cluster, args, worker_args, cpus)
    except BaseException:  # e.g. the launcher could not start one: nothing is left running
        cluster.stop(grace_s=5.0)
        raise
    return cluster


def _spawn_services(cluster: Cluster, args, worker_args: list[str], cpus: list[str] | None) -> None:
    model, log_dir = ["--model", str(args.model)], cluster.log_dir
    cluster.spawn("registry", model, log_dir)
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    for i, role in enumerate(roles):
        cluster.spawn(role, model + worker_args + (["--cpus", cpus[i]] if cpus else []), log_dir)
    cluster.spawn("router", model, log_dir)
    if getattr(args, "http", False):  # `baton up --http`: the OpenAI-compatible frontend too
        cluster.spawn("http", model + ["--http-host", str(args.http_host), "--http-port", str(args.http_port)], log_dir)


def wait_http_ready(cluster: Cluster, host: str, port: int, timeout_s: float) -> str:
    """Until the HTTP frontend's /health answers 200; returns its base URL."""
    import urllib.error
    import urllib.request
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    deadline = time.monotonic() + timeout_s
    while True:
        if cluster.dead():
            raise RuntimeError(f"a service exited during start-up: {cluster.dead()}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5):
                return f"http://{host}:{port}/v1"
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP frontend did not answer on {host}:{port} within {timeout_s:g} s")
            time.sleep(0.2)


def run_up(args, worker_args: list[str], cpus: list[str] | None = None) -> int:
    t0 = time.monotonic()
    stop_now: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop_now.append(1))
    cluster = None
    try:
        cluster = start_cluster(args, worker_args, auth=not getattr(args, "no_auth", False), cpus=cpus,
                                fork_workers=args.settings.up.fork_workers)
        asyncio.run(wait_ready(cluster.nats_url, cluster, args.prefill, args.decode, args.ready_timeout))
        http = ""
        if getattr(args, "http", False):
            http = f"; OpenAI API on {wait_http_ready(cluster, args.http_host, args.http_port, args.ready_timeout)}"
        STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        STATE_FILE.touch()
        STATE_FILE.chmod(0o600)  # it holds the client credentials of the embedded server
        STATE_FILE.write_text(json.dumps({"nats_url": cluster.nats_url, "pid": os.getpid(),
                                          "client": cluster.client.as_dict() if cluster.client else None}))
        placed = (f"; engines on CPUs: prefill {' | '.join(cpus[:args.prefill])}, decode {' | '.join(cpus[args.prefill:])}"
                  if cpus else "")
        print(f"baton ready: {cluster.nats_url} ({args.prefill} prefill, {args.decode} decode{placed}; "
              f"started in {time.monotonic() - t0:.1f} s, logs in {args.log_dir}){http}", flush=True)
        supervisor = Supervisor.of(cluster)
        while not stop_now:
            if reason := supervisor.check():
                print(f"baton: {reason}; see {args.log_dir}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"baton up failed: {exc}; see the logs in {args.log_dir}", file=sys.stderr)
        return 1
    finally:
        print("baton: shutting down", file=sys.stderr, flush=True)
        if cluster is not None:
            cluster.stop()
        if STATE_FILE.exists() and json.loads(STATE_FILE.read_text()).get("pid") == os.getpid():
            STATE_FILE.unlink()
