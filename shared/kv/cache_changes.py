"""What a worker's cache added and evicted since routers were last told, numbered: prefill's prefix
cache and decode's turn cache both report this way (proto `PrefixEvents`, services/worker.py).
Plain Python, no torch."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Cached:
    """An entry as routers see it: `blocks` whole blocks with chained `digest` (prefix_hash.py),
    ending at `tokens`."""
    blocks: int
    digest: int
    tokens: int


class CacheChanges:
    def __init__(self) -> None:
        self.seq = 0  # change messages numbered so far
        self._added: list[Cached] = []  # since the last take
        self._evicted: list[Cached] = []

    def added(self, entry: Cached) -> None:
        self._added.append(entry)

    def evicted(self, entry: Cached) -> None:
        self._evicted.append(entry)

    def take(self) -> tuple[int, list[Cached], list[Cached]] | None:
        """(seq, added, evicted) since the last take, numbered; None when nothing changed. Net of
        each other: an entry added and evicted since the last take is in neither list."""
        added, evicted = Counter(self._added), Counter(self._evicted)
        self._added, self._evicted = [], []
        added, evicted = added - evicted, evicted - added
        if not added and not evicted:
            return None
        self.seq += 1
        return self.seq, list(added.elements()), list(evicted.elements())

    def skip(self) -> int:
        """Drop what was not taken yet, for a snapshot that holds it; its seq is skipped (a router
        applying messages sees the gap and asks for a snapshot itself). Returns the current seq."""
        self.take()
        return self.seq
