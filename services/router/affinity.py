"""Which prefill worker holds which prompt prefix, as the workers report it (proto `PrefixEvents`,
published after each batch that changed a worker's prefix cache; NVIDIA Dynamo's KV-aware router
works from the same kind of events).

Per worker instance, the index holds its cached prompt ends, each keyed by (blocks, digest): the
chained digest of its first whole blocks (shared/kv/prefix_hash.py). A prompt overlaps a worker by
the longest cached end whose key's blocks it shares: `min(end, len(prompt) - 1)` tokens that worker
would not compute. Changes apply in `seq` order; a gap, or an instance not seen before, makes the
view stale (`apply` says so) until a snapshot replaces it. A worker that leaves is dropped at once.
The index only steers: a worker decides what it reuses token by token, so a stale view costs
compute, never correctness.

Cost of sending a prompt of L tokens to prefill worker w (lowest wins; docs/kv_state.md):
    load(w) + L - weight * overlap(w)
load: prompt tokens queued at w and in flight to it from this router. weight 0 turns affinity off.
Decode workers report their turn caches the same way (shared/kv/turn_cache.py); among those with
free slots the router takes the one with the fewest requests in flight from it, less `bonus`
for one that holds the conversation's last turn.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from baton.proto.internal import PrefixEvents
from baton.shared.kv.prefix_hash import digests

TURN_BONUS = 2  # requests in flight a decode holding the last turn may have beyond the least busy


@dataclass
class _View:
    instance_id: str
    seq: int
    block: int
    ends: dict[tuple[int, int], Counter] = field(default_factory=dict)  # (blocks, digest) -> cached ends

    def add(self, blocks: int, digest: int, tokens: int) -> None:
        self.ends.setdefault((blocks, digest), Counter())[tokens] += 1

    def remove(self, blocks: int, digest: int, tokens: int) -> None:
        ends = self.ends.get((blocks, digest))
        if not ends or not ends[tokens]:
            return
        ends[tokens] -= 1
        if not ends[tokens]:
            del ends[tokens]
        if not ends:
            del self.ends[(blocks, digest)]


class PrefixAffinity:
    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight
        self._views: dict[str, _View] = {}  # worker id -> its current view

    def __len__(self) -> int:
        """Cached prompt ends known, over every worker."""
        return sum(sum(c.values()) for v in self._views.values() for c in v.ends.values())

    def apply(self, events: PrefixEvents) -> bool:
        """Take one message; False when it cannot be applied (a gap in seq, an instance not seen
        before): the caller should ask that worker for a snapshot."""
        view = self._views.get(events.worker_id)
        same = view is not None and view.instance_id == events.instance_id
        if same and events.seq <= view.seq:
            return True  # applied already, or inside the snapshot that replaced the view
        if events.snapshot:
            view = self._views[events.worker_id] = _View(events.instance_id, events.seq, events.block)
        elif same and events.seq == view.seq + 1:
            view.seq = events.seq
            for e in events.evicted:
                view.remove(e.blocks, e.digest, e.tokens)
        else:
            return False
        for e in events.added:
            view.add(e.blocks, e.digest, e.tokens)
        return True

    def knows(self, worker_id: str, instance_id: str) -> bool:
        view = self._views.get(worker_id)
        return view is not None and view.instance_id == instance_id

    def overlap(self, token_ids: list[int], chains: dict[int, list[int]] | None = None) -> dict[str, int]:
        """worker id -> leading tokens of `token_ids` its cache would not compute (0s left out).
        `chains`: block size -> the prompt's digests, filled here and shared between calls for one
        prompt (a 4k-token prompt's digests take ~0.3 ms)."""
        found: dict[str, int] = {}
        chains = {} if chains is None else chains
        for worker_id, view in self._views.items():
            if not view.ends:
                continue
            chain = chains.get(view.block)
            if chain is None:
                chain = chains[view.block] = digests(token_ids, view.block)
            for blocks in range(len(chain) - 1, 0, -1):  # (0 blocks: no evidence of a shared prefix)
                ends = view.ends.get((blocks, chain[blocks]))
                if ends:
                    found[worker_id] = min(max(ends), len(token_ids) - 1)
                    break
        return {w: n for w, n in found.items() if n > 0}

    def cost(self, load: int, prompt_tokens: int, overlap: int) -> float:
        return load + prompt_tokens - self.weight * overlap

    def bonus(self, overlap: int) -> float:
        """For decode workers (their turn caches): requests in flight a held conversation outweighs
        (TURN_BONUS, scaled by the weight), so a follow-up turn stays with the decode that holds its
        last turn unless that decode is this many requests busier than another."""
        return self.weight * TURN_BONUS if overlap > 0 else 0.0

    def forget(self, worker_id: str) -> None:
        self._views.pop(worker_id, None)
