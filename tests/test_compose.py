"""compose/ and the Dockerfile, as far as they can be checked without Docker (tests/test_containers.py,
`-m container`, builds and runs them): the compose file parses; every service's command is a real `baton` entry point whose
flags parse; every BATON_* variable is a valid config key; every file referenced exists; the NATS
config is accepted by the real nats-server, and its accounts enforce the client/service split."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from baton import cli
from baton.shared import config
from baton.shared.bus import NatsServer
from baton.shared.bus.server import find_nats_server

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
NATS_ENV = {"NATS_SERVER_NAME": "test-nats", "BATON_SERVICE_PASSWORD": "service-pw",
            "BATON_CLIENT_PASSWORD": "client-pw", "NATS_ADMIN_PASSWORD": "admin-pw"}


def compose_file(name: str = "docker-compose.yml") -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default}, with the defaults (no variables set)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def baton_services(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if svc.get("command", [""])[0] == "baton"}


@pytest.mark.unit
def test_every_command_is_a_real_baton_entry_point():
    doc = compose_file()
    services = baton_services(doc)
    roles = {}
    for name, svc in services.items():
        args = cli.parser().parse_args(svc["command"][1:])  # exits (fails the test) on an unknown command or flag
        assert args.command == "serve", name
        roles[name] = args.role
        assert "build" in svc and svc["image"], name
    deployed = [r for r in cli.ROLES if r != "aggregated"]  # the aggregated baseline is for benchmarks
    assert sorted(roles.values()) == sorted(deployed) and roles == {r: r for r in deployed}
    assert cli.__name__ == "baton.cli"  # `baton` = the console script baton.cli:main
    assert "baton = \"baton.cli:main\"" in (ROOT / "pyproject.toml").read_text()


@pytest.mark.unit
def test_every_service_has_a_health_check_that_parses():
    doc = compose_file()
    for name, svc in doc["services"].items():
        if "monitoring" in svc.get("profiles", []):
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", name
        if test[1] == "baton":
            args = cli.parser().parse_args(test[2:])
            assert (args.command, args.role) == ("health", name)


@pytest.mark.unit
def test_environment_is_valid_configuration():
    doc = compose_file()
    for name, svc in baton_services(doc).items():
        env = {k: interpolate(str(v)) for k, v in svc["environment"].items()}
        assert env["BATON_CONFIG"] == "/etc/baton/baton.toml"
        mounted = [v for v in svc["volumes"] if v.endswith(":/etc/baton/baton.toml:ro")]
        assert mounted, f"{name}: baton.toml not mounted"
        env["BATON_CONFIG"] = str(COMPOSE / mounted[0].split(":")[0])
        cfg = config.load(env=env)  # raises ConfigError naming the key
        assert cfg.nats.url == "nats://nats:4222" and cfg.nats.user in ("service", "client"), name
    http = baton_services(doc)["http"]
    cfg = config.load(env={k: interpolate(str(v)) for k, v in http["environment"].items() if k != "BATON_CONFIG"})
    assert (cfg.http.host, cfg.http.port, cfg.nats.user) == ("0.0.0.0", 8000, "client")
    assert any(p.endswith(":8000") for p in http["ports"])


@pytest.mark.unit
def test_scalable_services_publish_no_fixed_host_ports():
    doc = compose_file()
    for name in ("router", "prefill", "decode", "registry"):
        assert "ports" not in doc["services"][name], f"{name} could not be scaled with fixed host ports"
        assert "container_name" not in doc["services"][name]


@pytest.mark.unit
def test_every_referenced_file_exists():
    doc = compose_file()
    for name, svc in doc["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE / source).exists(), f"{name}: {source}"
            else:
                assert source in doc["volumes"], f"{name}: named volume {source}"
        build = svc.get("build")
        if build:
            assert (COMPOSE / build["context"] / build["dockerfile"]).is_file(), name
        for dep in svc.get("depends_on", []):
            assert dep in doc["services"], f"{name} depends on unknown {dep}"
    cuda = compose_file("docker-compose.cuda.yml")
    assert set(cuda["services"]) <= set(doc["services"])
    prometheus = yaml.safe_load((COMPOSE / "prometheus/prometheus.yml").read_text())
    scraped = {n for job in prometheus["scrape_configs"] for sd in job.get("dns_sd_configs", []) for n in sd["names"]}
    assert scraped <= set(doc["services"])
    provisioning = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/baton.yml").read_text())
    assert provisioning["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in doc["services"]["grafana"]["volumes"]
    import json
    assert json.loads((COMPOSE / "grafana/dashboards/baton.json").read_text())["panels"]


@pytest.mark.unit
def test_dockerfile_copies_every_package_and_builds_from_build_args():
    text = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (?!--from)(\S+) ", text, re.M))
    for source in copied - {"pyproject.toml"}:
        assert (ROOT / source).exists(), source
    package_dirs = set(re.findall(r'"baton[.\w]*" = "(\w+)"', (ROOT / "pyproject.toml").read_text()))
    assert package_dirs and package_dirs <= {c.strip("./") for c in copied} | {"README.md"}, package_dirs - copied
    assert "models" in {c.strip("./") for c in copied}
    assert 'pip install --no-deps --no-build-isolation -e ".[transfer]"' in text  # the model resolves next to the code
    # no registry needed beyond the base and build images: no BuildKit frontend to pull, no stage
    # named by a variable (buildah cannot resolve it; the classic builder builds every stage)
    assert "# syntax" not in text and "${VARIANT}" not in text
    assert re.findall(r"^FROM (.+)$", text, re.M) == ["${BUILD_IMAGE} AS fused-ops", "${BASE_IMAGE}"]
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", text, re.M)
    assert re.search(r"^ARG BUILD_IMAGE=python:3\.11-bookworm$", text, re.M)  # the same Python, with a compiler
    # the service image takes the compiled fused CPU ops, where cpu_fused looks for them (PREBUILT)
    assert "COPY --from=fused-ops /out/ ./kernels/prebuilt/" in text and "cpu_fused.build(Path('/out'))" in text
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    args = compose_file()["x-baton"]["build"]["args"]
    assert set(args) <= set(re.findall(r"^ARG (\w+)", text, re.M)), args


@pytest.mark.unit
def test_compose_file_is_read_by_compose_v1():
    """Debian's docker-compose 1.29 rejects a top-level `name:` (`-p` names the project)."""
    assert set(compose_file()) <= {"services", "volumes", "networks", "configs", "secrets"} | \
        {k for k in compose_file() if k.startswith("x-")}


@pytest.mark.integration
@pytest.mark.parametrize("name", ["nats.conf", "nats-cluster.conf"])
def test_nats_config_is_accepted_by_nats_server(name):
    done = subprocess.run([find_nats_server(), "-t", "-c", str(COMPOSE / "nats" / name)], capture_output=True,
                          text=True, env={**os.environ, **NATS_ENV}, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.integration
def test_nats_accounts_split_clients_from_services(tmp_path, monkeypatch):
    """Clients may call baton.v1.* and read their inboxes, nothing else; services may do anything."""
    for key, value in NATS_ENV.items():
        monkeypatch.setenv(key, value)
    conf = (COMPOSE / "nats" / "nats.conf").read_text()
    conf = re.sub(r"^http_port:.*$", "", conf, flags=re.M)  # no fixed monitoring port in tests
    conf = conf.replace("/data/jetstream", str(tmp_path / "js"))
    (tmp_path / "nats.conf").write_text(conf)
    import nats
    from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

    async def scenario(url: str) -> None:
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)
        host = url.removeprefix("nats://")
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(f"nats://client:wrong@{host}", allow_reconnect=False, connect_timeout=2)
        service = await nats.connect(f"nats://service:service-pw@{host}")
        client = await nats.connect(f"nats://client:client-pw@{host}", error_cb=on_error)
        try:
            async def echo(msg):
                await msg.respond(b"pong:" + msg.data)
            await service.subscribe("baton.v1.generate", cb=echo)
            internal = await service.subscribe("baton.internal.v1.registry.lookup", cb=echo)
            await service.flush()
            await service.flush()  # nats-py may send the first PING ahead of the SUBs (see shared/bus/bus.py)
            assert (await client.request("baton.v1.generate", b"x", timeout=2)).data == b"pong:x"
            with pytest.raises((NatsTimeout, NoRespondersError)):  # the server drops it: permissions
                await client.request("baton.internal.v1.registry.lookup", b"x", timeout=1)
            assert internal.delivered == 0
            await client.subscribe("baton.internal.>")
            await client.flush()
            for _ in range(50):  # the server reports violations asynchronously; a busy machine is slow
                violations = [str(e).lower() for e in errors]
                if sum('permissions violation' in e for e in violations) >= 2:
                    break
                await asyncio.sleep(0.1)
            assert any('permissions violation for publish to "baton.internal.v1' in e for e in violations), errors
            assert any('permissions violation for subscription to "baton.internal.>"' in e for e in violations), errors
            js = service.jetstream()  # services may use JetStream (the registry's KV)
            kv = await js.create_key_value(bucket="test-leases")
            await kv.put("k", b"v")
        finally:
            await client.close()
            await service.close()

    with NatsServer(config_file=tmp_path / "nats.conf", jetstream=False) as server:  # JetStream: from the file
        asyncio.run(asyncio.wait_for(scenario(server.url), 30))


@pytest.mark.unit
def test_compose_baton_toml_and_docs_exist():
    config.load(COMPOSE / "baton.toml", env={})
    assert "docker" in (ROOT / "docs" / "deployment.md").read_text().lower()
    readme = (ROOT / "README.md").read_text()
    assert "## Deployment" in readme and "scripts/container_ci.sh" in readme


@pytest.mark.unit
def test_baton_health_reads_fresh_good_files_only(tmp_path):
    import json
    import time
    from baton.health import health_check, remove_stale_health_files
    cfg = config.load(env={"BATON_HEALTH_DIR": str(tmp_path), "BATON_HEALTH_MAX_AGE_S": "20"})
    ok, detail = health_check("router", cfg)
    assert not ok and "no health file for router" in detail

    def report(pid: int, ok: bool, age: float, role: str = "router") -> None:
        (tmp_path / f"baton-{role}-{pid}.health").write_text(json.dumps(
            {"role": role, "pid": pid, "time": time.time() - age, "ok": ok, "detail": "ok" if ok else "not serving yet"}))
    report(os.getpid(), True, age=60)  # stale: a hung process
    report(os.getpid() + 1, False, age=1)
    ok, detail = health_check("router", cfg)
    assert not ok and "not serving yet" in detail and "60 s ago" in detail
    report(os.getpid() + 2, True, age=1)
    assert health_check("router", cfg)[0] and not health_check("decode", cfg)[0]

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    report(dead.pid, True, age=1)
    report(os.getpid(), True, age=1)
    remove_stale_health_files(tmp_path, "router")
    assert not (tmp_path / f"baton-router-{dead.pid}.health").exists()
    assert (tmp_path / f"baton-router-{os.getpid()}.health").exists()


@pytest.mark.unit
def test_a_health_file_turns_good_soon_after_its_service_does(tmp_path):
    """The file is written at start-up, before a worker has registered: it must not stay "not
    registered" for a whole interval once the worker is (the next probe comes soon while unhealthy)."""
    import asyncio
    import json
    from baton.serve import keep_health_file
    from e2e_cluster import until
    path, verdicts = tmp_path / "baton-decode-1.health", iter(["not registered"])

    async def probe():
        return next(verdicts, None)

    async def main():
        keeper = asyncio.create_task(keep_health_file(path, "decode", probe, interval_s=60.0))
        try:  # the re-check comes after 0.5 s; the interval would be 60
            await until(lambda: path.exists() and json.loads(path.read_text())["ok"], 10.0,
                        "the health file turning good", every_s=0.02)
        finally:
            keeper.cancel()
    asyncio.run(main())
