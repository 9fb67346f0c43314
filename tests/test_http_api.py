"""The OpenAI wire format without sockets: parsing into GenerateRequest, the chat template, answers
and stream chunks, and the error-code -> HTTP status table."""
from pathlib import Path

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import GenerateReply, Logprobs, SpecStats, StreamChunk, Timing, Usage
from baton.services.http import api
from baton.services.http.api import HttpError
from baton.services.http.logprobs import Vocab

pytestmark = pytest.mark.unit
MODEL = "baton-tiny"


def test_completion_prompt_forms():
    assert api.parse_completion({"model": MODEL, "prompt": "hi"}, MODEL).request.prompt == "hi"
    assert api.parse_completion({"model": MODEL, "prompt": ["hi"]}, MODEL).request.prompt == "hi"
    assert api.parse_completion({"model": MODEL, "prompt": [1, 2, 3]}, MODEL).request.token_ids == [1, 2, 3]
    assert api.parse_completion({"model": MODEL, "prompt": [[4, 5]]}, MODEL).request.token_ids == [4, 5]
    call = api.parse_completion({"prompt": "hi"}, MODEL)  # model may be left out
    assert call.model == MODEL and call.kind == "completion" and call.response_id.startswith("cmpl-")


def test_openai_defaults_and_mapped_fields():
    r = api.parse_completion({"model": MODEL, "prompt": "hi"}, MODEL).request
    assert (r.max_tokens, r.temperature, r.top_p, r.stream, r.stop, r.draft_tokens) == (16, 1.0, 1.0, False, [], None)
    call = api.parse_completion({"model": MODEL, "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                                 "seed": 3, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
                                 "stop_token_ids": [2], "return_token_ids": True, "user": "x", "n": 1,
                                 "draft_tokens": 0, "presence_penalty": 0, "logprobs": None,
                                 "unknown_extension": 1}, MODEL)
    r = call.request
    assert (r.max_tokens, r.temperature, r.top_p, r.seed, r.stop, r.stream, r.stop_token_ids, r.draft_tokens) == \
        (7, 0.0, 0.5, 3, ["\n"], True, [2], 0)
    assert call.include_usage and call.return_token_ids
    chat = api.parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, MODEL, 99)
    assert chat.request.max_tokens == 99 and chat.response_id.startswith("chatcmpl-")
    chat = api.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5,
                           "max_tokens": 9}, MODEL, 99)
    assert chat.request.max_tokens == 5


def test_chat_template_is_a_play_script():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who goes there?"},
                {"role": "assistant", "content": [{"type": "text", "text": "A friend."}]},
                {"role": "user", "content": "Stand."}]
    assert api.render_chat(messages) == ("SYSTEM.\nBe brief.\n\nUSER.\nWho goes there?\n\nASSISTANT.\nA friend.\n\n"
                                         "USER.\nStand.\n\nASSISTANT.\n")


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": ""}, None, None),  # empty prompt: the router refuses it (bad_request from NATS)
    ({"prompt": 3}, "prompt", 400),
    ({"prompt": ["a", "b"]}, None, None),  # a batch: one choice per prompt
    ({"prompt": ["a", 3]}, "prompt", 400),
    ({"prompt": []}, "prompt", 400),
    ({"prompt": [[1], []]}, "prompt", 400),
    ({"prompt": [1, -2]}, "prompt", 400),
    ({"prompt": "x", "model": "gpt-4"}, "model", 404),
    ({"prompt": "x", "n": 2}, None, None),
    ({"prompt": "x", "n": 0}, "n", 400),
    ({"prompt": ["x"] * 8, "n": 17}, "n", 400),  # 136 choices: over MAX_CHOICES
    ({"prompt": "x", "echo": True, "logprobs": 2}, None, None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", 400),
    ({"prompt": "x", "logprobs": -1}, "logprobs", 400),
    ({"prompt": "x", "logprobs": True}, "logprobs", 400),
    ({"prompt": "x", "echo": 1}, "echo", 400),
    ({"prompt": "x", "best_of": 3}, "best_of", 400),
    ({"prompt": "x", "ignore_eos": True}, None, None),  # vLLM's extension, supported (aiperf sends it)
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos", 400),
    ({"prompt": "x", "min_tokens": 4}, None, None),  # vLLM's extension; 0..max_tokens is the router's check
    ({"prompt": "x", "min_tokens": 1.5}, "min_tokens", 400),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "temperature": 3}, "temperature", 400),
    ({"prompt": "x", "top_p": 0}, "top_p", 400),
    ({"prompt": "x", "seed": -1}, "seed", 400),
    ({"prompt": "x", "draft_tokens": -1}, "draft_tokens", 400),
    ({"prompt": "x", "draft_tokens": 17}, "draft_tokens", 400),
    ({"prompt": "x", "draft_tokens": 1.5}, "draft_tokens", 400),
    ({"prompt": "x", "draft_tokens": True}, "draft_tokens", 400),
    ({"prompt": "x", "stop": [1]}, "stop", 400),
    ({"prompt": "x", "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2}, None, None),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty", 400),
    ({"prompt": "x", "presence_penalty": "1"}, "presence_penalty", 400),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", 400),
    ({"prompt": "x", "stream": "yes"}, "stream", 400),
])
def test_bad_completion_fields_are_400_naming_the_param(body, param, status):
    if status is None:
        api.parse_completion(body, MODEL)
        return
    with pytest.raises(HttpError) as exc:
        api.parse_completion(body, MODEL)
    assert exc.value.status == status and exc.value.param == param
    body = exc.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


@pytest.mark.parametrize("messages", [None, [], ["hi"], [{"role": "narrator", "content": "x"}],
                                      [{"role": "user", "content": 3}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]])
def test_bad_chat_messages_are_400(messages):
    with pytest.raises(HttpError) as exc:
        api.parse_chat({"messages": messages}, MODEL, 16)
    assert exc.value.status == 400 and exc.value.param == "messages"


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_chat_with_zero_max_tokens_is_400_not_the_default(field):
    with pytest.raises(HttpError) as exc:
        api.parse_chat({"messages": [{"role": "user", "content": "x"}], field: 0}, MODEL, 256)
    assert exc.value.status == 400 and "at least 1" in exc.value.message


def test_tools_are_refused_not_ignored():
    with pytest.raises(HttpError, match="tools"):
        api.parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, MODEL, 16)


def test_every_error_code_has_a_status():
    assert {code: api.STATUS[code][0] for code in ErrorCode} == {
        ErrorCode.BAD_REQUEST: 400, ErrorCode.TOO_LARGE: 413, ErrorCode.BUSY: 429, ErrorCode.TIMEOUT: 504,
        ErrorCode.INTERNAL: 500, ErrorCode.UNAVAILABLE: 503, ErrorCode.DUPLICATE_WORKER: 500}
    err = HttpError.from_baton(BatonError(ErrorCode.BUSY, "full"))
    assert err.body() == {"error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "busy"}}


def reply() -> GenerateReply:
    return GenerateReply(request_id="r", token_ids=[5, 6], text=" to be", finish_reason="length",
                         usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1), spec=SpecStats(),
                         timing=Timing(ttft_ms=1.0, total_ms=2.0))


def test_answers_have_the_openai_shape():
    call = api.parse_completion({"prompt": "x", "return_token_ids": True}, MODEL)
    body = api.response(call, [reply()])
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": " to be", "logprobs": None, "finish_reason": "length",
                                "token_ids": [5, 6]}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    chat = api.response(api.parse_chat({"messages": [{"role": "user", "content": "x"}]}, MODEL, 8), [reply()])
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": " to be"}


def test_stream_chunks():
    call = api.parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                           "stream_options": {"include_usage": True}}, MODEL, 8)
    opening, = api.first_chunks(call)
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""} and opening["usage"] is None
    middle = api.stream_chunks(call, StreamChunk(request_id="r", token_ids=[5], text=" to"))
    assert [c["choices"][0]["delta"] for c in middle] == [{"content": " to"}]
    last = api.stream_chunks(call, StreamChunk(request_id="r", token_ids=[], text="", finished=True,
                                               finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=1),
                                               spec=SpecStats(), timing=Timing(ttft_ms=1.0, total_ms=2.0)))
    assert last[0]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    usage_chunk, = api.last_chunks(call, [Usage(prompt_tokens=3, completion_tokens=1)])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 4
    plain = api.parse_completion({"prompt": "x", "stream": True}, MODEL)
    assert api.first_chunks(plain) == []
    assert "usage" not in api.stream_chunks(plain, StreamChunk(request_id="r", token_ids=[5], text=" to"))[0]


# --- logprobs and echo ------------------------------------------------------------------------
MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "baton-tiny"


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab(MODEL_DIR)


def test_penalties_map_to_the_request():
    r = api.parse_completion({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,
                              "repetition_penalty": 1.1}, MODEL).request
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty) == (0.5, -1.0, 1.1)
    r = api.parse_chat({"messages": [{"role": "user", "content": "x"}]}, MODEL, 8).request
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty) == (0.0, 0.0, 1.0)


def test_logprob_fields_map_to_the_request():
    r = api.parse_completion({"prompt": "x", "logprobs": 0}, MODEL).request
    assert (r.logprobs, r.prompt_logprobs) == (0, None)  # 0: the chosen token's logprob, not "off"
    r = api.parse_completion({"prompt": "x", "logprobs": 3, "echo": True}, MODEL).request
    assert (r.logprobs, r.prompt_logprobs) == (3, 3)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert api.parse_chat({**chat, "logprobs": True, "top_logprobs": 5}, MODEL, 8).request.logprobs == 5
    assert api.parse_chat({**chat, "logprobs": True}, MODEL, 8).request.logprobs == 0
    assert api.parse_chat({**chat, "logprobs": False}, MODEL, 8).request.logprobs is None
    with pytest.raises(HttpError, match="top_logprobs"):
        api.parse_chat({**chat, "top_logprobs": 2}, MODEL, 8)
    with pytest.raises(HttpError, match="top_logprobs"):
        api.parse_chat({**chat, "logprobs": True, "top_logprobs": 21}, MODEL, 8)


def logprob_reply(vocab: Vocab) -> GenerateReply:
    ids = vocab.tokenizer.encode(" to be")
    prompt = vocab.tokenizer.encode("Ay, and")
    lp = Logprobs(token_ids=ids, logprobs=[-0.25] * len(ids), top_ids=[[ids[0]] + [9]] * len(ids),
                  top_logprobs=[[-0.25, -2.0]] * len(ids))
    plp = Logprobs(token_ids=prompt[1:], logprobs=[-1.5] * (len(prompt) - 1), top_ids=[[7]] * (len(prompt) - 1),
                   top_logprobs=[[-0.5]] * (len(prompt) - 1))
    return GenerateReply(request_id="r", token_ids=ids, text=" to be", finish_reason="length",
                         usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(ids)), spec=SpecStats(),
                         timing=Timing(ttft_ms=1.0, total_ms=2.0), logprobs=lp, prompt_logprobs=plp,
                         prompt_token_ids=prompt)


def test_completion_logprobs_with_echo_have_the_legacy_shape(vocab):
    reply = logprob_reply(vocab)
    call = api.parse_completion({"prompt": "Ay, and", "logprobs": 1, "echo": True}, MODEL)
    choice, = api.response(call, [reply], vocab)["choices"]
    assert choice["text"] == "Ay, and to be"
    lp, n_prompt = choice["logprobs"], len(reply.prompt_token_ids)
    assert lp["tokens"] == [vocab.text(t) for t in reply.prompt_token_ids + reply.token_ids]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"] == [None] + [-1.5] * (n_prompt - 1) + [-0.25] * len(reply.token_ids)
    assert lp["top_logprobs"][0] is None
    # the chosen token is in each map, as in vLLM, next to the most likely ones
    assert lp["top_logprobs"][1] == {vocab.text(7): -0.5, vocab.text(reply.prompt_token_ids[1]): -1.5}
    assert lp["top_logprobs"][n_prompt] == {vocab.text(reply.token_ids[0]): -0.25, vocab.text(9): -2.0}
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]


def test_completion_logprobs_without_echo_cover_the_completion_only(vocab):
    reply = logprob_reply(vocab)
    call = api.parse_completion({"prompt": "Ay, and", "logprobs": 1}, MODEL)
    choice, = api.response(call, [reply], vocab)["choices"]
    assert choice["text"] == " to be" and choice["logprobs"]["token_logprobs"] == [-0.25] * len(reply.token_ids)


def test_echo_of_token_ids_decodes_the_prompt(vocab):
    reply = logprob_reply(vocab)
    call = api.parse_completion({"prompt": reply.prompt_token_ids, "echo": True}, MODEL)
    assert call.needs_vocab
    choice, = api.response(call, [reply], vocab)["choices"]
    assert choice["text"] == "Ay, and to be" and choice["logprobs"] is None


def test_chat_logprobs_have_the_chat_shape(vocab):
    reply = logprob_reply(vocab)
    call = api.parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
                          MODEL, 8)
    content = api.response(call, [reply], vocab)["choices"][0]["logprobs"]["content"]
    first = reply.token_ids[0]
    assert content[0] == {"token": vocab.text(first), "logprob": -0.25, "bytes": list(vocab.text(first).encode()),
                          "top_logprobs": [{"token": vocab.text(first), "logprob": -0.25,
                                            "bytes": list(vocab.text(first).encode())},
                                           {"token": vocab.text(9), "logprob": -2.0, "bytes": vocab.raw_bytes(9)}]}
    assert len(content) == len(reply.token_ids)


def test_raw_bytes_of_tokens_rebuild_the_text_even_inside_a_character(vocab):
    text = "héllo wörld — ✓"
    ids = vocab.tokenizer.encode(text)
    assert any(vocab.text(t) == "\ufffd" for t in ids)  # some token holds part of a character
    assert bytes(b for t in ids for b in vocab.raw_bytes(t)).decode() == text


def test_streamed_echo_comes_once_and_offsets_run_on(vocab):
    reply = logprob_reply(vocab)
    call = api.parse_completion({"prompt": "Ay, and", "logprobs": 0, "echo": True, "stream": True}, MODEL)
    state = api.StreamState()
    ids, lp = reply.token_ids, reply.logprobs
    first = StreamChunk(request_id="r", token_ids=ids[:1], text=vocab.text(ids[0]), logprobs=lp[:1],
                        prompt_logprobs=reply.prompt_logprobs, prompt_token_ids=reply.prompt_token_ids)
    second = StreamChunk(request_id="r", token_ids=ids[1:], text=vocab.tokenizer.decode(ids[1:]), logprobs=lp[1:])
    a, = api.stream_chunks(call, first, vocab, state)
    b, = api.stream_chunks(call, second, vocab, state)
    assert a["choices"][0]["text"] + b["choices"][0]["text"] == "Ay, and to be"
    offsets = a["choices"][0]["logprobs"]["text_offset"] + b["choices"][0]["logprobs"]["text_offset"]
    tokens = a["choices"][0]["logprobs"]["tokens"] + b["choices"][0]["logprobs"]["tokens"]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


# --- several choices ----------------------------------------------------------------------------
def test_prompt_lists_and_n_become_one_request_per_choice_prompt_major():
    call = api.parse_completion({"prompt": ["a", [5, 6]], "n": 2, "seed": 9, "temperature": 1.0}, MODEL)
    assert [(r.prompt, r.token_ids) for r in call.requests] == [("a", None), ("a", None), (None, [5, 6]), (None, [5, 6])]
    assert [r.seed for r in call.requests] == [9, 10, 9, 10]  # the n choices of a prompt differ
    ids = [r.request_id for r in api.with_request_id(call, "x" * 64).requests]
    assert ids == [f"{'x' * 56}-{k}" for k in range(4)]
    one = api.with_request_id(api.parse_completion({"prompt": "a"}, MODEL), "mine")
    assert [r.request_id for r in one.requests] == ["mine"]
    chat = api.parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 3}, MODEL, 8)
    assert len(chat.requests) == 3 and len({r.prompt for r in chat.requests}) == 1


def test_several_choices_answer_with_indices_and_usage_counting_each_prompt_once():
    call = api.parse_completion({"prompt": ["a", "b"], "n": 2}, MODEL)
    replies = [GenerateReply(request_id=f"r{k}", token_ids=[k], text=f"t{k}", finish_reason="length",
                             usage=Usage(prompt_tokens=3 + k // 2, completion_tokens=1, cached_tokens=k // 2),
                             spec=SpecStats(),
                             timing=Timing(ttft_ms=1.0, total_ms=2.0)) for k in range(4)]
    body = api.response(call, replies)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]
    assert body["usage"] == {"prompt_tokens": 3 + 4, "completion_tokens": 4, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0 + 1}}
    streamed = api.stream_chunks(call, StreamChunk(request_id="r2", token_ids=[2], text="t2"), index=2)
    assert streamed[0]["choices"][0]["index"] == 2
