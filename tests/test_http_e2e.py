"""End to end through HTTP: `baton up --http` (its own nats-server, service processes, NIXL) driven
by the official openai client. Greedy completions and chats, unary and streamed, carry exactly the
tokens and text of the same request over the NATS API; real router errors keep their statuses; a
client that leaves mid-stream frees its decode capacity; `baton health` sees every service."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import subprocess
import sys
import threading
import uuid

import openai
import pytest

from baton.proto import subjects
from baton.proto.public import GenerateReply, GenerateRequest
from baton.services.http.api import render_chat
from baton.shared.bus import Bus
from baton.shared.bus.server import free_port
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.process import stop
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from e2e_cluster import print_logs, until_sync, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
MODEL = "baton-tiny"
WORKER_FLAGS = ["--threads", "1", "--num-pages", "512", "--num-slots", "16"]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`baton up --http` as a user runs it; yields (NATS URL, OpenAI base URL, HTTP port, log dir)."""
    tmp = tmp_path_factory.mktemp("up")
    port = free_port()
    env = {**os.environ, "BATON_STATE": str(tmp / "up.json")}
    # --no-auth: this test also talks to the internal subjects to check capacity (tests/test_security.py
    # covers the generated users)
    proc = subprocess.Popen([sys.executable, "-m", "baton", "up", "--http", "--http-port", str(port), "--no-auth",
                             "--log-dir", str(tmp / "logs"), *WORKER_FLAGS], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=300)
            if line.startswith("baton ready:"):
                break
            assert proc.poll() is None, f"baton up exited: {line}"
        nats_url = re.search(r"baton ready: (\S+)", line).group(1)
        base = re.search(r"OpenAI API on (\S+)", line).group(1)
        yield nats_url, base, port, tmp / "logs"
    except BaseException:
        print_logs(str(tmp / "logs"))
        raise
    finally:
        stop(proc, grace_s=60)


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up[1], api_key="none", max_retries=0, timeout=300)


async def nats_generate(url: str, **fields) -> GenerateReply:
    async with await Bus.connect(url, "test") as bus:
        return await bus.request(subjects.GENERATE, GenerateRequest(**fields), GenerateReply, timeout=300)


def stream_text(stream) -> tuple[str, list[int], str | None, object]:
    text, ids, reason, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            ids += (choice.model_extra or {}).get("token_ids", [])
            reason = choice.finish_reason or reason
    return text, ids, reason, usage


def test_greedy_completions_match_the_nats_api(up, client):
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    for prompt in ("To be, or not to be, that is the question:", heldout_prompts(tok, 1, 80, seed=3)[0]):
        field = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
        want = asyncio.run(nats_generate(up[0], **field, max_tokens=32))
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = got.choices[0]
        assert choice.model_extra["token_ids"] == want.token_ids and choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == \
            (want.usage.prompt_tokens, want.usage.completion_tokens)
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"return_token_ids": True})
        text, ids, reason, usage = stream_text(streamed)
        assert (text, ids, reason) == (want.text, want.token_ids, want.finish_reason)
        assert usage.completion_tokens == want.usage.completion_tokens


def test_logprobs_echo_and_several_choices_match_the_nats_api(up, client):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1) and chat logprobs carry the
    NATS API's values; a prompt list with n = 2 gives every choice the same greedy reply."""
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    prompt = heldout_prompts(tok, 1, 40, seed=5)[0]
    want = asyncio.run(nats_generate(up[0], token_ids=prompt, max_tokens=1, logprobs=1, prompt_logprobs=1))
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == [None] + want.prompt_logprobs.logprobs + want.logprobs.logprobs
    assert lp.tokens == [tok.decode([t]) for t in prompt + want.token_ids]
    assert got.choices[0].text == tok.decode(prompt) + want.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who is there?"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    want = asyncio.run(nats_generate(up[0], prompt=render_chat([{"role": "user", "content": "Who is there?"}]),
                                     max_tokens=8, logprobs=3))
    content = chat.choices[0].logprobs.content
    # the second of two identical prompts starts from prefill's prefix cache and computes only its
    # last position: a GEMM of another shape, so the values agree to rounding, not bit for bit
    assert [t.token for t in content] == [tok.decode([t]) for t in want.logprobs.token_ids]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs.logprobs, rel=1e-5, abs=1e-6)
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        pytest.approx(top, rel=1e-5, abs=1e-6) for top in want.logprobs.top_logprobs]
    several = client.completions.create(model=MODEL, prompt=["To be", "Good night"], n=2, max_tokens=8, temperature=0)
    texts = [c.text for c in sorted(several.choices, key=lambda c: c.index)]
    firsts = [asyncio.run(nats_generate(up[0], prompt=p, max_tokens=8)).text for p in ("To be", "Good night")]
    assert texts == [firsts[0], firsts[0], firsts[1], firsts[1]]


def test_greedy_chat_matches_the_nats_api_with_the_rendered_prompt(up, client):
    messages = [{"role": "system", "content": "A scene in Verona."}, {"role": "user", "content": "Who is there?"}]
    want = asyncio.run(nats_generate(up[0], prompt=render_chat(messages), max_tokens=24, stop=["\n\n"]))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=["\n\n"])
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == want.usage.completion_tokens
    text, _, reason, _ = stream_text(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                                     temperature=0, stop=["\n\n"], stream=True))
    assert (text, reason) == (want.text, want.finish_reason)


def test_a_follow_up_chat_turn_reports_the_prompt_tokens_prefill_reused(up, client):
    """The second turn resends the first turn's prompt and answer: prefill starts from its cache
    (usage.prompt_tokens_details.cached_tokens, OpenAI's field) and the answer is unchanged."""
    messages = [{"role": "system", "content": "Verona, a street."}, {"role": "user", "content": "Who goes there?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And what of Romeo?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 4 <= cached <= first.usage.prompt_tokens < second.usage.prompt_tokens
    want = asyncio.run(nats_generate(up[0], prompt=render_chat(messages), max_tokens=16))
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert want.usage.cached_tokens == want.usage.prompt_tokens - 1  # the same prompt again: all but its last


def test_router_errors_keep_their_status(up, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    assert exc.value.body["code"] == "bad_request" and "max_tokens" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[5, 999_999], max_tokens=4)
    assert "vocabulary" in exc.value.body["message"]
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="x" * 600_000, max_tokens=4)
    assert (exc.value.status_code, exc.value.body["code"]) == (413, "too_large")
    for stream in (False, True):  # prompt + max_tokens beyond the model's context: 400, as OpenAI-compatible servers
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=MODEL, prompt=list(range(1000)) * 3, max_tokens=4000, stream=stream)
        assert exc.value.body["code"] == "bad_request" and "context" in exc.value.body["message"]


def test_leaving_mid_stream_frees_the_capacity(up, client):
    """The client leaves after three chunks of a 3000-token stream: the frontend cancels the
    request, the router ends it long before its end (as a cancel, or as a stream nobody reads any
    more, whichever reaches it first: under load either may), and every page and slot is free."""
    rid = f"leaving-{uuid.uuid4().hex[:12]}"
    # long enough (no end at EOS, 3000 tokens: seconds of decoding) that the client leaves it running
    stream = client.completions.create(model=MODEL, prompt="Now is the winter of our discontent", max_tokens=3000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       extra_headers={"X-Request-Id": rid})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    asyncio.run(wait_all_free(up[0], timeout_s=30))
    until_sync(lambda: re.search(rf"cancelled {rid} \(was running: (True|False)\)", logs_of(up[3], "http")), 30,
               "the frontend's cancel of the request")  # logged when its reply comes
    ended = until_sync(lambda: router_log_of(up[3], rid), 30, "the router's log of the request")
    assert ended["outcome"] in ("abort", "disconnected") and ended["completion_tokens"] < 3000, ended
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=4).choices[0].text is not None


def logs_of(log_dir, role: str) -> str:
    return "".join(path.read_text() for path in log_dir.glob(f"{role}-*.log"))


def router_log_of(log_dir, request_id: str) -> dict | None:
    """The router's request log line (`baton.requests`) of `request_id`, or None."""
    for line in logs_of(log_dir, "router").splitlines():
        if f'"request_id": "{request_id}"' in line and '"service": "router"' in line:
            return json.loads(line[line.index("{"):])
    return None


def test_baton_health_sees_every_service(up):
    for role in ("registry", "router", "prefill", "decode", "http"):
        done = subprocess.run([sys.executable, "-m", "baton", "health", role, "--http-port", str(up[2])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (role, done.stdout, done.stderr)
