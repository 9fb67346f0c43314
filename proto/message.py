"""The base types of what goes on NATS (see schema.py for how decoding checks them)."""
from __future__ import annotations

import msgspec

VERSION = 1  # the `v` field every message carries (msgspec's tag field)


class Part(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A frozen msgspec Struct whose field annotations are its schema; rules across fields go in
    `__post_init__`, which runs on decode and on construction. Parts travel inside messages."""


class Message(Part, tag_field="v", tag=VERSION):
    """A part that travels on its own: encoded as a msgpack map with `v` first."""


class Unversioned(msgspec.Struct, tag_field="v", tag=0):
    """Decoded in a union with the wanted message so that msgspec requires `v` (a lone tagged
    Struct would take a map without it); a message that decodes as this one has v = 0."""
