"""The OpenAI wire format, without sockets: request bodies -> GenerateRequest, replies and stream
chunks -> OpenAI JSON, Baton error codes -> HTTP statuses and OpenAI error bodies.

What is supported, and what is refused with 400 rather than silently ignored, is listed in
docs/deployment.md ("OpenAI-compatible HTTP"). Unknown body fields are ignored (as vLLM does),
so clients that send extra options keep working.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import MAX_DRAFT_TOKENS, MAX_LOGPROBS, GenerateReply, GenerateRequest, StreamChunk, Usage

from .logprobs import Vocab, chat_logprobs, completion_logprobs

# Baton error code -> (HTTP status, OpenAI error type). busy is 429 so clients back off and retry
# (the openai client does, honouring Retry-After); a missing router is 503. duplicate_worker is
# between workers and the registry and never reaches a client; it is listed so every code has one.
STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.BUSY: (429, "rate_limit_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.DUPLICATE_WORKER: (500, "server_error"),
}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "abort", "error": "error"}


class HttpError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    @classmethod
    def from_baton(cls, exc: BatonError) -> "HttpError":
        status, kind = STATUS[exc.code]
        return cls(status, exc.message, kind, exc.code.value)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, code=ErrorCode.BAD_REQUEST.value, param=param)


MAX_CHOICES = 128  # choices one HTTP request may ask for (prompts × n): each is a generate request


@dataclass(frozen=True)
class Call:
    """One parsed OpenAI request: what goes to the router, and how to shape the answer. Each choice
    is one GenerateRequest (`requests`, prompt-major: prompt j's i-th choice is j * n + i); `n`
    choices of one prompt differ by seed."""
    kind: str  # "completion" | "chat"
    model: str
    requests: tuple[GenerateRequest, ...]
    n: int = 1  # choices per prompt
    include_usage: bool = False  # stream_options.include_usage
    return_token_ids: bool = False  # vLLM's extension: choices carry "token_ids"
    echo: bool = False  # completions: the answer starts with the prompt (and its logprobs, when asked for)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{self.id}"

    @property
    def request(self) -> GenerateRequest:
        """The first choice's request: what every choice shares (sampling, streaming, logprobs)."""
        return self.requests[0]

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def needs_vocab(self) -> bool:
        """Token ids must be turned into text here: for logprobs, or to echo a prompt of ids."""
        return self.request.logprobs is not None or (self.echo and any(r.prompt is None for r in self.requests))


@dataclass
class StreamState:
    """What a streamed answer carries from chunk to chunk: how much text went out (completions'
    text_offset counts from the start of the answer) and whether the echo was sent."""
    offset: int = 0
    echoed: bool = False


# --- parsing ---------------------------------------------------------------------------------
def _get(body: dict, name: str, types: type | tuple, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(f"'{name}': expected {_names(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise bad(f"'{name}': expected {_names(types)}, got {type(value).__name__}", name)
    return value


def _names(types: type | tuple) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({"int": "integer", "float": "number", "str": "string", "bool": "boolean",
                        "list": "array", "dict": "object"}.get(t.__name__, t.__name__) for t in types)


def _unsupported(body: dict, name: str, allowed: tuple = (None, False, 0, [], {}, "")) -> None:
    """Refuse a feature Baton lacks unless the value asks for nothing (types matter: True is not 1)."""
    value = body.get(name)
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise bad(f"'{name}' is not supported by Baton (got {value!r})", name)


def _common(body: dict, served_model: str, max_tokens: int) -> dict[str, Any]:
    """Fields completions and chat share; returns GenerateRequest keyword arguments."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = _get(body, "model", str, served_model)
    if model != served_model:
        raise HttpError(404, f"the model '{model}' does not exist; this server serves '{served_model}'",
                        code="model_not_found", param="model")
    for name in ("logit_bias", "tools", "functions"):
        _unsupported(body, name)
    fmt = _get(body, "response_format", dict, {"type": "text"})
    if fmt.get("type") != "text":
        raise bad("'response_format': only {\"type\": \"text\"} is supported", "response_format")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop': expected a string or an array of strings", "stop")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
        raise bad("'stop_token_ids': expected an array of token ids", "stop_token_ids")
    seed = _get(body, "seed", int)
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise bad(f"'seed': must be in 0..2^64-1, got {seed}", "seed")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0 <= temperature <= 2:
        raise bad(f"'temperature': must be in [0, 2], got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise bad(f"'top_p': must be in (0, 1], got {top_p}", "top_p")
    if max_tokens < 1:
        raise bad(f"'max_tokens': must be at least 1, got {max_tokens}", "max_tokens")
    draft_tokens = _get(body, "draft_tokens", int)  # Baton's extension: a cap on speculation
    if draft_tokens is not None and not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise bad(f"'draft_tokens': must be in 0..{MAX_DRAFT_TOKENS}, got {draft_tokens}", "draft_tokens")
    penalties = {name: float(_get(body, name, (int, float), default)) for name, default in
                 (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))}
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= penalties[name] <= 2:
            raise bad(f"'{name}': must be in [-2, 2], got {penalties[name]}", name)
    if not 0 < penalties["repetition_penalty"] <= 10:
        raise bad(f"'repetition_penalty': must be in (0, 10], got {penalties['repetition_penalty']}", "repetition_penalty")
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, **penalties,
                stream=_get(body, "stream", bool, False), stop=stop, stop_token_ids=stop_ids,
                ignore_eos=_get(body, "ignore_eos", bool, False), min_tokens=_get(body, "min_tokens", int, 0),
                draft_tokens=draft_tokens)


def _options(body: dict) -> dict[str, Any]:
    options = _get(body, "stream_options", dict, {})
    return dict(include_usage=bool(options.get("include_usage")) and bool(body.get("stream")),
                return_token_ids=_get(body, "return_token_ids", bool, False))


def parse_completion(body: dict, served_model: str) -> Call:
    """POST /v1/completions. `prompt`: a string, an array of token ids, or an array of either
    (OpenAI's batch form: one choice, or `n`, per prompt)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _unsupported(body, "suffix")
    _unsupported(body, "best_of", (None, 1))
    logprobs, echo = _top(body, "logprobs"), _get(body, "echo", bool, False)
    prompts = _prompts(body.get("prompt"))
    max_tokens = _get(body, "max_tokens", int, COMPLETION_DEFAULT_MAX_TOKENS)
    common = _common(body, served_model, max_tokens)
    n = _choices(body, len(prompts))
    requests = tuple(GenerateRequest(**prompt, **{**common, "seed": _seed(common["seed"], i, n)}, logprobs=logprobs,
                                     prompt_logprobs=logprobs if echo else None)
                     for prompt in prompts for i in range(n))
    return Call("completion", body.get("model") or served_model, requests, n, echo=echo, **_options(body))


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """GenerateRequest prompt fields for each prompt of a completions body."""
    if isinstance(prompt, str) or _token_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _token_ids(p) for p in prompt):
        raise bad("'prompt': expected a string, an array of token ids, or an array of either", "prompt")
    if any(t < 0 for p in prompt if not isinstance(p, str) for t in p):
        raise bad("'prompt': token ids must be >= 0", "prompt")
    return [dict(prompt=p) if isinstance(p, str) else dict(token_ids=p) for p in prompt]


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _choices(body: dict, prompts: int) -> int:
    n = _get(body, "n", int, 1)
    if n < 1:
        raise bad(f"'n': must be at least 1, got {n}", "n")
    if n * prompts > MAX_CHOICES:
        raise bad(f"'n' × prompts: {n * prompts} choices; at most {MAX_CHOICES} per request", "n")
    return n


def _seed(seed: int | None, choice: int, n: int) -> int | None:
    """Choice i of n gets its own seed, so seeded choices differ from each other and repeat as a set."""
    return seed if seed is None or n == 1 else (seed + choice) % 2 ** 64


def _top(body: dict, name: str) -> int | None:
    """A count of most likely alternatives per token, 0 .. MAX_LOGPROBS."""
    value = _get(body, name, int)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad(f"'{name}': must be between 0 and {MAX_LOGPROBS}, got {value}", name)
    return value


ROLES = {"system": "SYSTEM", "developer": "SYSTEM", "user": "USER", "assistant": "ASSISTANT"}


def render_chat(messages: Any) -> str:
    """The chat template. baton-tiny was trained on plays, so a conversation is written as one:
    each message is its speaker in capitals with a period on a line of its own, then the text,
    then a blank line; the prompt ends with the assistant's name, for the model to speak next.

        SYSTEM.\\nYou are terse.\\n\\nUSER.\\nHello\\n\\nASSISTANT.\\n
    """
    if not isinstance(messages, list) or not messages:
        raise bad("'messages': expected a non-empty array of messages", "messages")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"'messages[{i}]': expected an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"'messages[{i}].role': must be one of {', '.join(ROLES)}; got {role!r}", "messages")
        parts.append(f"{ROLES[role]}.\n{_content(message.get('content'), i)}\n\n")
    return "".join(parts) + "ASSISTANT.\n"


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"'messages[{i}].content': expected a string or an array of text parts", "messages")


def parse_chat(body: dict, served_model: str, default_max_tokens: int) -> Call:
    """POST /v1/chat/completions: messages rendered by `render_chat` into one text prompt."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _unsupported(body, "tool_choice", (None, "none", "auto"))
    top = _top(body, "top_logprobs")
    if _get(body, "logprobs", bool, False):
        logprobs = top or 0
    elif top:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = None
    prompt = render_chat(body.get("messages"))
    max_tokens = _get(body, "max_completion_tokens", int)  # 0 is a value (refused below), not "unset"
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, default_max_tokens)
    common = _common(body, served_model, max_tokens)
    n = _choices(body, 1)
    requests = tuple(GenerateRequest(prompt=prompt, **{**common, "seed": _seed(common["seed"], i, n)}, logprobs=logprobs)
                     for i in range(n))
    return Call("chat", body.get("model") or served_model, requests, n, **_options(body))


def with_request_id(call: Call, request_id: str | None) -> Call:
    """The ids the router knows the choices by (so they can be cancelled when the client leaves):
    the request's own, and with several choices that id with the choice's index appended."""
    base = request_id or f"http-{call.id}"
    if len(call.requests) == 1:
        return replace(call, requests=(msgspec.structs.replace(call.request, request_id=base),))
    return replace(call, requests=tuple(msgspec.structs.replace(r, request_id=f"{base[:56]}-{k}") for k, r in enumerate(call.requests)))


# --- answers ---------------------------------------------------------------------------------
def usage(u: Usage | None) -> dict[str, int] | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def total_usage(call: Call, usages: list[Usage]) -> Usage:
    """Over every choice (in `call.requests` order): each prompt counted once, as OpenAI does."""
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages[::call.n]),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages[::call.n]))


def _choice(call: Call, index: int, text: str, token_ids: list[int], finish_reason: str | None, delta: bool,
            logprobs: dict | None = None) -> dict:
    reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
    if call.kind == "chat":
        body = {"delta": {"content": text} if text or not reason else {}} if delta else \
            {"message": {"role": "assistant", "content": text}}
        choice = {"index": index, **body, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if call.return_token_ids:
        choice["token_ids"] = token_ids
    return choice


def _shaped(call: Call, index: int, part: GenerateReply | StreamChunk, vocab: Vocab | None,
            state: StreamState) -> tuple[str, dict | None]:
    """Choice `index`'s reply (or chunk): text and logprobs in the caller's shape; with echo, its
    first part also carries its prompt."""
    text, logprobs, request = part.text, None, call.requests[index]
    echo = call.echo and not state.echoed and (part.token_ids or isinstance(part, GenerateReply))
    if echo:
        state.echoed = True
        text = (request.prompt if request.prompt is not None else vocab.tokenizer.decode(request.token_ids)) + text
    if request.logprobs is None or part.logprobs is None:
        pass
    elif call.kind == "chat":
        logprobs = chat_logprobs(vocab, part.logprobs)
    else:
        shown, first = part.logprobs, None
        if echo and part.prompt_logprobs is not None:
            shown, first = part.prompt_logprobs + part.logprobs, part.prompt_token_ids[0]
        logprobs = completion_logprobs(vocab, shown, state.offset, first)
    state.offset += len(text)
    return text, logprobs


def response(call: Call, replies: list[GenerateReply], vocab: Vocab | None = None) -> dict[str, Any]:
    """The non-streaming answer, one reply per choice; `vocab` decodes token ids (Call.needs_vocab)."""
    choices = []
    for index, reply in enumerate(replies):
        text, logprobs = _shaped(call, index, reply, vocab, StreamState())
        choices.append(_choice(call, index, text, reply.token_ids, reply.finish_reason, delta=False, logprobs=logprobs))
    return {"id": call.response_id, "object": "chat.completion" if call.kind == "chat" else "text_completion",
            "created": call.created, "model": call.model, "choices": choices,
            "usage": usage(total_usage(call, [r.usage for r in replies])), "system_fingerprint": None}


def _chunk(call: Call, choices: list[dict], usage_value: dict | None = None) -> dict[str, Any]:
    chunk = {"id": call.response_id, "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
             "created": call.created, "model": call.model, "choices": choices, "system_fingerprint": None}
    if call.include_usage:
        chunk["usage"] = usage_value
    return chunk


def first_chunks(call: Call) -> list[dict[str, Any]]:
    """Sent before any text: chat opens each choice with the assistant's role, as OpenAI does."""
    if call.kind != "chat":
        return []
    return [_chunk(call, [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]) for index in range(len(call.requests))]


def stream_chunks(call: Call, chunk: StreamChunk, vocab: Vocab | None = None, state: StreamState | None = None,
                  index: int = 0) -> list[dict[str, Any]]:
    """OpenAI chunks for one Baton StreamChunk of choice `index`: a text delta or the finish."""
    if not (chunk.text or chunk.token_ids or chunk.finished):
        return []
    text, logprobs = _shaped(call, index, chunk, vocab, state if state is not None else StreamState())
    return [_chunk(call, [_choice(call, index, text, list(chunk.token_ids), chunk.finish_reason if chunk.finished
                                  else None, delta=True, logprobs=logprobs)])]


def last_chunks(call: Call, usages: list[Usage]) -> list[dict[str, Any]]:
    """After every choice finished: the usage chunk, when the client asked for it."""
    return [_chunk(call, [], usage(total_usage(call, usages)))] if call.include_usage else []


def models(served_model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(served_model, created)]}


def model_card(served_model: str, created: int) -> dict[str, Any]:
    return {"id": served_model, "object": "model", "created": created, "owned_by": "baton"}
