"""The one codec: message dataclass <-> msgpack bytes, with a version field and bounded decoding.

Never pickle: the decoder builds only maps, lists, str, bytes, int, float, bool and nil, within the
size limits of `Limits`; extension types (timestamps included) are refused.
"""
from __future__ import annotations

from dataclasses import is_dataclass
from typing import Any, TypeVar

import msgpack

from .errors import BatonError, ErrorCode, ErrorReply, bad_request
from .limits import DEFAULT_LIMITS, Limits
from .schema import from_plain, to_plain

VERSION = 1  # the `v` field every message carries

M = TypeVar("M")


def encode(message: Any) -> bytes:
    """Encode a message dataclass as a msgpack map with `v` first."""
    if not is_dataclass(message) or isinstance(message, type):
        raise TypeError(f"encode() takes a message dataclass instance, got {type(message).__name__}")
    try:
        return msgpack.packb({"v": VERSION, **to_plain(message)}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BatonError(ErrorCode.INTERNAL, f"cannot encode {type(message).__name__}: {exc}") from exc


def decode(data: bytes, cls: type[M], limits: Limits = DEFAULT_LIMITS) -> M:
    """Decode and validate one message of type `cls`; any problem raises BatonError."""
    return from_plain(cls, _unpack_versioned(data, limits), limits)


def decode_reply(data: bytes, cls: type[M], limits: Limits = DEFAULT_LIMITS) -> M | ErrorReply:
    """Like `decode`, but a reply with an "error" field decodes as ErrorReply instead of `cls`."""
    plain = _unpack_versioned(data, limits)
    return from_plain(ErrorReply if "error" in plain else cls, plain, limits)


def _unpack_versioned(data: bytes, limits: Limits) -> dict:
    plain = unpack(data, limits)
    if not isinstance(plain, dict):
        raise bad_request(f"a message must be a msgpack map, got {type(plain).__name__}")
    version = plain.pop("v", None)
    if version is None:
        raise bad_request("missing field 'v' (protocol version)")
    if type(version) is not int or version != VERSION:
        raise bad_request(f"field 'v': unsupported protocol version {version!r}; this service speaks v={VERSION}")
    return plain


def unpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Bounded msgpack decoding of untrusted bytes into plain data."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad_request(f"a message must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise BatonError(ErrorCode.TOO_LARGE,
                         f"message is {len(data)} bytes; the limit is {limits.max_message_bytes}")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=limits.max_str_bytes, max_bin_len=limits.max_bin_bytes,
            max_array_len=limits.max_array_len, max_map_len=limits.max_map_len, max_ext_len=0)
    except msgpack.StackError:
        raise bad_request("message is nested too deeply") from None
    except Exception as exc:  # the parser's errors vary (ValueError, FormatError, UnicodeError, ...)
        reason = "extension types are not allowed" if "max_ext_len" in str(exc) else str(exc) or type(exc).__name__
        raise bad_request(f"cannot decode message: {reason}") from None
