"""Plain-data codec for the KV records: frozen dataclasses <-> msgpack maps, through msgspec (never pickle).

`to_plain` turns a record into dicts/lists/ints/strs; `from_plain(cls, data)` rebuilds it, msgspec
checking every field's type in C, and refuses fields the record does not have, so that a record
from a worker of another version is refused rather than half read. Problems raise `CodecError`
with the path of the field ("Manifest.components[0].geometry.item_rows: expected int, got str").
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class CodecError(ValueError):
    """Bytes or a map that do not decode into the expected record."""


def to_plain(obj: Any) -> Any:
    """What the receiver of `pack(obj)` sees: maps, lists (tuples become lists), str, int, ..."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))


def from_plain(cls: type[T], data: Any) -> T:
    try:
        record = msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise CodecError(_worded(cls, str(exc))) from None
    _refuse_unknown_fields(cls, data, cls.__name__)
    return record


def pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def unpack(cls: type[T], raw: bytes) -> T:
    try:
        data = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise CodecError(f"{cls.__name__}: not a msgpack message: {exc}") from None
    return from_plain(cls, data)


def _worded(cls: type, error: str) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.a[0].b`" as "Cls.a[0].b: expected int, got str"."""
    what, _, at = error.partition(" - at `")
    where = cls.__name__ + at.rstrip("`").removeprefix("$")
    if missing := re.fullmatch(r"Object missing required field `(.*)`", what):
        return f"{where}: missing field '{missing[1]}'"
    names = {"object": "a map", "array": "a list", "null": "nil"}
    what = re.sub(r"`([^`]*)`", lambda m: names.get(m[1], m[1]), what)
    return f"{where}: {what[:1].lower()}{what[1:]}"


def _refuse_unknown_fields(cls: type, data: dict, path: str) -> None:
    """msgspec ignores a dataclass's unknown fields: walk the (already type-checked) data for them."""
    names, nested = _shape(cls)
    if unknown := data.keys() - names:
        raise CodecError(f"{path}: unknown field(s) {sorted(unknown)}")
    for name, inner, many in nested:
        value = data.get(name)
        if value is None:
            continue
        for i, item in enumerate(value) if many else ((None, value),):
            _refuse_unknown_fields(inner, item, f"{path}.{name}" + ("" if i is None else f"[{i}]"))


@functools.cache
def _shape(cls: type) -> tuple[frozenset[str], tuple[tuple[str, type, bool], ...]]:
    """A record's field names, and its fields that hold records: (name, record type, a tuple of them)."""
    hints = typing.get_type_hints(cls)  # resolving them is slow: done once per record type
    nested = []
    for name, hint in hints.items():
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        many = typing.get_origin(hint) is tuple
        inner = typing.get_args(hint)[0] if many else hint
        if dataclasses.is_dataclass(inner):
            nested.append((name, inner, many))
    return frozenset(f.name for f in dataclasses.fields(cls)), tuple(nested)
