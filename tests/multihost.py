"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge (issue 29).

    with Topology(["a", "b", "c"], delay_ms=1.0) as net:
        net.host("a").popen([...], label="nats")      # runs inside host a's namespace
        net.cut("b"); ...; net.heal("b")               # host b's cable pulled, plugged in

Each host is a namespace `baton-mh-<pid>-<host>` with loopback up and one interface `eth0` at
10.77.<x>.<n>/24 (<x>: the first /24 of 10.77.0.0/16 the root namespace does not use yet, so
two runs at once do not collide; `Topology.subnet`). The other end of each host's veth pair is a
port of the bridge `br0` in a namespace of its own, `baton-mh-<pid>-lan` (so the root
namespace's FORWARD chain, DROP under Docker with bridge-nf-call-iptables, never sees the
traffic). The root namespace joins the LAN too, through the veth `bmh<pid>` at 10.77.<x>.254, so
the process that built the topology (a test, a bench script) reaches every host as a client on
the same LAN. `delay_ms` adds `tc netem delay` on every host's eth0 (each direction then
crosses one delay: host -> bridge); where the kernel has no sch_netem the topology runs without
it and `delay_error` says why. `cut(host)` sets the host's bridge port down (a cable pulled: the
host's own interface keeps its address and carrier-less routes; packets are lost, nothing is
refused); `heal(host)` sets it up again.

Teardown (on an exception too, and at interpreter exit) kills every process started through
`Host.popen` (their process groups) and anything else left in the namespaces, then deletes the
namespaces (which deletes their veth pairs). Leftovers of a crashed run (`baton-mh-<pid>-*`
namespaces and `bmh<pid>` links whose pid is not alive) are deleted at start.

Needs root and iproute2 (`ip`); `available()` says whether this machine can build it, and why not.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

PREFIX = "baton-mh-"
BRIDGE_PREFIX = "bmh"
NETWORK = "10.77"  # each topology takes one free 10.77.<x>.0/24


def free_subnet() -> str:
    """The first 10.77.<x> (x in 0..254) no address of the root namespace is in."""
    used = _ip("-4", "-o", "addr", "show", check=False).stdout
    taken = {int(m) for m in re.findall(rf"inet {NETWORK}\.(\d+)\.", used)}
    for x in range(255):
        if x not in taken:
            return f"{NETWORK}.{x}"
    raise RuntimeError(f"every {NETWORK}.x.0/24 is in use")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be built here, else why not (a skip reason)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _operstate(ns: str, dev: str) -> str:
    shown = json.loads(_ip("-j", "-n", ns, "link", "show", "dev", dev, check=False).stdout or "[{}]")
    return shown[0].get("operstate", "") if shown else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Delete `baton-mh-<pid>-*` namespaces and `bmh<pid>` bridges of runs whose pid is gone."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid == "probe" or (pid.isdigit() and not _alive(int(pid))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    links = json.loads(_ip("-j", "link", "show", "type", "veth", check=False).stdout or "[]")
    for link in links:
        name = link.get("ifname", "")
        pid = name[len(BRIDGE_PREFIX):]
        if name.startswith(BRIDGE_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_namespace_processes(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Host:
    """One namespace: its name, address and the processes started in it."""

    def __init__(self, topology: "Topology", name: str, ns: str, addr: str, port: str):
        self.topology, self.name, self.ns, self.addr, self.port = topology, name, ns, addr, port
        self.index = 0  # its address is <subnet>.<index>
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), check=check, capture_output=True, text=True, timeout=timeout)

    def popen(self, argv: Sequence[str], *, label: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` inside this host (its own process group; killed by the kernel if we die;
        output to `<log_dir>/<host>-<label>.log`)."""
        from baton.shared.process import die_with_parent
        log = open(self.topology.log_dir / f"{self.name}-{label}.log", "ab")
        try:
            proc = subprocess.Popen(self.command(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, start_new_session=True,
                                    preexec_fn=die_with_parent())
        finally:
            log.close()
        self.procs.append((label, proc))
        return proc

    def tcp_connections(self) -> list[tuple[str, int, str, int]]:
        """(local address, local port, remote address, remote port) of its established TCP connections."""
        out = self.run(["ss", "-Htn", "state", "established"]).stdout
        found = []
        for line in out.splitlines():
            cols = line.split()
            if len(cols) >= 4:
                (la, lp), (ra, rp) = (c.rsplit(":", 1) for c in cols[-2:])
                found.append((la, int(lp), ra, int(rp)))
        return found

    def log(self, label: str) -> Path:
        return self.topology.log_dir / f"{self.name}-{label}.log"

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Every process of this namespace (ours, and anything else running in it): the host dies."""
        pids = [p.pid for _, p in self.procs if p.poll() is None]
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            _kill_namespace_processes(self.ns)
        for _, p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return pids


class Topology:
    def __init__(self, hosts: Iterable[str] = ("a", "b", "c"), *, delay_ms: float | None = None,
                 log_dir: str | Path | None = None):
        self.pid = os.getpid()
        self.bridge = f"{BRIDGE_PREFIX}{self.pid}"  # the root namespace's veth into the LAN
        self.lan = f"{PREFIX}{self.pid}-lan"
        self.delay_ms = delay_ms
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="baton-mh-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.subnet = ""  # "10.77.<x>", chosen at start
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(hosts, start=1):
            self.hosts[name] = Host(self, name, f"{PREFIX}{self.pid}-{name}", "",
                                    f"{BRIDGE_PREFIX}{self.pid}{name}"[:15])
            self.hosts[name].index = i
        self._up = False
        self.delay_error = ""  # why `delay_ms` could not be applied (no sch_netem), else ""

    def host(self, name: str) -> Host:
        return self.hosts[name]

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Topology":
        clean_stale()
        atexit.register(self.stop)
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        self._up = True
        return self

    def _build(self) -> None:
        self.subnet = free_subnet()
        for h in self.hosts.values():
            h.addr = f"{self.subnet}.{h.index}"
        # The bridge lives in a namespace of its own ("lan"): the root namespace's FORWARD chain
        # (often DROP, e.g. under Docker, with bridge-nf-call-iptables) then never sees host traffic.
        _ip("netns", "add", self.lan)
        _ip("-n", self.lan, "link", "set", "lo", "up")
        _ip("-n", self.lan, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.lan, "link", "set", "br0", "up")
        # the root namespace joins the LAN too (<subnet>.254), so this process reaches every host
        _ip("link", "add", self.bridge, "type", "veth", "peer", "name", f"{self.bridge[:14]}r")
        _ip("link", "set", f"{self.bridge[:14]}r", "netns", self.lan)
        _ip("-n", self.lan, "link", "set", f"{self.bridge[:14]}r", "master", "br0", "up")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts.values():
            _ip("netns", "add", h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            inner = f"{h.port[:14]}i"  # renamed eth0 once inside the namespace
            _ip("link", "add", h.port, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", h.ns)
            _ip("-n", h.ns, "link", "set", inner, "name", "eth0")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("link", "set", h.port, "netns", self.lan)
            _ip("-n", self.lan, "link", "set", h.port, "master", "br0", "up")
            if self.delay_ms:
                added = _ip("netns", "exec", h.ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                            "delay", f"{self.delay_ms}ms", check=False)
                if added.returncode != 0:  # a kernel without sch_netem: run without the delay, say so
                    self.delay_error = added.stderr.strip() or f"tc exited {added.returncode}"
                    print(f"multihost: no netem delay on {h.name}: {self.delay_error}", file=sys.stderr)
        for h in self.hosts.values():  # carrier on both ends (no STP: a port up forwards at once)
            wait_for(lambda: _operstate(h.ns, "eth0") == "UP", 10, f"host {h.name}'s eth0 up")

    def stop(self) -> None:
        for h in self.hosts.values():
            h.kill_all()
        for h in self.hosts.values():
            _ip("netns", "del", h.ns, check=False)
        _ip("netns", "del", self.lan, check=False)  # its veth ends go, and with them their peers
        _ip("link", "del", self.bridge, check=False)
        self._up = False

    def __enter__(self) -> "Topology":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- faults -------------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Pull host `name`'s cable: its bridge port goes down, every packet to or from it is lost."""
        _ip("-n", self.lan, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.lan, "link", "set", self.hosts[name].port, "up")


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.1) -> float:
    """Until `condition()` is true; returns seconds waited; raises TimeoutError naming `what`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return time.monotonic() - start


# --- a NATS cluster over the hosts ------------------------------------------------------------
CLIENT_PORT, ROUTE_PORT, MONITOR_PORT = 4222, 6222, 8222


def nats_config(host: Host, peers: Sequence[Host], store_dir: Path) -> str:
    routes = ", ".join(f"nats-route://{p.addr}:{ROUTE_PORT}" for p in peers if p is not host)
    return (f'server_name: "mh-{host.name}"\n'
            f'listen: "{host.addr}:{CLIENT_PORT}"\n'
            f'http: "{host.addr}:{MONITOR_PORT}"\n'
            f'jetstream {{ store_dir: "{store_dir}" }}\n'
            f'cluster {{\n  name: "baton-mh"\n  listen: "{host.addr}:{ROUTE_PORT}"\n'
            f'  routes: [{routes}]\n}}\n')


class NatsCluster:
    """One nats-server per host, routed to the others, JetStream on each (cluster of len(hosts))."""

    def __init__(self, topology: Topology, hosts: Sequence[str]):
        self.topology = topology
        self.hosts = [topology.host(h) for h in hosts]
        self.procs: dict[str, subprocess.Popen] = {}
        self.dir = topology.log_dir / "nats"

    def url_of(self, host: str) -> str:
        return f"nats://{self.topology.host(host).addr}:{CLIENT_PORT}"

    @property
    def urls(self) -> list[str]:
        return [self.url_of(h.name) for h in self.hosts]

    @property
    def url(self) -> str:
        """Every server, comma-separated (what `--nats-url` takes)."""
        return ",".join(self.urls)

    def start_server(self, host: str) -> subprocess.Popen:
        from baton.shared.bus.server import find_nats_server
        h = self.topology.host(host)
        store = self.dir / h.name / "js"
        store.mkdir(parents=True, exist_ok=True)
        conf = self.dir / h.name / "nats.conf"
        conf.write_text(nats_config(h, self.hosts, store))
        self.procs[host] = h.popen([find_nats_server(), "-c", str(conf)], label="nats")
        return self.procs[host]

    def start(self, timeout_s: float = 30.0) -> "NatsCluster":
        for h in self.hosts:
            self.start_server(h.name)
        for h in self.hosts:
            self.wait_ready(h.name, timeout_s)
        return self

    def connections(self, host: str) -> list[dict]:
        """The client connections of `host`'s server (its /connz monitoring page)."""
        import urllib.request
        url = f"http://{self.topology.host(host).addr}:{MONITOR_PORT}/connz?limit=1024"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a LAN address: no proxy
        with opener.open(url, timeout=2) as page:
            return json.loads(page.read()).get("connections") or []

    def server_of(self, client_name: str) -> str | None:
        """Which host's server the client connection named `client_name` is on (None: none)."""
        for h in self.hosts:
            if self.procs.get(h.name) is None or self.procs[h.name].poll() is not None:
                continue
            try:
                if any(c.get("name") == client_name for c in self.connections(h.name)):
                    return h.name
            except OSError:
                continue
        return None

    def kill(self, host: str) -> None:
        proc = self.procs[host]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def wait_ready(self, host: str, timeout_s: float = 30.0) -> float:
        """Until `host`'s server greets on its client port and knows routed peers (connect_urls)."""
        import socket

        def greets() -> bool:
            if self.procs[host].poll() is not None:
                log = self.topology.host(host).log("nats").read_text()[-3000:]
                raise RuntimeError(f"nats-server on {host} exited:\n{log}")
            try:
                with socket.create_connection((self.topology.host(host).addr, CLIENT_PORT), timeout=0.5) as s:
                    info = json.loads(s.makefile("rb").readline(1 << 16).removeprefix(b"INFO "))
            except (OSError, ValueError):
                return False
            return info.get("server_name") == f"mh-{host}" and bool(info.get("connect_urls"))
        return wait_for(greets, timeout_s, f"nats-server on {host} routed and ready")


async def js_meta_ready(urls: list[str], timeout_s: float = 30.0) -> None:
    """Until JetStream answers account info (a meta leader was elected)."""
    import asyncio

    import nats
    deadline = asyncio.get_running_loop().time() + timeout_s
    nc = await nats.connect(servers=urls, connect_timeout=2, max_reconnect_attempts=-1)
    try:
        js = nc.jetstream(timeout=2)
        while True:
            try:
                await js.account_info()
                return
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await nc.close()


async def create_replicated_bucket(urls: list[str], bucket: str, replicas: int, timeout_s: float = 30.0) -> dict:
    """The registry's KV bucket made ahead of the registry with `replicas` (the registry, given
    the same `registry.replicas`, keeps it as it is). Returns its stream's
    cluster info."""
    import asyncio

    import nats
    await js_meta_ready(urls, timeout_s)
    nc = await nats.connect(servers=urls, connect_timeout=2)
    try:
        js = nc.jetstream(timeout=5)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                await js.create_key_value(bucket=bucket, history=1, replicas=replicas)
                info = await js.stream_info(f"KV_{bucket}")
                return {"replicas": info.config.num_replicas, "leader": info.cluster.leader if info.cluster else None}
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def bucket_info(urls: list[str], bucket: str) -> dict:
    """Replicas, leader and replicas' state of a KV bucket's stream."""
    import nats
    nc = await nats.connect(servers=urls, connect_timeout=2)
    try:
        info = await nc.jetstream(timeout=5).stream_info(f"KV_{bucket}")
        cluster = info.cluster
        return {"replicas": info.config.num_replicas, "leader": cluster.leader if cluster else None,
                "peers": sorted((p.name, bool(p.current)) for p in (cluster.replicas or [])) if cluster else [],
                "messages": info.state.messages}
    finally:
        await nc.close()


async def wait_bucket_current(urls: list[str], bucket: str, replicas: int, timeout_s: float = 60.0) -> dict:
    """Until the bucket's stream has a leader and at least `replicas - 1` current followers (a
    restarted server catches up first); returns bucket_info."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    info: dict | str = "no answer"
    while True:
        try:
            info = await asyncio.wait_for(bucket_info(urls, bucket), 10)
            if info["leader"] and sum(c for _, c in info["peers"]) >= replicas - 1:
                return info
        except Exception as exc:  # a server still starting, no leader yet
            info = f"{type(exc).__name__}: {exc}"
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"bucket {bucket} not current on {replicas} replicas within {timeout_s:g} s: {info}")
        await asyncio.sleep(0.25)


# --- Baton services on hosts ------------------------------------------------------------------
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}


def serve_command(role: str, nats_url: str, args: Sequence[str] = ()) -> list[str]:
    """The command line `baton up` gives each child (baton/up.py Cluster._popen)."""
    return [sys.executable, "-m", "baton", "serve", role, "--nats-url", nats_url, *args]


def start_service(host: Host, role: str, nats_url: str, args: Sequence[str] = (), *, label: str | None = None,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    from baton.shared.metrics import FILE_ENV, PORT_ENV
    label = label or role
    env = {**UCX_ENV, PORT_ENV: "auto", FILE_ENV: str(host.topology.log_dir / f"{host.name}-{label}.metrics.json"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    return host.popen(serve_command(role, nats_url, args), label=label, env=env)


def logs(topology: Topology, tail: int = 4000) -> str:
    """The last `tail` characters of every log of the topology's services and servers."""
    return "".join(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}\n"
                   for path in sorted(topology.log_dir.glob("*.log")))


def print_logs(topology: Topology, tail: int = 4000) -> None:
    print(logs(topology, tail))


class BatonOnHosts:
    """NATS cluster on every host; registry + router on `control`, prefill on `prefill`, decode on
    `decode`; every service connects with all the cluster's URLs. The registry's bucket is made
    first with `replicas` replicas."""

    def __init__(self, topology: Topology, *, control: str = "c", prefill: str = "a", decode: str = "b",
                 worker_args: Sequence[str] = (), replicas: int = 3, env: dict[str, dict[str, str]] | None = None):
        self.net = topology
        self.nats = NatsCluster(topology, list(topology.hosts))
        self.roles = {"registry": control, "router": control, "prefill": prefill, "decode": decode}
        self.worker_args = ["--threads", "1", "--num-pages", "512", "--num-slots", "16", *worker_args]
        self.replicas = replicas
        self.procs: dict[str, subprocess.Popen] = {}
        self.worker_ids: dict[str, str] = {}
        self.bucket: dict = {}
        self.env = env or {}  # role -> extra environment (BATON_<SECTION>_<KEY> configuration)
        self.worker_mode = "transfer"  # --draft-state the workers run with (the config's default)
        self.extra: dict[str, list[str]] = {}  # role -> extra args of its current start

    def start_nats(self) -> None:
        import asyncio
        from baton.services.registry.service import BUCKET
        self.nats.start()
        self.bucket = asyncio.run(create_replicated_bucket(self.nats.urls, BUCKET, self.replicas))

    def start_role(self, role: str, extra: Sequence[str] = ()) -> subprocess.Popen:
        import uuid
        from baton.shared.config import DEFAULT_MODEL_DIR
        args = ["--model", str(DEFAULT_MODEL_DIR)]
        if role in ("prefill", "decode"):
            self.worker_ids[role] = f"{role}-mh-{uuid.uuid4().hex[:6]}"
            self.extra[role] = list(extra or self.extra.get(role, []))
            args += ["--worker-id", self.worker_ids[role], *self.worker_args, *self.extra[role]]
        host = self.net.host(self.roles[role])
        env = {**({"BATON_REGISTRY_REPLICAS": str(self.replicas)} if role == "registry" else {}), **self.env.get(role, {})}
        self.procs[role] = start_service(host, role, self.nats.url, args, env=env)
        return self.procs[role]

    def start(self, ready_timeout_s: float = 240.0) -> "BatonOnHosts":
        self.start_nats()
        for role in ("registry", "prefill", "decode", "router"):
            self.start_role(role)
        self.wait_ready(ready_timeout_s)
        return self

    def restart_workers(self, extra: Sequence[str], timeout_s: float = 240.0) -> None:
        """Prefill and decode stopped (SIGTERM) and started again with `extra` args, under new ids;
        returns once the registry lists the new ones (and only them) and a warm-up succeeded."""
        import asyncio
        for role in ("prefill", "decode"):
            self.stop_role(role)
        for role in ("prefill", "decode"):
            self.start_role(role, extra)
        asyncio.run(self._only_current_workers(timeout_s))
        self.wait_ready(timeout_s)

    async def _only_current_workers(self, timeout_s: float) -> None:
        from baton.proto import subjects
        from baton.proto.errors import BatonError
        from baton.proto.internal import LookupReply, LookupRequest
        from baton.shared.bus import Bus
        deadline = time.monotonic() + timeout_s
        async with await Bus.connect(self.nats.urls, "multihost-setup") as bus:
            while True:
                if self.dead():
                    raise RuntimeError(f"a service exited during start-up: {self.dead()}")
                try:
                    reply = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply, timeout=2.0)
                    if {w.registration.worker_id for w in reply.workers} == set(self.worker_ids.values()):
                        return
                except BatonError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {self.worker_ids} not the registered ones within {timeout_s:g} s")
                await asyncio.sleep(0.2)

    def dead(self) -> list[tuple[str, int]]:
        return [(r, p.returncode) for r, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, timeout_s: float = 240.0, warm_up: bool = True) -> float:
        import asyncio

        from baton.up import Cluster, wait_ready
        cluster = Cluster(self.nats.url)
        cluster.children = list(self.procs.items())
        return asyncio.run(wait_ready(self.nats.urls, cluster, 1, 1, timeout_s, warm_up))

    def stop_role(self, role: str, grace_s: float = 10.0) -> None:
        from baton.shared.process import stop
        proc = self.procs.get(role)
        if proc is not None:
            stop(proc, grace_s)

    def stop(self) -> None:
        for role in ("router", "prefill", "decode", "registry"):
            self.stop_role(role)
