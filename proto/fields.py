"""Field types shared by the public and internal messages (see schema.py for Range and Match)."""
from __future__ import annotations

import math
from typing import Annotated

from .schema import Match, Range

# Ids may appear inside subject names, so they never contain '.', '*', '>' or whitespace.
ID_PATTERN = r"[A-Za-z0-9_-]{1,64}"
RequestId = Annotated[str, Match(ID_PATTERN)]
WorkerId = Annotated[str, Match(ID_PATTERN)]
Subject = Annotated[str, Match(r"(?=.{1,256}$)[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*")]  # no wildcards
TokenId = Annotated[int, Range(0, 2**31 - 1)]
Count = Annotated[int, Range(0, 2**63 - 1)]
Seed = Annotated[int, Range(0, 2**64 - 1)]
Millis = Annotated[float, Range(0, math.inf)]
