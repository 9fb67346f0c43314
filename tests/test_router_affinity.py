"""The router's index of what each prefill worker's prefix cache holds, fed by the workers'
`PrefixEvents` (pure logic)."""
import pytest

from baton.proto.internal import CachedPrefix, PrefixEvents
from baton.services.router.affinity import PrefixAffinity
from baton.shared.kv.prefix_hash import digests

pytestmark = pytest.mark.unit

BLOCK = 16


def cached(prompt: list[int], blocks: int) -> CachedPrefix:
    """The end of `prompt`, keyed by its first `blocks` whole blocks (as the prefill cache keys it)."""
    return CachedPrefix(blocks=blocks, digest=digests(prompt, BLOCK, blocks)[-1], tokens=len(prompt))


def events(worker: str, seq: int, added=(), evicted=(), instance: str = "i0", snapshot: bool = False) -> PrefixEvents:
    return PrefixEvents(worker_id=worker, instance_id=instance, seq=seq, block=BLOCK, added=list(added),
                        evicted=list(evicted), snapshot=snapshot)


def test_a_follow_up_turn_finds_the_worker_holding_its_conversation_and_costs_less_there():
    index = PrefixAffinity()
    turn1 = list(range(3 * BLOCK + 5))
    assert index.apply(events("p0", 0, snapshot=True)) and index.apply(events("p0", 1, [cached(turn1, 3)]))
    assert index.apply(events("p1", 4, [cached([9] * (2 * BLOCK), 2)], snapshot=True))
    turn2 = turn1 + [1, 2, 3] * 20
    assert index.overlap(turn2) == {"p0": len(turn1)}  # p0 computes only the new turn
    assert index.overlap([5] + turn1) == {}  # a different first block shares nothing
    assert index.overlap(turn1[:BLOCK * 3 + 1]) == {"p0": 3 * BLOCK}  # at most all but the last token
    L = len(turn2)
    assert index.cost(0, L, len(turn1)) < index.cost(0, L, 0)
    assert index.cost(10 * BLOCK, L, len(turn1)) > index.cost(0, L, 0)  # unless its queue outweighs it
    assert PrefixAffinity(weight=0).cost(0, L, len(turn1)) == PrefixAffinity(weight=0).cost(0, L, 0)


def test_an_eviction_removes_the_end_and_the_longest_held_end_counts():
    index = PrefixAffinity()
    short, long = list(range(2 * BLOCK + 3)), list(range(2 * BLOCK + 30))
    index.apply(events("p0", 0, snapshot=True))
    index.apply(events("p0", 1, [cached(short, 2), cached(long, 2)]))  # one key, two ends
    assert index.overlap(long + [1]) == {"p0": len(long)} and len(index) == 2
    index.apply(events("p0", 2, evicted=[cached(long, 2)]))
    assert index.overlap(long + [1]) == {"p0": len(short)}
    index.apply(events("p0", 3, evicted=[cached(short, 2)]))
    assert index.overlap(long + [1]) == {} and len(index) == 0


def test_a_gap_or_an_unknown_instance_asks_for_a_snapshot_which_replaces_the_view():
    index = PrefixAffinity()
    prompt = list(range(4 * BLOCK))
    assert not index.apply(events("p0", 1, [cached(prompt, 3)]))  # never had a snapshot of p0
    assert index.apply(events("p0", 5, [cached(prompt, 3)], snapshot=True)) and index.knows("p0", "i0")
    assert index.apply(events("p0", 5, [cached(prompt, 3)]))  # inside the snapshot: ignored, no double count
    assert len(index) == 1
    assert not index.apply(events("p0", 7, evicted=[cached(prompt, 3)]))  # 6 went missing
    assert index.overlap(prompt + [1]) == {"p0": len(prompt)}  # the stale view still steers until replaced
    assert not index.apply(events("p0", 1, instance="i1"))  # a restart: a new instance
    assert not index.knows("p0", "i1")
    index.apply(events("p0", 2, [], instance="i1", snapshot=True))
    assert index.knows("p0", "i1") and index.overlap(prompt + [1]) == {}
    assert index.apply(events("p0", 1, [cached(prompt, 3)], instance="i1", snapshot=True))  # an older snapshot
    assert len(index) == 0


def test_a_worker_forgotten_drops_out_at_once():
    index = PrefixAffinity()
    prompt = list(range(2 * BLOCK))
    for worker in ("p0", "p1"):
        index.apply(events(worker, 1, [cached(prompt, 1)], snapshot=True))
    assert index.overlap(prompt + [1]) == {"p0": len(prompt), "p1": len(prompt)}
    index.forget("p0")
    assert index.overlap(prompt + [1]) == {"p1": len(prompt)} and not index.knows("p0", "i0")
