"""The one codec: message <-> msgpack bytes, with a version field, decoded and checked by msgspec.

Never pickle: a message decodes only into its declared Struct (str, bytes, int, float, bool, nil,
lists, nested messages and the KV library's records). Extension
types (timestamps included) are refused, and so is a message over `Limits.max_message_bytes`.
"""
from __future__ import annotations

from functools import cache
from typing import Any, TypeVar, Union

import msgpack
import msgspec

from .errors import BatonError, ErrorCode, ErrorReply, bad_request
from .limits import DEFAULT_LIMITS, Limits
from .message import VERSION, Message, Unversioned
from .schema import refusal

__all__ = ["VERSION", "decode", "decode_reply", "encode"]

M = TypeVar("M")

_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    """Encode a message as a msgpack map with `v` first."""
    if not isinstance(message, Message):
        raise TypeError(f"encode() takes a message instance, got {type(message).__name__}")
    try:
        return _ENCODER.encode(message)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BatonError(ErrorCode.INTERNAL, f"cannot encode {type(message).__name__}: {exc}") from exc


def decode(data: bytes, cls: type[M], limits: Limits = DEFAULT_LIMITS) -> M:
    """Decode and validate one message of type `cls`; any problem raises BatonError."""
    _check_size(data, limits)
    message = _decode(data, cls, limits)
    if isinstance(message, Unversioned):
        raise bad_request(f"field 'v': unsupported protocol version 0; this service speaks v={VERSION}")
    if hasattr(message, "validate"):
        message.validate(limits)
    return message


def decode_reply(data: bytes, cls: type[M], limits: Limits = DEFAULT_LIMITS) -> M | ErrorReply:
    """Like `decode`, but a reply with an "error" field decodes as ErrorReply instead of `cls`."""
    try:
        return decode(data, cls, limits)
    except BatonError as not_cls:
        try:
            return decode(data, ErrorReply, limits)
        except BatonError:
            raise not_cls from None


def _plain(data: bytes, limits: Limits) -> Any:
    """The bytes as plain data, for the wording of a refusal (only a message msgspec refused gets here)."""
    _check_size(data, limits)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_ext_len=0)
    except msgpack.StackError:
        raise bad_request("message is nested too deeply") from None
    except Exception as exc:  # the parser's errors vary (ValueError, FormatError, UnicodeError, ...)
        reason = "extension types are not allowed" if "max_ext_len" in str(exc) else str(exc) or type(exc).__name__
        raise bad_request(f"cannot decode message: {reason}") from None


def _decode(data: bytes, cls: type[M], limits: Limits) -> M:
    try:
        return _decoder(cls).decode(data)
    except msgspec.ValidationError as exc:
        raise refusal(exc, cls, _plain(data, limits)) from None
    except RecursionError:
        raise bad_request("message is nested too deeply") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"cannot decode message: {exc}") from None


def _check_size(data: Any, limits: Limits) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad_request(f"a message must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise BatonError(ErrorCode.TOO_LARGE,
                         f"message is {len(data)} bytes; the limit is {limits.max_message_bytes}")


@cache
def _decoder(cls: type) -> msgspec.msgpack.Decoder:
    if not (isinstance(cls, type) and issubclass(cls, Message)):
        raise TypeError(f"decode() takes a message type (a part travels only inside one), got {cls!r}")
    return msgspec.msgpack.Decoder(Union[cls, Unversioned], ext_hook=_no_extensions)


def _no_extensions(code: int, data: memoryview) -> Any:
    raise bad_request("cannot decode message: extension types are not allowed")
