"""Decode's batch between two steps (`DecodeWorker._rebatch`, on the engine thread): who leaves,
who joins, what the loop is told (pure logic; the worker's other parts are stand-ins)."""
from collections import deque
from types import SimpleNamespace

import pytest

from baton.services.decode.service import DecodeWorker, Request
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def request(name: str) -> Request:
    return Request(Sequence(name, [1, 2, 3], 8, SamplingParams()), "stream", "transfer", 0.0, 0)


def worker(members=(), joining=(), max_batch=4, fail=()):
    started = []

    def start(req: Request) -> None:
        if req.seq.request_id in fail:
            raise RuntimeError("no aux row")
        started.append(req.seq.request_id)
    w = SimpleNamespace(_closing=False, _members=list(members), _joining=deque(joining), _start=start,
                        config=SimpleNamespace(worker=SimpleNamespace(max_batch=max_batch)))
    return w, started


def rebatch(w) -> tuple[list[str], list[tuple]]:
    posted = []
    batch = DecodeWorker._rebatch(w, posted.append)
    return [r.seq.request_id for r in batch], posted


def names(reqs) -> list[str]:
    return [r.seq.request_id for r in reqs]


def test_arrived_requests_join_a_batch_in_flight_and_ended_ones_leave_it():
    a, b, c = request("a"), request("b"), request("c")
    for r in (a, b):
        r.started = True
    b.seq.finish_reason = "length"
    w, started = worker(members=[a, b], joining=[c])
    batch, posted = rebatch(w)
    assert batch == ["a", "c"] and started == ["c"] and c.started
    assert [(kind, names(left), names(joined)) for kind, left, joined in posted] == [("rebatch", ["b"], ["c"])]
    assert names(w._members) == ["a", "c"] and not w._joining


def test_nothing_changed_posts_nothing():
    a = request("a")
    w, _ = worker(members=[a])
    assert rebatch(w) == (["a"], [])


def test_joiners_wait_for_room_in_order():
    members = [request(f"m{i}") for i in range(3)]
    x, y = request("x"), request("y")
    w, started = worker(members=members, joining=[x, y], max_batch=4)
    batch, _ = rebatch(w)
    assert batch == ["m0", "m1", "m2", "x"] and started == ["x"] and names(w._joining) == ["y"]


def test_a_request_released_before_it_started_leaves_without_starting():
    x, y = request("x"), request("y")
    x.abort = "released"
    w, started = worker(joining=[x, y])
    batch, posted = rebatch(w)
    assert batch == ["y"] and started == ["y"] and not x.started
    assert [(names(left), names(joined)) for _, left, joined in posted] == [(["x"], ["y"])]


def test_a_request_that_cannot_start_fails_alone():
    x, y = request("x"), request("y")
    w, started = worker(joining=[x, y], fail={"x"})
    batch, posted = rebatch(w)
    assert batch == ["y"] and started == ["y"]
    assert x.failed and "could not start: RuntimeError: no aux row" in x.abort and not x.started
    assert names(posted[0][1]) == ["x"]


def test_the_run_ends_when_the_batch_is_empty_or_the_worker_closes():
    a = request("a")
    a.started, a.abort = True, "released"
    w, _ = worker(members=[a])
    batch, posted = rebatch(w)
    assert batch == [] and names(posted[0][1]) == ["a"]
    b = request("b")
    w, started = worker(joining=[b])
    w._closing = True
    assert rebatch(w) == ([], []) and started == []
