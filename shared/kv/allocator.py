"""A pool of integer ids (pages, SWA pages, ring/aux slots) with all-or-nothing takes."""
from __future__ import annotations


class KVError(ValueError):
    """A request-level misuse of the KV store (unknown request, bad length, ...)."""


class OutOfCapacity(KVError):
    """Not enough free pages or slots; nothing was allocated."""


class IdPool:
    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._free = list(range(size - 1, -1, -1))  # popped from the end: lowest ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfCapacity(f"need {n} {self.what}, {len(self._free)} free of {self.size}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise KVError(f"{self.what} {i} is returned but was not taken")
            self._used.remove(i)
            self._free.append(i)

    def check_integrity(self) -> None:
        free = set(self._free)
        require(len(free) == len(self._free), f"{self.what}: an id is free twice")
        require(not free & self._used, f"{self.what}: ids both free and used: {free & self._used}")
        require(free | self._used == set(range(self.size)), f"{self.what}: ids lost or invented")


def require(condition: bool, message: str) -> None:
    """Integrity checks raise even under `python -O`."""
    if not condition:
        raise AssertionError(message)
