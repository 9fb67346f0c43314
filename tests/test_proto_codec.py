"""Round trips through the codec for every message type."""
from __future__ import annotations

import msgpack
import msgspec
import pytest

from baton.proto import errors, internal, public
from baton.proto.codec import VERSION, decode, decode_reply, encode
from baton.proto.errors import BatonError, ErrorCode, ErrorReply
from proto_examples import EXAMPLES, message_classes

pytestmark = pytest.mark.unit


def test_every_message_type_has_an_example():
    covered = {type(example) for example in EXAMPLES}
    nested = {public.Usage, public.SpecStats, public.Timing, public.Logprobs, internal.SamplingParams, internal.Capacity,
              internal.WorkerLoad, internal.WorkerInfo, internal.CachedPrefix, errors.ErrorDetail}
    assert set(message_classes()) - covered - nested == set()


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    data = encode(message)
    assert decode(data, type(message)) == message
    assert msgpack.unpackb(data)["v"] == VERSION


def test_encoding_is_a_plain_map_with_bytes_as_bin():
    registration = next(e for e in EXAMPLES if isinstance(e, internal.WorkerRegistration))
    plain = msgpack.unpackb(encode(registration), raw=False)
    assert plain["nixl_metadata"] == registration.nixl_metadata
    assert plain["capacity"] == {"total_pages": 4096, "page_size": 16, "total_slots": 64, "max_seq_len": 4096}
    assert plain["manifest"] == msgspec.msgpack.decode(msgspec.msgpack.encode(registration.manifest))  # maps, lists
    assert plain["manifest"]["components"][0]["regions"] == [{"addr": 2**47 - 4096, "nbytes": 4096 * 16384,
                                                               "item_bytes": 16384}]


def test_error_reply_decodes_in_place_of_the_expected_reply():
    data = encode(BatonError(ErrorCode.BUSY, "cluster full").to_reply())
    reply = decode_reply(data, public.GenerateReply)
    assert isinstance(reply, ErrorReply)
    raised = reply.to_exception()
    assert (raised.code, raised.message) == (ErrorCode.BUSY, "cluster full")


def test_decode_reply_returns_the_expected_type():
    reply = EXAMPLES[2]
    assert decode_reply(encode(reply), public.GenerateReply) == reply


def test_encode_refuses_what_msgpack_cannot_carry():
    message = internal.PlanReply(prefill_worker_id="p", decode_worker_id="d", plan={"x": object()})
    with pytest.raises(BatonError) as raised:
        encode(message)
    assert raised.value.code is ErrorCode.INTERNAL
    with pytest.raises(TypeError):
        encode({"not": "a dataclass"})


def test_floats_accept_ints_and_come_back_as_floats():
    data = msgpack.packb({"v": 1, "prompt": "x", "temperature": 1, "top_p": 1})
    request = decode(data, public.GenerateRequest)
    assert type(request.temperature) is float and type(request.top_p) is float


def test_spec_acceptance_length():
    assert public.SpecStats(verify_steps=2, drafted=6, accepted=4).acceptance_length == 3.0
    assert public.SpecStats().acceptance_length == 0.0


def test_a_malformed_event_is_logged_and_dropped_and_a_good_one_decoded(caplog):
    """Events (published, never answered) have no one to get an error reply: the subscriber logs
    what was wrong and goes on."""
    import logging

    from baton.proto.internal import WorkerEvent
    from baton.shared.bus.wire import decode_event
    event = WorkerEvent(kind="left", worker_id="decode-1", role="decode", reason="lease expired")
    logger = logging.getLogger("test.events")
    assert decode_event(encode(event), WorkerEvent, logger) == event
    with caplog.at_level(logging.WARNING, logger="test.events"):
        assert decode_event(b"\x93\x01\x02\x03", WorkerEvent, logger) is None
    assert "ignored a malformed WorkerEvent" in caplog.text
