"""Bounded fuzzing: whatever arrives, the decoder answers with a message or a BatonError."""
from __future__ import annotations


import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.proto.codec import decode, encode
from baton.proto.errors import BatonError
from proto_examples import EXAMPLES

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGE_TYPES = sorted({type(e) for e in EXAMPLES}, key=lambda cls: cls.__name__)

scalars = st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=20) \
    | st.binary(max_size=20)
plain = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=30)


def decodes_or_refuses(data: bytes, cls: type) -> None:
    try:
        decode(data, cls)
    except BatonError:
        pass


@FUZZ
@given(data=st.binary(max_size=256), cls=st.sampled_from(MESSAGE_TYPES))
def test_random_bytes(data, cls):
    decodes_or_refuses(data, cls)


@FUZZ
@given(example=st.sampled_from(EXAMPLES), choices=st.lists(st.integers(0, 30), min_size=1, max_size=4),
       new_key=st.text(max_size=8), value=plain)
def test_one_field_at_any_depth_replaced_by_random_plain_data(example, choices, new_key, value):
    message = msgspec.to_builtins(example)  # new maps and lists: the shared example stays as it was
    node = message
    for choice in choices[:-1]:  # walk down through nested maps
        children = [key for key, child in node.items() if isinstance(child, dict)]
        if not children:
            break
        node = node[children[choice % len(children)]]
    keys = list(node) + [new_key]  # an existing field, or one that may be unknown
    node[keys[choices[-1] % len(keys)]] = value
    try:
        data = msgpack.packb(message, use_bin_type=True)
    except (OverflowError, ValueError):  # integers msgpack cannot carry
        return
    decodes_or_refuses(data, type(example))


@FUZZ
@given(example=st.sampled_from(EXAMPLES), cut=st.integers(0, 400), flip=st.integers(0, 255))
def test_truncated_and_corrupted_messages(example, cut, flip):
    data = bytearray(encode(example))
    decodes_or_refuses(bytes(data[:cut]), type(example))
    data[cut % len(data)] ^= flip
    decodes_or_refuses(bytes(data), type(example))
