"""Wire format of the NIXL notifications Baton's transfer agents exchange.

A notice is `b"BTN" + kind (1 byte) + tag (u64 LE) + part (u8) + parts (u8) + components (utf-8,
comma-separated)`:

- `WRITTEN` (prefill -> decode, carried by a WRITE): WRITE `part` of the `parts` WRITEs of request
  `tag` has landed; it carried `components` (a request goes as one or two WRITEs: whole items,
  then byte ranges if any descriptor is not on item boundaries; a worker's plans are one).
- `FAILED`  (prefill -> decode): the writes for `tag` ended with an error; none is in flight.
- `ABORT`   (decode -> prefill): decode gives up on `tag`; please stop and acknowledge.
- `ABORTED` (prefill -> decode): acknowledgement; no write for `tag` is in flight or will start.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import Enum

_MAGIC = b"BTN"
_HEAD = struct.Struct("<3scQBB")


class Kind(Enum):
    WRITTEN = b"W"
    FAILED = b"F"
    ABORT = b"A"
    ABORTED = b"K"


@dataclass(frozen=True)
class Notice:
    kind: Kind
    tag: int
    components: tuple[str, ...] = ()
    part: int = 0
    parts: int = 1

    def encode(self) -> bytes:
        return _HEAD.pack(_MAGIC, self.kind.value, self.tag, self.part, self.parts) + ",".join(self.components).encode()


def decode(message: bytes) -> Notice | None:
    """The notice in `message`, or None if it is not a well-formed Baton notice."""
    if len(message) < _HEAD.size:
        return None
    magic, kind, tag, part, parts = _HEAD.unpack_from(message)
    if magic != _MAGIC or part >= parts:
        return None
    try:
        text = message[_HEAD.size:].decode()
        return Notice(Kind(kind), tag, tuple(text.split(",")) if text else (), part, parts)
    except ValueError:  # unknown kind or not utf-8
        return None


def request_tag(request_id: str) -> int:
    """The u64 tag NIXL notifications and the aux row carry for a request."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") >> 1
