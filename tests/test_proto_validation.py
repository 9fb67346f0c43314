"""Every way a message can be wrong gets a BatonError with a stable code and the field's name."""
from __future__ import annotations

import msgpack
import msgspec
import pytest

from baton.proto import internal, public
from baton.proto.codec import decode, encode
from baton.proto.errors import BatonError, ErrorCode, ErrorReply
from baton.proto.limits import Limits
from proto_examples import ALLOCATION, REGISTRATION

pytestmark = pytest.mark.unit


def pack(**fields) -> bytes:
    return msgpack.packb({"v": 1, **fields}, use_bin_type=True)


def refused(data: bytes, cls: type, limits: Limits = Limits()) -> BatonError:
    with pytest.raises(BatonError) as raised:
        decode(data, cls, limits)
    return raised.value


@pytest.mark.parametrize("fields, code, mentions", [
    ({}, "bad_request", "exactly one of 'prompt' and 'token_ids'"),
    ({"prompt": "x", "token_ids": [1]}, "bad_request", "exactly one"),
    ({"prompt": ""}, "bad_request", "'prompt'"),
    ({"token_ids": []}, "bad_request", "'token_ids'"),
    ({"prompt": 5}, "bad_request", "'prompt': expected str, got int"),
    ({"prompt": b"bytes"}, "bad_request", "'prompt': expected str, got bytes"),
    ({"token_ids": "1 2 3"}, "bad_request", "'token_ids': expected a list"),
    ({"token_ids": [1, -1]}, "bad_request", "'token_ids[1]'"),
    ({"token_ids": [1, 2**31]}, "bad_request", "'token_ids[1]'"),
    ({"token_ids": [1, 2.0]}, "bad_request", "'token_ids[1]': expected int, got float"),
    ({"token_ids": [True]}, "bad_request", "'token_ids[0]': expected int, got bool"),
    ({"token_ids": [None]}, "bad_request", "'token_ids[0]': expected int, got nil"),
    ({"prompt": "x", "max_tokens": -1}, "bad_request", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": 0}, "bad_request", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": 10**15}, "bad_request", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": 4097}, "bad_request", "'max_tokens'"),
    ({"prompt": "x", "max_tokens": "10"}, "bad_request", "'max_tokens': expected int, got str"),
    ({"prompt": "x", "max_tokens": True}, "bad_request", "'max_tokens': expected int, got bool"),
    ({"prompt": "x", "temperature": -0.1}, "bad_request", "'temperature'"),
    ({"prompt": "x", "temperature": float("inf")}, "bad_request", "'temperature': must be a finite number"),
    ({"prompt": "x", "temperature": "hot"}, "bad_request", "'temperature': expected a number"),
    ({"prompt": "x", "top_p": 0.0}, "bad_request", "'top_p'"),
    ({"prompt": "x", "top_p": 1.5}, "bad_request", "'top_p'"),
    ({"prompt": "x", "top_p": float("nan")}, "bad_request", "'top_p'"),
    ({"prompt": "x", "seed": -1}, "bad_request", "'seed'"),
    ({"prompt": "x", "draft_tokens": -1}, "bad_request", "'draft_tokens': must be between 0 and 16, got -1"),
    ({"prompt": "x", "min_tokens": -1}, "bad_request", "'min_tokens': must be between 0 and max_tokens (128), got -1"),
    ({"prompt": "x", "max_tokens": 8, "min_tokens": 9}, "bad_request",
     "'min_tokens': must be between 0 and max_tokens (8), got 9"),
    ({"prompt": "x", "draft_tokens": 17}, "bad_request", "'draft_tokens': must be between 0 and 16, got 17"),
    ({"prompt": "x", "draft_tokens": 2.0}, "bad_request", "'draft_tokens': expected int, got float"),
    ({"prompt": "x", "draft_tokens": "3"}, "bad_request", "'draft_tokens': expected int, got str"),
    ({"prompt": "x", "draft_tokens": True}, "bad_request", "'draft_tokens': expected int, got bool"),
    ({"prompt": "x", "stream": 1}, "bad_request", "'stream': expected bool, got int"),
    ({"prompt": "x", "stop": "\n"}, "bad_request", "'stop': expected a list"),
    ({"prompt": "x", "stop": [""]}, "bad_request", "'stop[0]'"),
    ({"prompt": "x", "stop": ["x" * 257]}, "bad_request", "'stop[0]'"),
    ({"prompt": "x", "stop": ["a"] * 17}, "bad_request", "'stop'"),
    ({"prompt": "x", "stop_token_ids": [-3]}, "bad_request", "'stop_token_ids[0]'"),
    ({"prompt": "x", "request_id": "a.b"}, "bad_request", "'request_id': must match"),
    ({"prompt": "x", "request_id": "x" * 65}, "bad_request", "'request_id'"),
    ({"prompt": "x", "request_id": "a*"}, "bad_request", "'request_id'"),
    ({"prompt": "x", "n": 2}, "bad_request", "unknown field 'n'"),
    ({"prompt": "x" * (Limits().max_prompt_chars + 1)}, "too_large", "'prompt'"),
    ({"token_ids": [1] * (Limits().max_prompt_tokens + 1)}, "too_large", "'token_ids'"),
])
def test_generate_request_rules(fields, code, mentions):
    error = refused(pack(**fields), public.GenerateRequest)
    assert error.code.value == code
    assert mentions in error.message


def test_max_tokens_limit_is_configurable():
    data = pack(prompt="x", max_tokens=8000)
    refused(data, public.GenerateRequest)
    assert decode(data, public.GenerateRequest, Limits(max_tokens=8192)).max_tokens == 8000
    assert "between 1 and 16" in refused(pack(prompt="x", max_tokens=17), public.GenerateRequest,
                                         Limits(max_tokens=16)).message


@pytest.mark.parametrize("value", [None, 0, 1, 16])
def test_draft_tokens_accepted_values(value):
    assert decode(pack(prompt="x", draft_tokens=value), public.GenerateRequest).draft_tokens == value
    dispatch = decode(pack(request_id="r", token_ids=[1], sampling={"draft_tokens": value}), internal.PrefillDispatch)
    assert dispatch.sampling.draft_tokens == value
    assert decode(pack(prompt="x"), public.GenerateRequest).draft_tokens is None  # omitted: the deployment's K


@pytest.mark.parametrize("data, mentions", [
    (msgpack.packb({"prompt": "x"}), "missing field 'v'"),
    (msgpack.packb({"v": 2, "prompt": "x"}), "unsupported protocol version 2"),
    (msgpack.packb({"v": "1", "prompt": "x"}), "unsupported protocol version '1'"),
    (msgpack.packb({"v": True, "prompt": "x"}), "unsupported protocol version True"),
    (msgpack.packb([1, "x"]), "must be a msgpack map, got list"),
    (msgpack.packb("hello"), "must be a msgpack map, got str"),
    (b"", "cannot decode"),
    (b"\xc1", "cannot decode"),
    (b"{\"v\": 1, \"prompt\": \"x\"}", "cannot decode"),
    (pack(prompt="x") + b"\x00", "cannot decode"),
    (msgpack.packb({"v": 1, "prompt": b"\xff\xfe"}, use_bin_type=False), "cannot decode"),
    (msgpack.packb({1: 1}), "cannot decode"),
    (msgpack.packb({"v": 1, "prompt": msgpack.ExtType(1, b"x")}), "extension types are not allowed"),
    (msgpack.packb({"v": 1, "prompt": msgpack.Timestamp(1, 0)}), "extension types are not allowed"),
    (b"\x91" * 100_000 + b"\xc0", "nested too deeply"),
    (b"\xdd\xff\xff\xff\xff", "cannot decode"),  # an array header claiming 4 billion items
])
def test_malformed_bytes(data, mentions):
    error = refused(data, public.GenerateRequest)
    assert error.code is ErrorCode.BAD_REQUEST
    assert mentions in error.message


def test_not_bytes():
    assert refused("a string", public.CancelRequest).code is ErrorCode.BAD_REQUEST


def test_oversize_message_is_too_large():
    error = refused(pack(prompt="x" * (1 << 20)), public.GenerateRequest)
    assert error.code is ErrorCode.TOO_LARGE and "limit is 1048576" in error.message


def test_limits_bound_what_one_message_can_make_the_receiver_build():
    """A message decodes only into its declared types, so its size bounds every string and list;
    the prompt's own limits and the agent metadata's bound are checked by name."""
    small = Limits(max_message_bytes=64, max_prompt_chars=10, max_prompt_tokens=10)
    assert refused(pack(prompt="x" * 60), public.GenerateRequest, small).code is ErrorCode.TOO_LARGE
    assert "'prompt'" in refused(pack(prompt="x" * 11), public.GenerateRequest, small).message
    assert "'token_ids'" in refused(pack(token_ids=[1] * 11), public.GenerateRequest, small).message
    assert "unknown field 'k0'" in refused(pack(**{f"k{i}": 0 for i in range(20)}), public.GenerateRequest).message
    wide = encode(msgspec.structs.replace(REGISTRATION, nixl_metadata=b"x" * (64 << 10 | 1)))
    assert "'nixl_metadata'" in refused(wide, internal.WorkerRegistration).message


def test_kv_records_decode_only_as_their_record():
    """An allocation (a plan, a manifest) is a typed field: any other map is refused, by path."""
    deep: dict = {"leaf": 1}
    for _ in range(20):
        deep = {"next": deep}
    plain = msgspec.to_builtins(internal.ReserveReply(request_id="r", decode_worker_id="d", allocation=ALLOCATION))
    for value, mentions in ((deep, "unknown field 'allocation.next'"),
                            ({**plain["allocation"], "page_ids": "no"}, "'allocation.page_ids': expected a list, got str"),
                            ({**plain["allocation"], "slot": 1.5}, "'allocation.slot': expected int, got float")):
        error = refused(msgpack.packb({**plain, "allocation": value}), internal.ReserveReply)
        assert error.code is ErrorCode.BAD_REQUEST and mentions in error.message


def nested(field_path: str, value) -> dict:
    """A valid registration as plain data with the field at a dotted path replaced (removed for ...)."""
    plain = msgpack.unpackb(encode(REGISTRATION), raw=False)
    *parents, last = field_path.split(".")
    node = plain
    for name in parents:
        node = node[name]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return plain


@pytest.mark.parametrize("path, value, mentions", [
    ("worker_id", "decode.0", "'worker_id': must match"),
    ("worker_id", "", "'worker_id'"),
    ("worker_id", ..., "missing field 'worker_id'"),
    ("role", "router", "'role': must be one of ['prefill', 'decode']"),
    ("manifest", [1, 2], "'manifest': expected a map"),
    ("nixl_metadata", "text", "'nixl_metadata': expected bytes, got str"),
    ("capacity", None, "'capacity': expected a map, got nil"),
    ("capacity.total_pages", -1, "'capacity.total_pages': must be between 0"),
    ("capacity.page_size", ..., "missing field 'capacity.page_size'"),
    ("capacity.extra", 1, "unknown field 'capacity.extra'"),
    ("manifest.components", 3, "'manifest.components': expected a list, got int"),
    ("manifest.mode", ..., "missing field 'manifest.mode'"),
    ("manifest.extra", 1, "unknown field 'manifest.extra'"),
])
def test_registration_rules(path, value, mentions):
    error = refused(msgpack.packb(nested(path, value), use_bin_type=True), internal.WorkerRegistration)
    assert error.code is ErrorCode.BAD_REQUEST
    assert mentions in error.message


@pytest.mark.parametrize("cls, fields, mentions", [
    (internal.Heartbeat, {"worker_id": "w", "instance_id": "i", "load": {"free_pages": -5, "free_slots": 0, "active_requests": 0,
                                                                         "queued_prompt_tokens": 0}}, "'load.free_pages'"),
    (internal.ReserveRequest, {"request_id": "r", "token_ids": [1], "max_tokens": 4, "sampling": {"top_p": 0},
                               "stream_subject": "_INBOX.x"}, "'top_p'"),
    (internal.ReserveRequest, {"request_id": "r", "token_ids": [1], "max_tokens": 4, "sampling": {},
                               "stream_subject": "tokens.>"}, "'stream_subject'"),
    (internal.ReserveRequest, {"request_id": "r", "token_ids": [1], "max_tokens": 4, "sampling": {"draft_tokens": 17},
                               "stream_subject": "_INBOX.x"}, "'draft_tokens'"),
    (internal.PrefillDispatch, {"request_id": "r", "token_ids": [1], "sampling": {"draft_tokens": -1}},
     "'draft_tokens'"),
    (internal.PrefillDispatch, {"request_id": "r", "token_ids": [1], "sampling": {"draft_tokens": "all"}},
     "'sampling.draft_tokens': expected int, got str"),
    (internal.TokenChunk, {"request_id": "r", "seq": 0, "token_ids": [1], "finished": True},
     "a finished chunk needs"),
    (internal.TokenChunk, {"request_id": "r", "seq": 0, "token_ids": [1], "finish_reason": "stop"},
     "only allowed on the finished chunk"),
    (internal.TokenChunk, {"request_id": "r", "seq": 0, "token_ids": [1], "finished": True, "finish_reason": "done",
                           "spec": {}, "timing": {"ttft_ms": 1, "total_ms": 1}}, "'finish_reason': must be one of"),
    (internal.TokenChunk, {"request_id": "r", "seq": 1, "token_ids": [1], "source": "prefill"},
     "prefill's chunk is chunk 0 with the first token alone"),
    (internal.TokenChunk, {"request_id": "r", "seq": 0, "token_ids": [1, 2], "source": "prefill"},
     "prefill's chunk is chunk 0 with the first token alone"),
    (internal.TokenChunk, {"request_id": "r", "seq": 0, "token_ids": [1], "source": "router"}, "'source'"),
    (internal.PrefillDispatch, {"request_id": "r", "token_ids": [1], "sampling": {}, "first_token_to": "tokens.>"},
     "'first_token_to'"),
    (public.StreamChunk, {"request_id": "r", "token_ids": [], "text": "", "finished": True}, "a finished chunk needs"),
    (public.GenerateReply, {"request_id": "r", "token_ids": [], "text": "", "finish_reason": "length",
                            "usage": {"prompt_tokens": 1, "completion_tokens": 0},
                            "spec": {"verify_steps": 1, "drafted": 1, "accepted": 2},
                            "timing": {"ttft_ms": 1.0, "total_ms": -1.0}}, "'accepted'"),
    (public.GenerateReply, {"request_id": "r", "token_ids": [], "text": "", "finish_reason": "length",
                            "usage": {"prompt_tokens": 1, "completion_tokens": 0}, "spec": {},
                            "timing": {"ttft_ms": 1.0, "total_ms": -1.0}}, "'timing.total_ms'"),
    (internal.LookupReply, {"workers": [{"registration": {}, "load": {}}]},
     "missing field 'workers[0].registration.worker_id'"),
    (internal.WorkerEvent, {"kind": "crashed", "worker_id": "w", "role": "decode"}, "'kind'"),
    (internal.PrefillDone, {"request_id": "r", "first_token_id": 1, "transfer_bytes": 0, "prefill_ms": "8",
                            "transfer_ms": 0}, "'prefill_ms': expected a number"),
])
def test_internal_rules(cls, fields, mentions):
    error = refused(pack(**fields), cls)
    assert error.code is ErrorCode.BAD_REQUEST
    assert mentions in error.message


def test_error_reply_with_an_unknown_code_is_refused():
    error = refused(pack(error={"code": "teapot", "message": "x"}), ErrorReply)
    assert "'error.code': must be one of" in error.message
