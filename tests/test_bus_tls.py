"""NATS over TLS with a real nats-server: mutual TLS for the bus, the refusals a misconfigured
client gets, and a whole cluster serving generate over TLS (services configured by env only).

Certificates come from the `openssl` command line (a throwaway CA, a server certificate for
127.0.0.1, a client certificate); the tests skip where it is missing."""
from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import LookupReply, LookupRequest
from baton.proto.public import CancelReply, CancelRequest, GenerateReply, GenerateRequest
from baton.shared.bus import Bus, NatsServer
from baton.shared.config import env_name
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.up import start_cluster

pytestmark = pytest.mark.integration
OPENSSL = shutil.which("openssl")
if OPENSSL is None:
    pytest.skip("the openssl command is not installed (needed to make test certificates)",
                allow_module_level=True)


def openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_leaf(d: Path, name: str, ca: str, extensions: str) -> None:
    (d / f"{name}.ext").write_text(extensions + "\nauthorityKeyIdentifier=keyid,issuer\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def certs() -> Path:
    with tempfile.TemporaryDirectory(prefix="baton-tls-") as tmp:
        d = Path(tmp)
        make_ca(d, "ca")
        make_ca(d, "other-ca")  # signs nothing the server trusts
        make_leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")
        make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
        yield d


@pytest.fixture(scope="module")
def tls_url(certs: Path) -> str:
    """A nats-server that requires TLS and a client certificate signed by `ca`."""
    config = certs / "nats.conf"
    config.write_text(f'tls {{\n  cert_file: "{certs}/server.pem"\n  key_file: "{certs}/server.key"\n'
                      f'  ca_file: "{certs}/ca.pem"\n  verify: true\n  timeout: 2\n}}\n')
    with NatsServer(config_file=config) as server:
        yield server.url


def client_tls(certs: Path) -> dict[str, str]:
    return dict(tls_ca_file=str(certs / "ca.pem"), tls_cert_file=str(certs / "client.pem"),
                tls_key_file=str(certs / "client.key"))


async def echo(request: CancelRequest) -> CancelReply:
    return CancelReply(request_id=request.request_id, cancelled=True)


def test_request_reply_over_mutual_tls(tls_url, certs):
    async def scenario():
        async with await Bus.connect(tls_url, "tls-test", **client_tls(certs)) as bus:
            await bus.serve("test.tls.echo", CancelRequest, echo)
            reply = await bus.request("test.tls.echo", CancelRequest(request_id="r1"), CancelReply, timeout=2)
            assert reply == CancelReply(request_id="r1", cancelled=True)
    asyncio.run(asyncio.wait_for(scenario(), 20))


@pytest.mark.parametrize("case, reason", [
    ("plain", "CERTIFICATE_VERIFY_FAILED"),  # nats-py upgrades to TLS, against the system's CAs
    ("no client certificate", "certificate required"),
    ("untrusted server CA", "CERTIFICATE_VERIFY_FAILED"),
])
def test_misconfigured_client_is_refused_with_a_clear_error(tls_url, certs, case, reason):
    options = {"plain": {},
               "no client certificate": dict(tls_ca_file=str(certs / "ca.pem")),
               "untrusted server CA": {**client_tls(certs), "tls_ca_file": str(certs / "other-ca.pem")}}[case]

    async def scenario():
        with pytest.raises(BatonError) as raised:
            await Bus.connect(tls_url, "tls-test", connect_timeout_s=3, max_reconnect_attempts=0, **options)
        assert raised.value.code is ErrorCode.UNAVAILABLE
        assert f"cannot connect to NATS at {tls_url}" in raised.value.message
        assert reason in raised.value.message
    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_cluster_serves_generate_over_mutual_tls(tls_url, certs, monkeypatch, tmp_path):
    """Every service gets the TLS files from the environment (`BATON_NATS_TLS_*`), as a
    deployment would; a client with its own certificate gets a greedy reply."""
    for key, value in client_tls(certs).items():
        monkeypatch.setenv(env_name(f"nats.{key}"), value)
    args = argparse.Namespace(model=DEFAULT_MODEL_DIR, prefill=1, decode=1, log_dir=str(tmp_path),
                              nats_url=tls_url, nats_port=None)
    cluster = start_cluster(args, ["--threads", "1", "--num-pages", "256", "--num-slots", "8"])

    async def scenario():
        async with await Bus.connect(tls_url, "tls-client", **client_tls(certs)) as bus:
            deadline = time.monotonic() + 120
            while True:  # until both workers registered over TLS
                assert not cluster.dead(), f"a service exited: {cluster.dead()}; logs in {tmp_path}"
                assert time.monotonic() < deadline, f"workers did not register within 120 s; logs in {tmp_path}"
                try:
                    lookup = await bus.request(subjects.LOOKUP, LookupRequest(), LookupReply, timeout=1.0)
                    if sorted(w.registration.role for w in lookup.workers) == ["decode", "prefill"]:
                        break
                except BatonError:
                    pass
                await asyncio.sleep(0.2)
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[5, 6, 7], max_tokens=8),
                                      GenerateReply, timeout=60)
            assert len(reply.token_ids) == 8 and reply.finish_reason == "length"
    try:
        asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        cluster.stop()
