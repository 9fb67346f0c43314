"""Plain data (what msgpack yields) <-> message dataclasses, checking every field's type.

Field annotations are the schema. Understood: bool, int, float (finite), str, bytes, dict (opaque
plain data, depth-bounded), list[T], T | None, Literal[...], Enum subclasses, nested message
dataclasses, and `Annotated[int | str, Range | Match]` for static ranges and patterns. After the
types check out, a message's `validate(limits)` method (if any) checks rules across fields.
"""
from __future__ import annotations

import math
import re
import types
from dataclasses import MISSING, dataclass, fields, is_dataclass
from enum import Enum
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from .errors import bad_request
from .limits import Limits


@dataclass(frozen=True)
class Range:
    """Inclusive bounds for a number field: `Annotated[int, Range(0, 2**31 - 1)]`."""

    low: float
    high: float


@dataclass(frozen=True)
class Match:
    """A full-match regular expression for a str field."""

    pattern: str


def to_plain(message: Any) -> Any:
    """A message dataclass as nested plain maps; lists of scalars and opaque dicts pass through."""
    if is_dataclass(message):
        return {f.name: to_plain(getattr(message, f.name)) for f in fields(message)}
    if isinstance(message, list) and message and is_dataclass(message[0]):
        return [to_plain(item) for item in message]
    return message


def from_plain(cls: type, data: Any, limits: Limits, path: str = "") -> Any:
    """Build `cls` from a decoded map, or raise BatonError(bad_request) naming the bad field."""
    if not isinstance(data, dict):
        raise bad_request(f"{_name(path, cls.__name__)}: expected a map, got {_type(data)}")
    schema = _schema(cls)
    for key in data:
        if key not in schema:
            raise bad_request(f"unknown field '{path}{key}' in {cls.__name__}")
    values = {}
    for name, (hint, required) in schema.items():
        if name in data:
            values[name] = _convert(hint, data[name], f"{path}{name}", limits)
        elif required:
            raise bad_request(f"missing field '{path}{name}' in {cls.__name__}")
    message = cls(**values)
    if hasattr(message, "validate"):
        message.validate(limits)
    return message


@cache
def _schema(cls: type) -> dict[str, tuple[Any, bool]]:
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: (hints[f.name], f.default is MISSING and f.default_factory is MISSING)
            for f in fields(cls)}


def _convert(hint: Any, value: Any, path: str, limits: Limits) -> Any:
    origin = get_origin(hint)
    if origin is Annotated:
        base, *rules = get_args(hint)
        value = _convert(base, value, path, limits)
        for rule in rules:
            if problem := _violation(rule, value):
                raise bad_request(f"field '{path}': {problem}")
        return value
    if origin in (Union, types.UnionType):
        options = [arg for arg in get_args(hint) if arg is not type(None)]
        if value is None and len(options) < len(get_args(hint)):
            return None
        if len(options) != 1:
            raise TypeError(f"unsupported union in message schema: {hint}")
        return _convert(options[0], value, path, limits)
    if origin is Literal:
        if value not in get_args(hint):
            raise bad_request(f"field '{path}': must be one of {list(get_args(hint))}, got {value!r}")
        return value
    if origin is list:
        return _convert_list(get_args(hint)[0], value, path, limits)
    if hint is dict:
        if not isinstance(value, dict):
            raise bad_request(f"field '{path}': expected a map, got {_type(value)}")
        _check_plain(value, path, limits.max_depth)
        return value
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = [member.value for member in hint]
            raise bad_request(f"field '{path}': must be one of {allowed}, got {value!r}") from None
    if is_dataclass(hint):
        return from_plain(hint, value, limits, f"{path}.")
    return _convert_scalar(hint, value, path)


def _convert_list(item: Any, value: Any, path: str, limits: Limits) -> list:
    if not isinstance(value, list):
        raise bad_request(f"field '{path}': expected a list, got {_type(value)}")
    base, *rules = get_args(item) if get_origin(item) is Annotated else (item,)
    if base is int and value and all(type(x) is int for x in value):  # fast path: token id lists
        low, high = min(value), max(value)
        if not any(_violation(rule, low) or _violation(rule, high) for rule in rules):
            return value
    return [_convert(item, x, f"{path}[{i}]", limits) for i, x in enumerate(value)]


def _convert_scalar(hint: type, value: Any, path: str) -> Any:
    if hint is float:
        if type(value) not in (int, float):
            raise bad_request(f"field '{path}': expected a number, got {_type(value)}")
        if not math.isfinite(value):
            raise bad_request(f"field '{path}': must be a finite number, got {value!r}")
        return float(value)
    if hint not in (bool, int, str, bytes):
        raise TypeError(f"unsupported type in message schema: {hint}")
    if type(value) is not hint:  # exact: a bool is not an int here
        raise bad_request(f"field '{path}': expected {hint.__name__}, got {_type(value)}")
    return value


def _violation(rule: Any, value: Any) -> str | None:
    if isinstance(rule, Range) and not rule.low <= value <= rule.high:
        return f"must be between {rule.low} and {rule.high}, got {value!r}"
    if isinstance(rule, Match) and not re.fullmatch(rule.pattern, value):
        return f"must match {rule.pattern}, got {value[:80]!r}"
    return None


def _check_plain(value: Any, path: str, depth_left: int) -> None:
    """Opaque data must be maps, lists and scalars only, nested at most `max_depth` deep."""
    if isinstance(value, (dict, list)):
        if depth_left == 0:
            raise bad_request(f"field '{path}': nested too deeply")
        children = value.values() if isinstance(value, dict) else value
        for child in children:
            _check_plain(child, path, depth_left - 1)
    elif value is not None and type(value) not in (bool, int, float, str, bytes):
        raise bad_request(f"field '{path}': {_type(value)} is not plain data")


def _name(path: str, default: str) -> str:
    return f"field '{path.rstrip('.')}'" if path else default


def _type(value: Any) -> str:
    return "nil" if value is None else type(value).__name__
