"""A pool of integer ids (pages, SWA pages, ring/aux slots) with all-or-nothing takes.

Ids are handed out as contiguous ascending runs where the free space allows: a take is served by
the smallest free run that holds it (best fit, lowest ids on a tie), else by the longest free runs.
Adjacent ids are adjacent items of the component's one region (item-major: an item holds every
layer), so a request whose pages form few runs on both sides moves as few large NIXL descriptors.
"""
from __future__ import annotations

import numpy as np


class KVError(ValueError):
    """A request-level misuse of the KV store (unknown request, bad length, ...)."""


class OutOfCapacity(KVError):
    """Not enough free pages or slots; nothing was allocated."""


class IdPool:
    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._free = np.ones(size, dtype=bool)  # [size] True where the id is free
        self._num_free = size

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def used(self) -> frozenset[int]:
        return frozenset(np.flatnonzero(~self._free).tolist())

    def take(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if n > self._num_free:
            raise OutOfCapacity(f"need {n} {self.what}, {self._num_free} free of {self.size}")
        starts, lengths = self.free_runs()
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            best = fits[np.argmin(lengths[fits])]  # first minimum: the lowest ids among equals
            ids = np.arange(starts[best], starts[best] + n)
        else:  # no run is long enough: the longest runs, as few of them as possible
            longest = np.argsort(-lengths, kind="stable")
            upto = np.searchsorted(np.cumsum(lengths[longest]), n)  # runs longest[:upto + 1] hold n
            ids = np.sort(np.concatenate([np.arange(starts[i], starts[i] + lengths[i])
                                          for i in longest[:upto + 1]]))[:n]
        self._free[ids] = False
        self._num_free -= n
        return ids.tolist()

    def give(self, ids: list[int]) -> None:
        """Return `ids`; all or nothing: an id not taken (or given twice) raises, nothing changes."""
        arr = np.asarray(ids, dtype=np.int64)
        bad = [i for i in ids if not 0 <= i < self.size or self._free[i]]
        if bad or np.unique(arr).size != arr.size:
            raise KVError(f"{self.what} {bad or sorted(ids)} returned but not taken (or twice)")
        self._free[arr] = True
        self._num_free += arr.size

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the maximal runs of free ids, in id order."""
        edges = np.flatnonzero(np.diff(np.concatenate([[0], self._free.view(np.int8), [0]])))
        return edges[0::2], edges[1::2] - edges[0::2]

    def check_integrity(self) -> None:
        require(self._free.shape == (self.size,), f"{self.what}: free map has the wrong size")
        require(int(self._free.sum()) == self._num_free,
                f"{self.what}: {self._num_free} counted free, {int(self._free.sum())} in the map")


def require(condition: bool, message: str) -> None:
    """Integrity checks raise even under `python -O`."""
    if not condition:
        raise AssertionError(message)
