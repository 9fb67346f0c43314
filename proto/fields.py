"""Field types shared by the public and internal messages: msgspec checks their `Meta` on decode."""
from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from .schema import MAX_FLOAT

# Ids may appear inside subject names, so they never contain '.', '*', '>' or whitespace.
ID_PATTERN = r"[A-Za-z0-9_-]{1,64}"
_ID = Meta(pattern=rf"^{ID_PATTERN}\Z")  # msgspec searches: anchored, and \Z as $ would allow a final newline
RequestId = Annotated[str, _ID]
WorkerId = Annotated[str, _ID]
Subject = Annotated[str, Meta(pattern=r"^(?=.{1,256}\Z)[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*\Z")]  # no wildcards
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Seed = Annotated[int, Meta(ge=0)]  # msgpack ints end at 2**64 - 1, so that is the top
Finite = Annotated[float, Meta(ge=-MAX_FLOAT, le=MAX_FLOAT)]  # any float but inf and nan
Millis = Annotated[float, Meta(ge=0, le=MAX_FLOAT)]
AgentMetadata = Annotated[bytes, Meta(max_length=64 << 10)]  # NIXL agent metadata is ~450 B
