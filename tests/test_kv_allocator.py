"""IdPool: all-or-nothing takes, handed out as contiguous runs where the free space allows."""
import pytest
from hypothesis import given, settings, strategies as st

from baton.shared.kv import KVError, KVStore, OutOfCapacity
from baton.shared.kv.allocator import IdPool

from test_kv_store import PS, make_cfg

pytestmark = pytest.mark.unit


def runs(ids: list[int]) -> int:
    """Number of maximal runs of consecutive ascending ids."""
    return sum(1 for a, b in zip([None, *ids], ids) if a is None or b != a + 1)


def test_fresh_pool_gives_one_run_from_the_lowest_id():
    pool = IdPool(10, "pages")
    assert pool.take(4) == [0, 1, 2, 3] and pool.take(3) == [4, 5, 6]


def test_take_prefers_the_smallest_run_that_holds_it():
    pool = IdPool(20, "pages")
    a, b, c, _ = pool.take(5), pool.take(3), pool.take(4), pool.take(2)  # free: 14..19
    pool.give(b)  # free runs: 5..7 (3), 14..19 (6)
    assert pool.take(2) == [5, 6]  # best fit, not the first 2 of the larger run
    pool.give(a)  # free runs: 0..4 (5), 7 (1), 14..19 (6)
    assert pool.take(6) == [14, 15, 16, 17, 18, 19]
    pool.give(c)  # free runs: 0..4 (5), 7..11 (5)
    assert runs(pool.take(8)) == 2  # no run holds 8: the longest runs, never the lone ids
    pool.check_integrity()


def test_give_is_all_or_nothing():
    pool = IdPool(6, "slots")
    ids = pool.take(3)
    for bad in ([ids[0], 5], [ids[0], ids[0]], [7]):
        with pytest.raises(KVError):
            pool.give(bad)
        assert pool.num_free == 3 and pool.used == frozenset(ids)
    with pytest.raises(OutOfCapacity):
        pool.take(4)
    assert pool.num_free == 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 99)), max_size=40))
def test_random_takes_and_gives_match_a_set(ops):
    """Against a plain set: takes are distinct free ids, one run whenever a free run holds them,
    and gives return exactly what was taken."""
    pool, held, used = IdPool(32, "pages"), [], set()
    for is_take, n, pick in ops:
        if is_take or not held:
            if n > 32 - len(used):
                with pytest.raises(OutOfCapacity):
                    pool.take(n)
                continue
            longest = max(pool.free_runs()[1], default=0)
            ids = pool.take(n)
            assert len(set(ids)) == n and not used & set(ids)
            assert runs(ids) == 1 or longest < n
            held.append(ids)
            used |= set(ids)
        else:
            ids = held.pop(pick % len(held))
            pool.give(ids)
            used -= set(ids)
        pool.check_integrity()
        assert pool.used == used and pool.num_free == 32 - len(used)


def test_fresh_store_gives_a_request_one_run_of_pages():
    store = KVStore(make_cfg(), mode="paged", num_pages=40, page_size=PS, num_slots=3,
                    max_draft_tokens=3)
    store.allocate("a", 5 * PS)
    assert list(store.allocate("b", 7 * PS - 1).page_ids) == list(range(5, 12))
    store.free("a")
    assert list(store.allocate("c", 3 * PS).page_ids) == [0, 1, 2]  # the freed run, in order
    store.check_integrity()
