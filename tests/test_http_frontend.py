"""The HTTP frontend against a real nats-server and a scripted stand-in for the router, driven by
the official openai client: every Baton error code becomes its HTTP status (400, 413, 429, 500,
503, 504) with an OpenAI error body, before a stream starts or inside it; a client that leaves
gets its request cancelled; /health, /v1/models and /metrics answer."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
import openai
import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import (CancelReply, CancelRequest, GenerateReply, GenerateRequest, SpecStats, StreamChunk,
                                Timing, Usage)
from baton.services.http import server
from baton.shared import config
from baton.shared.bus import Bus
from e2e_cluster import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MODEL = "baton-tiny"


class ScriptedRouter:
    """Serves baton.v1.generate / cancel; the prompt says what to do: "echo" (three tokens),
    "error:<code>", "hang", "forever" (stream until cancelled), "fail-midway"."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.requests: list[GenerateRequest] = []

    async def start(self, url: str, max_in_flight: int = 16) -> Bus:
        bus = await Bus.connect(url, "scripted-router")
        await bus.serve(subjects.GENERATE, GenerateRequest, self.generate, queue=subjects.ROUTER_QUEUE,
                        max_in_flight=max_in_flight)
        await bus.serve(subjects.CANCEL, CancelRequest, self.cancel, queue=subjects.ROUTER_QUEUE)
        return bus

    def generate(self, req: GenerateRequest):
        self.requests.append(req)
        what = req.prompt or "echo"
        if what.startswith("error:"):
            raise BatonError(ErrorCode(what[6:]), f"scripted {what[6:]}")
        return self._stream(req, what) if req.stream else self._unary(req, what)

    async def _unary(self, req: GenerateRequest, what: str) -> GenerateReply:
        if what == "hang":
            await asyncio.sleep(60)  # scripted: a router that does not answer (past the frontend's timeout)
        return GenerateReply(request_id=req.request_id, token_ids=[1, 2, 3], text="a b c", finish_reason="length",
                             usage=Usage(prompt_tokens=1, completion_tokens=3), spec=SpecStats(),
                             timing=Timing(ttft_ms=1.0, total_ms=2.0))

    async def _stream(self, req: GenerateRequest, what: str):
        for i in range(10_000 if what == "forever" else 3):
            if req.request_id in self.cancelled:
                break
            yield StreamChunk(request_id=req.request_id, token_ids=[i + 1], text=f" t{i}")
            await asyncio.sleep(0.02 if what == "forever" else 0)  # scripted pacing of the chunks
            if what == "fail-midway":
                raise BatonError(ErrorCode.INTERNAL, "scripted failure mid-stream")
        yield StreamChunk(request_id=req.request_id, token_ids=[], text="", finished=True, finish_reason="length",
                          usage=Usage(prompt_tokens=1, completion_tokens=3), spec=SpecStats(),
                          timing=Timing(ttft_ms=1.0, total_ms=2.0))

    async def cancel(self, req: CancelRequest) -> CancelReply:
        self.cancelled.append(req.request_id)
        return CancelReply(request_id=req.request_id, cancelled=True)


@contextlib.asynccontextmanager
async def frontend(url: str, router: ScriptedRouter | None = None, max_in_flight: int = 16, **env: str):
    """The frontend in this process on a free port, and (unless None) the scripted router."""
    cfg = config.load(env={f"BATON_HTTP_{k.upper()}": v for k, v in env.items()})
    async with contextlib.AsyncExitStack() as stack:
        if router is not None:
            router_bus = await router.start(url, max_in_flight)
            stack.push_async_callback(router_bus.close, 0.2)  # grace: "hang" handlers are cut short
        bus = await Bus.connect(url, "test-http")
        stack.push_async_callback(bus.close)
        runner, front, port = await server.start(bus, cfg, port=0)
        stack.push_async_callback(runner.cleanup)
        yield f"http://127.0.0.1:{port}", openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                             max_retries=0, timeout=30)


async def status_of(call) -> tuple[int, dict]:
    try:
        await call
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body
    raise AssertionError("expected an HTTP error")


def test_completion_chat_and_models_through_the_openai_client(nats_server):
    async def run():
        router = ScriptedRouter()
        async with frontend(nats_server, router) as (base, client):
            done = await client.completions.create(model=MODEL, prompt="echo", max_tokens=3, temperature=0,
                                                   extra_body={"return_token_ids": True})
            assert done.choices[0].text == "a b c" and done.choices[0].finish_reason == "length"
            assert done.choices[0].model_extra["token_ids"] == [1, 2, 3] and done.usage.total_tokens == 4
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "echo"}],
                                                          stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " t0 t1 t2"
            assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
            assert router.requests[-1].prompt == "USER.\necho\n\nASSISTANT.\n" and router.requests[-1].stream
            assert [m.id for m in (await client.models.list()).data] == [MODEL]
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/health") as resp:
                    assert resp.status == 200 and (await resp.json())["status"] == "ok"
                async with http.get(f"{base}/metrics") as resp:
                    text = await resp.text()
                    assert 'baton_http_requests_total{route="/v1/completions",status="200"} 1.0' in text
                async with http.post(f"{base}/v1/completions", json={"prompt": "echo"},
                                     headers={"X-Request-Id": "my-id-1"}) as resp:
                    assert resp.headers["X-Request-Id"] == "my-id-1" and router.requests[-1].request_id == "my-id-1"
    asyncio.run(run())


@pytest.mark.parametrize("code, status, exc_type", [
    ("bad_request", 400, openai.BadRequestError), ("too_large", 413, openai.APIStatusError),
    ("busy", 429, openai.RateLimitError), ("timeout", 504, openai.InternalServerError),
    ("internal", 500, openai.InternalServerError), ("unavailable", 503, openai.InternalServerError)])
def test_router_error_codes_become_http_statuses(nats_server, code, status, exc_type):
    async def run():
        async with frontend(nats_server, ScriptedRouter()) as (_, client):
            for stream in (False, True):  # a stream that fails before its first chunk gets the status too
                with pytest.raises(exc_type) as exc:
                    result = await client.completions.create(model=MODEL, prompt=f"error:{code}", stream=stream)
                    async for _ in result:
                        pass
                assert exc.value.status_code == status
                assert exc.value.body["code"] == code and exc.value.body["message"] == f"scripted {code}"
                if status in (429, 503):
                    assert exc.value.response.headers["Retry-After"] == "1"
    asyncio.run(run())


def test_errors_the_frontend_finds_itself(nats_server):
    async def run():
        async with frontend(nats_server, None, request_timeout_s="0.5", max_body_bytes="4096") as (base, client):
            # no router at all: 503 unavailable, and /health says so
            status, body = await status_of(client.completions.create(model=MODEL, prompt="echo"))
            assert (status, body["code"]) == (503, "unavailable")
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/health") as resp:
                    assert resp.status == 503 and "router" in (await resp.json())["reason"]
                async with http.post(f"{base}/v1/completions", data=b"{not json") as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["code"] == "bad_request"
                async with http.post(f"{base}/v1/completions", json={"prompt": "x" * 5000}) as resp:
                    assert resp.status == 413 and (await resp.json())["error"]["code"] == "too_large"
                async with http.get(f"{base}/v1/nothing") as resp:
                    assert resp.status == 404 and "error" in await resp.json()
            status, body = await status_of(client.completions.create(model="other", prompt="echo"))
            assert (status, body["code"]) == (404, "model_not_found")
    asyncio.run(run())


def test_timeout_is_504_and_cancels_and_busy_is_429(nats_server):
    async def run():
        router = ScriptedRouter()
        async with frontend(nats_server, router, max_in_flight=1, request_timeout_s="1") as (_, client):
            hanging = asyncio.create_task(client.completions.create(model=MODEL, prompt="hang"))
            await until(lambda: len(router.requests) == 1, 10, "the hanging request taken by the router", every_s=0.02)
            status, body = await status_of(client.completions.create(model=MODEL, prompt="echo"))
            assert (status, body["code"]) == (429, "busy")  # the router's own admission control
            status, body = await status_of(hanging)
            assert (status, body["code"]) == (504, "timeout")
            # we gave up: the router is told
            await until(lambda: router.requests[0].request_id in router.cancelled, 10,
                        "the router told to cancel the timed-out request", every_s=0.02)
    asyncio.run(run())


def test_payload_over_the_nats_limit_is_413(nats_server):
    async def run():
        async with frontend(nats_server, ScriptedRouter()) as (_, client):
            status, body = await status_of(client.completions.create(model=MODEL, prompt="y" * (2 << 20)))
            assert (status, body["code"]) == (413, "too_large") and "max_payload" in body["message"]
    asyncio.run(run())


def test_error_inside_a_stream_is_an_sse_error_event(nats_server):
    async def run():
        async with frontend(nats_server, ScriptedRouter()) as (base, client):
            stream = await client.completions.create(model=MODEL, prompt="fail-midway", stream=True)
            texts = []
            with pytest.raises(openai.APIError, match="scripted failure mid-stream"):
                async for chunk in stream:
                    texts.append(chunk.choices[0].text)
            assert texts == [" t0"]
            async with aiohttp.ClientSession() as http:  # on the wire: the error event, then [DONE]
                async with http.post(f"{base}/v1/completions", json={"prompt": "fail-midway", "stream": True}) as resp:
                    events = [line for line in (await resp.text()).split("\n\n") if line]
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "internal"
            assert events[-1] == "data: [DONE]"
    asyncio.run(run())


def test_a_client_that_leaves_mid_stream_cancels_the_request(nats_server):
    async def run():
        router = ScriptedRouter()
        async with frontend(nats_server, router) as (base, _):
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/completions", json={"prompt": "forever", "stream": True,
                                                                     "max_tokens": 4000}) as resp:
                    assert resp.status == 200
                    await resp.content.readline()
            for _ in range(100):
                if router.cancelled:
                    break
                await asyncio.sleep(0.05)
            assert router.cancelled == [router.requests[0].request_id]
    asyncio.run(run())


KEYS = ("sk-flag-3b9f1c", "sk-file-one-77d2", "sk-file-two-e4a0")


def key_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text(f"# accepted keys\n{KEYS[1]}\n\n  {KEYS[2]}  \n")
    return str(path)


def test_api_keys_guard_every_route_but_health(nats_server, tmp_path):
    async def run():
        async with frontend(nats_server, ScriptedRouter(), api_key=KEYS[0], api_key_file=key_file(tmp_path)) as (
                base, wrong_client):
            async with aiohttp.ClientSession() as http:
                for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                     ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/metrics")):
                    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEYS[0]}):
                        async with http.request(method, base + path, json={"prompt": "echo"}, headers=headers) as resp:
                            error = (await resp.json())["error"]
                            assert (resp.status, error["code"], error["type"]) == \
                                (401, "invalid_api_key", "invalid_request_error"), (path, headers)
                async with http.get(f"{base}/health") as resp:
                    assert resp.status == 200
            with pytest.raises(openai.AuthenticationError) as exc:
                await wrong_client.completions.create(model=MODEL, prompt="echo")
            assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"
            for key in KEYS:
                client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
                done = await client.completions.create(model=MODEL, prompt="echo", max_tokens=3)
                assert (done.choices[0].text, done.choices[0].finish_reason) == ("a b c", "length")
                chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "echo"}])
                assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("a b c", "length")
                chunks = [c async for c in await client.completions.create(model=MODEL, prompt="echo", stream=True)]
                assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == \
                    [(" t0", None), (" t1", None), (" t2", None), ("", "length")]
                chunks = [c async for c in await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "echo"}], stream=True)]
                assert "".join(c.choices[0].delta.content or "" for c in chunks) == " t0 t1 t2"
                assert chunks[-1].choices[0].finish_reason == "length"
                assert [m.id for m in (await client.models.list()).data] == [MODEL]
    asyncio.run(run())


def test_api_keys_appear_in_no_log_and_no_config_dump(nats_server, tmp_path, caplog, capsys):
    from baton import cli
    from baton.shared.bus.server import free_port

    async def run():
        cfg = config.load(env={"BATON_HTTP_API_KEY": KEYS[0], "BATON_HTTP_API_KEY_FILE": key_file(tmp_path),
                               "BATON_HTTP_PORT": str(free_port())})
        base = f"http://127.0.0.1:{cfg.http.port}"
        router_bus = await ScriptedRouter().start(nats_server)
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(stop, await Bus.connect(nats_server, "test-http"), cfg))
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(30):
                while "API keys accepted" not in caplog.text:
                    await asyncio.sleep(0.05)
            for key in (*KEYS, "sk-wrong-but-secret"):
                async with http.post(f"{base}/v1/completions", json={"prompt": "echo", "stream": True},
                                     headers={"Authorization": f"Bearer {key}"}) as resp:
                    assert resp.status == (401 if key not in KEYS else 200)
                    assert key not in await resp.text()
        stop.set()
        await asyncio.wait_for(serving, 30)
        await router_bus.close()
        return cfg

    caplog.set_level(logging.DEBUG)
    cfg = asyncio.run(run())
    assert "3 API keys accepted" in caplog.text
    assert cli.main(["config", "show", "--api-key", KEYS[0]]) == 0
    assert cli.main(["config", "show", "--json", "--api-key", KEYS[0]]) == 0
    dumps = capsys.readouterr().out + config.to_toml(cfg) + json.dumps(config.as_dict(cfg))
    assert 'api_key = "***"' in dumps
    for key in (*KEYS, "sk-wrong-but-secret"):
        assert key not in caplog.text and key not in dumps


def test_an_unreadable_or_empty_key_file_stops_the_start(tmp_path):
    (tmp_path / "empty").write_text("# no keys yet\n\n")
    for path, problem in ((tmp_path / "empty", "holds no key"), (tmp_path / "missing", "No such file")):
        with pytest.raises(config.ConfigError, match=f"http.api_key_file: .*{problem}"):
            config.load(env={"BATON_HTTP_API_KEY_FILE": str(path)})


def test_several_choices_are_served_and_streamed_with_their_indices(nats_server):
    """n = 2 over two prompts: four generate requests; unary answers hold four choices in order,
    a stream interleaves four choices' chunks and ends once all four finished."""
    async def run():
        router = ScriptedRouter()
        async with frontend(nats_server, router) as (base, client):
            done = await client.completions.create(model=MODEL, prompt=["echo", "echo"], n=2, max_tokens=3)
            assert [c.index for c in done.choices] == [0, 1, 2, 3] and {c.text for c in done.choices} == {"a b c"}
            assert done.usage.prompt_tokens == 2 and done.usage.completion_tokens == 12
            assert len(router.requests) == 4 and len({r.request_id for r in router.requests}) == 4
            stream = await client.completions.create(model=MODEL, prompt=["echo", "echo"], n=2, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                     for i in range(4)}
            assert texts == {i: " t0 t1 t2" for i in range(4)}
            finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
            assert sorted(finished) == [0, 1, 2, 3]
            assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
            failing = await status_of(client.completions.create(model=MODEL, prompt=["echo", "error:busy"]))
            assert failing[0] == 429
    asyncio.run(run())
