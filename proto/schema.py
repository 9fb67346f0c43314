"""msgspec's refusals turned into Baton's `bad_request` messages.

Every message is a `Message` (message.py): a frozen msgspec Struct whose field annotations are the schema
(types, `Meta` ranges and patterns, Literals, nested messages). msgspec decodes msgpack into it
and checks every field in C, refusing unknown and missing fields; rules across fields live in the
message's `__post_init__` (run on every decode and construction) or, where they depend on the
process's `Limits`, in its `validate(limits)`. `refusal` rewrites msgspec's error into the field
path and wording Baton's clients see ("field 'capacity.total_pages': must be between 0 and ...").
"""
from __future__ import annotations

import math
import re
import sys
import types
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from .errors import BatonError, bad_request
from .message import VERSION

MAX_FLOAT = sys.float_info.max  # `Meta` bounds must be finite: ±MAX_FLOAT is "any finite float"


def refusal(error: msgspec.ValidationError, cls: type, plain: Any) -> BatonError:
    """`error` for a map (`plain`, the message as plain data) that does not decode as `cls`."""
    what, _, at = str(error).partition(" - at `")
    path = at.rstrip("`").removeprefix("$").lstrip(".")
    if "` in `" in at:  # "- at `key` in `$`": a map key that is not a string
        return bad_request("cannot decode message: map keys must be strings")
    if missing := re.fullmatch(r"Object missing required field `(.*)`", what):
        name = _join(path, missing[1])
        if name == "v":
            return bad_request("missing field 'v' (protocol version)")
        return bad_request(f"missing field '{name}' in {cls.__name__}")
    if unknown := re.fullmatch(r"Object contains unknown field `(.*)`", what):
        return bad_request(f"unknown field '{_join(path, unknown[1])}' in {cls.__name__}")
    if path == "v":
        version = _at(plain, path)
        return bad_request(f"field 'v': unsupported protocol version {version!r}; this service speaks v={VERSION}")
    if expected := re.fullmatch(r"Expected `([^`]*)`, got `([^`]*)`", what):
        return _wrong_type(path, expected[1], expected[2])
    return bad_request(f"field '{path}': {_rule(_hint_at(cls, path), _at(plain, path)) or what}")


def _wrong_type(path: str, expected: str, got: str) -> BatonError:
    if got == "ext":
        return bad_request("cannot decode message: extension types are not allowed")
    got = {"None": "nil", "null": "nil", "array": "list", "object": "dict"}.get(got, got)
    if not path:
        return bad_request(f"a message must be a msgpack map, got {got}")
    names = {"array": "a list", "object": "a map", "float": "a number"}
    wanted = " or ".join(names.get(t, t) for t in expected.split(" | ") if t != "null")
    return bad_request(f"field '{path}': expected {wanted}, got {got}")


def _rule(hint: Any, value: Any) -> str | None:
    """What a value broke: the range, pattern or choices its field's annotation declares."""
    base, metas = _split(hint)
    if get_origin(base) is Literal:
        return f"must be one of {list(get_args(base))}, got {value!r}"
    if isinstance(base, type) and issubclass(base, Enum):
        return f"must be one of {[member.value for member in base]}, got {value!r}"
    for meta in metas:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if meta.pattern is not None:
            return f"must match {meta.pattern}, got {str(value)[:80]!r}"
        if meta.ge is not None or meta.le is not None:
            return f"must be between {meta.ge} and {_bound(meta.le)}, got {value!r}"
    return None


def _hint_at(cls: type, path: str) -> Any:
    """The annotation of the field at a path like "capacity.total_pages" or "token_ids[1]"."""
    hint: Any = cls
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        hint = _unwrap(hint)
        if name:
            by_name = {f.name: f.type for f in msgspec.structs.fields(hint)} if _is_struct(hint) else {}
            hint = by_name.get(name)
        else:
            hint = get_args(hint)[0] if get_origin(hint) is list else None
        if hint is None:
            return None
    return hint


def _at(plain: Any, path: str) -> Any:
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        try:
            plain = plain[name] if name else plain[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return plain


def _split(hint: Any) -> tuple[Any, list[msgspec.Meta]]:
    """`Annotated[T, Meta...] | None` -> (T, [Meta...])."""
    hint = _strip_none(hint)
    if get_origin(hint) is Annotated:
        base, *rules = get_args(hint)
        return _strip_none(base), [rule for rule in rules if isinstance(rule, msgspec.Meta)]
    return hint, []


def _unwrap(hint: Any) -> Any:
    return _split(hint)[0]


def _strip_none(hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        options = [arg for arg in get_args(hint) if arg is not type(None)]
        return options[0] if len(options) == 1 else hint
    return hint


def _is_struct(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def _bound(value: float | None) -> Any:
    return math.inf if value is None or value == MAX_FLOAT else value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
