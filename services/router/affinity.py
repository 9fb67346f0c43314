"""Which prefill worker holds which prompt prefix, as this router saw it (sglang's cache-aware
router keeps the same kind of record; no events from workers are needed).

Every prompt the router dispatches is recorded under the chained hashes of its whole blocks of
BLOCK tokens, owned by the worker it went to; the next turn of a conversation shares those
blocks and so finds that worker. The record is bounded (LRU over blocks) and a worker that
leaves is dropped from it at once. A worker's cache may have evicted what the record says it
holds: then the request is computed in full there, still exactly (the record steers, it never
decides what is reused).

Cost of sending a prompt of L tokens to worker w (lowest wins; docs/kv_state.md):
    load(w) + L - weight * overlap(w)
load: prompt tokens queued at w and in flight to it from this router; overlap: the prompt's
leading tokens w was last sent (whole blocks). weight 0 turns affinity off.
"""
from __future__ import annotations

from collections import OrderedDict

BLOCK = 16
CAPACITY = 200_000  # blocks remembered (each ~100 bytes)


class PrefixAffinity:
    def __init__(self, weight: float = 1.0, capacity: int = CAPACITY) -> None:
        self.weight, self.capacity = weight, capacity
        self._owner: OrderedDict[int, str] = OrderedDict()  # block chain hash -> worker id

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, token_ids: list[int], worker_id: str) -> None:
        for digest in _chain(token_ids):
            self._owner[digest] = worker_id
            self._owner.move_to_end(digest)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def overlap(self, token_ids: list[int]) -> dict[str, int]:
        """worker id -> leading tokens of `token_ids` it was last sent (whole blocks)."""
        found: dict[str, int] = {}
        for i, digest in enumerate(_chain(token_ids)):
            owner = self._owner.get(digest)
            if owner is None:
                break
            found[owner] = (i + 1) * BLOCK
        return found

    def cost(self, load: int, prompt_tokens: int, overlap: int) -> float:
        return load + prompt_tokens - self.weight * overlap

    def forget(self, worker_id: str) -> None:
        for digest in [d for d, w in self._owner.items() if w == worker_id]:
            del self._owner[digest]


def _chain(token_ids: list[int]) -> list[int]:
    """Chained hashes of each whole block: [len // BLOCK]."""
    chain, digest = [], 0
    for b in range(len(token_ids) // BLOCK):
        digest = hash((digest, tuple(token_ids[b * BLOCK:(b + 1) * BLOCK])))
        chain.append(digest)
    return chain
