"""The router's record of which prefill worker was sent which prompt prefix (pure logic)."""
import pytest

from baton.services.router.affinity import BLOCK, PrefixAffinity

pytestmark = pytest.mark.unit


def test_a_follow_up_turn_finds_the_worker_its_conversation_went_to():
    record = PrefixAffinity()
    turn1 = list(range(3 * BLOCK + 5))
    record.record(turn1, "p0")
    record.record([9] * (2 * BLOCK), "p1")
    turn2 = turn1 + [1, 2, 3] * 20
    assert record.overlap(turn2) == {"p0": 3 * BLOCK}  # whole blocks only
    assert record.overlap([5] + turn1) == {}  # a different first block shares nothing
    # the cost prefers the holder unless its queue outweighs what it saves
    L = len(turn2)
    assert record.cost(0, L, 3 * BLOCK) < record.cost(0, L, 0)
    assert record.cost(10 * BLOCK, L, 3 * BLOCK) > record.cost(0, L, 0)
    assert PrefixAffinity(weight=0).cost(0, L, 3 * BLOCK) == PrefixAffinity(weight=0).cost(0, L, 0)


def test_a_prefix_sent_elsewhere_since_belongs_to_the_later_worker_and_the_record_is_bounded():
    record = PrefixAffinity(capacity=4)
    prompt = list(range(2 * BLOCK))
    record.record(prompt, "p0")
    record.record(prompt[:BLOCK], "p1")  # the first block went to p1 later
    assert record.overlap(prompt) == {"p1": BLOCK, "p0": 2 * BLOCK}
    record.record(list(range(500, 500 + 3 * BLOCK)), "p2")  # 3 more blocks: the oldest one goes
    assert len(record) == 4 and record.overlap(prompt) == {"p1": BLOCK}  # p0's second block was the oldest
    record.forget("p2")
    assert len(record) == 1
