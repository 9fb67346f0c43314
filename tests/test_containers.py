"""The container tier (`-m container`; not in the default run): compose/docker-compose.yml brought up
for real from the images scripts/container_ci.sh builds (it runs this file). Greedy generate through
the HTTP door and over NATS equals `transformers`; `--scale decode=2` serves from both decodes; a
decode container killed -9 is brought back by its restart policy while no request is lost;
`compose down -v` leaves no container, network or volume; the workers run the fused CPU ops
the image's build stage compiled. The tests share one compose project and
run in file order (the last one takes it down).

Needs a Docker daemon, docker-compose and the images named by BATON_IMAGE / BATON_NATS_IMAGE
(scripts/container_ci.sh sets them up); every wait is on a condition, with a timeout."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.bus.server import free_port
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import Reference, until_sync, worker_loads

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
DOCKER = os.environ.get("BATON_DOCKER", "/usr/bin/docker")
COMPOSE = os.environ.get("BATON_COMPOSE", "docker-compose")
PROJECT = "baton-ci"
LABEL = f"label=com.docker.compose.project={PROJECT}"
LOGS = Path(os.environ.get("BATON_COMPOSE_LOGS", "/tmp/baton-ci-compose.log"))  # written when a test failed
# the compose file's development passwords (no .env here)
CLIENT, SERVICE = "client:baton-client-dev", "service:baton-service-dev"


def run(*cmd: str, timeout: float = 300, env: dict | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


class Stack:
    """The compose project, its published ports on free host ports."""

    def __init__(self) -> None:
        self.http, self.nats, monitor = free_port(), free_port(), free_port()
        # not the loopback pin of the test processes (conftest.py): each container is a host of its
        # own, and compose's UCX_NET_DEVICES default (all) is what lets them reach each other
        host_env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
        self.env = {**host_env, "BATON_HTTP_PUBLISH": str(self.http), "BATON_NATS_PUBLISH": str(self.nats),
                    "BATON_NATS_MONITOR_PUBLISH": str(monitor)}
        self.client_url = f"nats://{CLIENT}@127.0.0.1:{self.nats}"
        self.service_url = f"nats://{SERVICE}@127.0.0.1:{self.nats}"  # internal subjects: worker loads

    def compose(self, *args: str, timeout: float = 300) -> str:
        return run(COMPOSE, "-p", PROJECT, "-f", str(ROOT / "compose/docker-compose.yml"), *args,
                   timeout=timeout, env=self.env)

    def containers(self, service: str) -> list[str]:
        return run(DOCKER, "ps", "-q", "--filter", LABEL, "--filter",
                   f"label=com.docker.compose.service={service}").split()

    def inspect(self, container: str) -> dict:
        return json.loads(run(DOCKER, "inspect", container))[0]

    def dump_logs(self) -> None:
        """The containers' last log lines into LOGS (scripts/container_ci.sh prints it on failure):
        the output of a module fixture's teardown is not shown with a failed test."""
        LOGS.write_text(self.compose("logs", "--no-color", "--tail", "100"))

    def not_healthy(self) -> list[str]:
        """'service: status' of each container of the project whose health check has not passed."""
        ids = run(DOCKER, "ps", "-aq", "--filter", LABEL).split()
        states = json.loads(run(DOCKER, "inspect", *ids)) if ids else []
        return [f"{c['Config']['Labels']['com.docker.compose.service']}: {c['State'].get('Health', c['State'])['Status']}"
                for c in states if c["State"].get("Health", {}).get("Status") != "healthy"]

    def http_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=5) as resp:
                return resp.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def decodes(self) -> dict[str, tuple]:
        loads = asyncio.run(worker_loads(self.service_url))
        return {wid: load for wid, load in loads.items() if load[0] == "decode"}

    def completion(self, prompt: str | list[int], max_tokens: int) -> dict:
        body = json.dumps({"model": "baton-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module")
def stack(request):
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        pytest.fail(f"no Docker daemon answers {DOCKER}: run scripts/container_ci.sh (it starts one)")
    for image in (os.environ.get("BATON_IMAGE", "baton:cpu"), os.environ.get("BATON_NATS_IMAGE", "nats:2.11-alpine")):
        if subprocess.run([DOCKER, "image", "inspect", image], capture_output=True).returncode != 0:
            pytest.fail(f"image {image} is missing: scripts/container_ci.sh builds it")
    s = Stack()
    s.compose("down", "-v", "--remove-orphans", "-t", "5")  # a project left by an interrupted run
    failed_before = request.session.testsfailed
    try:
        s.compose("up", "-d", "--no-build", timeout=600)  # returns once the health-gated start order is through
        until_sync(lambda: not s.not_healthy(), 300, "every container healthy", every_s=0.5)
        assert s.http_ready()
        yield s
    except BaseException:
        s.dump_logs()
        raise
    else:
        if request.session.testsfailed > failed_before:
            s.dump_logs()
    finally:
        s.compose("down", "-v", "--remove-orphans", "-t", "10")


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.load(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def expected(tok):
    """The whole reply greedy decoding must give: (token ids, text, finish reason), from
    transformers. A reply that ends on end of text reports its id but not its text."""
    reference, cache = Reference(), {}

    def want(prompt: list[int], max_tokens: int) -> tuple[list[int], str, str]:
        if (key := (tuple(prompt), max_tokens)) not in cache:
            ids = reference.greedy(prompt, max_tokens)
            stopped = ids[-1:] == [tok.eos_token_id]
            cache[key] = (ids, tok.decode(ids[:-1] if stopped else ids), "stop" if stopped else "length")
        return cache[key]
    return want


def prompts(tok, count: int, length: int = 40) -> list[list[int]]:
    return [heldout_prompts(tok, 1, length, seed=seed)[0] for seed in range(count)]


async def generate(url: str, prompt: list[int], max_tokens: int, **fields) -> tuple | BatonError:
    """(token ids, text, finish reason) over NATS, or the error."""
    async with await Bus.connect(url, "container-test") as bus:
        try:
            reply = await bus.request(subjects.GENERATE, GenerateRequest(token_ids=prompt, max_tokens=max_tokens,
                                                                         **fields), GenerateReply, timeout=300)
        except BatonError as exc:
            return exc
    return reply.token_ids, reply.text, reply.finish_reason


def test_greedy_through_http_and_nats_equals_transformers(stack, tok, expected):
    text = "To be, or not to be, that is the question:"
    for prompt in (text, *prompts(tok, 2, 80)):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        got = stack.completion(prompt, 32)
        choice = got["choices"][0]
        assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == expected(ids, 32)
        assert got["usage"]["prompt_tokens"] == len(ids)
    for prompt in prompts(tok, 3, 100):  # over NATS as the public client user, concurrently
        async def both():
            return await asyncio.gather(*(generate(stack.client_url, p, 40) for p in [prompt, prompt[:50]]))
        for p, reply in zip([prompt, prompt[:50]], asyncio.run(both())):
            assert reply == expected(p, 40)


def test_the_workers_run_the_fused_cpu_ops_the_image_was_built_with(stack):
    """The image has no C++ compiler: its workers load the module the Dockerfile's build stage
    compiled (kernels/prebuilt/), not the slower torch references."""
    for service in ("prefill", "decode"):
        logs = stack.compose("logs", "--no-color", service)
        assert "fused CPU ops unavailable" not in logs, logs[-3000:]
        assert "fused CPU ops ready" in logs and "/opt/baton/kernels/prebuilt/baton_cpu_fused_" in logs, logs[-3000:]


def test_scale_decode_to_two_and_both_serve(stack, tok, expected):
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "decode=2", timeout=600)
    assert len(stack.containers("decode")) == 2
    until_sync(lambda: not stack.not_healthy(), 300, "the second decode healthy (registered)", every_s=0.5)
    assert len(stack.decodes()) == 2
    batch = prompts(tok, 4)
    for _ in range(6):  # the router sends each request to the decode with the most free slots
        async def burst():
            return await asyncio.gather(*(generate(stack.client_url, p, 24) for p in batch))
        assert asyncio.run(burst()) == [expected(p, 24) for p in batch]
        if all(load[6] > 0 for load in stack.decodes().values()):
            break
    loads = stack.decodes()
    assert len(loads) == 2 and all(load[6] > 0 for load in loads.values()), f"requests taken per decode: {loads}"


def test_a_killed_decode_container_is_restarted_and_no_request_is_lost(stack, tok):
    victim = stack.containers("decode")[0]
    before = stack.inspect(victim)
    old = set(stack.decodes())
    assert len(old) == 2
    batch = prompts(tok, 4)
    max_tokens = 600  # past end of text (ignore_eos): long enough that the kill lands while both decode

    async def scenario():
        first = await asyncio.gather(*(generate(stack.client_url, p, max_tokens, ignore_eos=True) for p in batch))
        assert all(isinstance(r, tuple) for r in first), first
        during = [asyncio.create_task(generate(stack.client_url, p, max_tokens, ignore_eos=True)) for p in batch]
        deadline = time.monotonic() + 60
        while not all(load[5] > 0 for load in (await worker_loads(stack.service_url)).values()
                      if load[0] == "decode"):
            assert time.monotonic() < deadline, "both decodes decoding not within 60 s"
            assert not all(task.done() for task in during), "the requests ended before both decodes were seen decoding"
            await asyncio.sleep(0.2)
        os.kill(before["State"]["Pid"], signal.SIGKILL)  # the container's init: the whole container dies
        assert await asyncio.gather(*during) == first  # whole replies, finish reasons too
        return first
    first = asyncio.run(scenario())

    def restarted() -> bool:
        state = stack.inspect(victim)
        return state["RestartCount"] > before["RestartCount"] and state["State"]["Running"]
    until_sync(restarted, 120, "the killed decode container restarted", every_s=0.5)
    until_sync(lambda: len(now := set(stack.decodes())) == 2 and len(now & old) == 1, 180,
               "the restarted decode registered again (under a new id)", every_s=0.5)
    until_sync(lambda: not stack.not_healthy(), 180, "every container healthy again", every_s=0.5)

    async def after():
        return await asyncio.gather(*(generate(stack.client_url, p, max_tokens, ignore_eos=True) for p in batch))
    assert asyncio.run(after()) == first


def test_compose_down_leaves_nothing_behind(stack):
    assert stack.containers("decode")
    stack.compose("down", "-v", "--remove-orphans", "-t", "10")
    left = {kind: run(DOCKER, *cmd, "--filter", LABEL).split()
            for kind, cmd in {"containers": ("ps", "-aq"), "networks": ("network", "ls", "-q"),
                              "volumes": ("volume", "ls", "-q")}.items()}
    assert left == {"containers": [], "networks": [], "volumes": []}
