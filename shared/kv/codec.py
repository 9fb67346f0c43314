"""Plain-data codec for the KV messages: frozen dataclasses <-> msgpack maps (never pickle).

`to_plain` turns a dataclass tree into dicts/lists/ints/strs; `from_plain(cls, data)` rebuilds
it, checking every field against the dataclass's type hints, and raises `CodecError` with the
path of the first bad field. Supported field types: int, float, str, bool, None, `X | None`,
`tuple[X, ...]` and nested dataclasses.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class CodecError(ValueError):
    """Bytes or a map that do not decode into the expected message."""


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_plain(x) for x in obj]
    return obj


def from_plain(cls: type[T], data: Any, path: str = "") -> T:
    return _decode(cls, data, path or cls.__name__)


def pack(obj: Any) -> bytes:
    return msgpack.packb(to_plain(obj), use_bin_type=True)


def unpack(cls: type[T], raw: bytes) -> T:
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CodecError(f"{cls.__name__}: not a msgpack message: {exc}") from exc
    return from_plain(cls, data)


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A dataclass's resolved type hints and field names (resolving them is slow: done once)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


def _decode(tp: Any, data: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise CodecError(f"{path}: expected a map, got {type(data).__name__}")
        hints, names = _fields(tp)
        unknown = set(data) - names
        if unknown:
            raise CodecError(f"{path}: unknown field(s) {sorted(unknown)}")
        missing = [n for n in names if n not in data]
        if missing:
            raise CodecError(f"{path}: missing field(s) {sorted(missing)}")
        return tp(**{n: _decode(hints[n], data[n], f"{path}.{n}") for n in names})
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], data, path)
    if origin is tuple:
        if not isinstance(data, (list, tuple)):
            raise CodecError(f"{path}: expected a list, got {type(data).__name__}")
        return tuple(_decode(args[0], x, f"{path}[{i}]") for i, x in enumerate(data))
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    if tp in (int, str, bool, float):
        if type(data) is not tp:
            raise CodecError(f"{path}: expected {tp.__name__}, got {type(data).__name__}")
        return data
    raise CodecError(f"{path}: unsupported field type {tp!r}")
