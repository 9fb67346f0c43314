"""Decode's batch between two steps (`DecodeWorker._rebatch`, on the engine thread): who leaves,
who joins, what the loop is told; a prompt computed here streams its first token before its draft
window; and a run whose step raises (pure logic; the worker's other parts are stand-ins)."""
import asyncio
import threading
from collections import deque
from types import MethodType, SimpleNamespace

import pytest

from baton.services.decode import service as decode_service
from baton.services.decode.service import DecodeWorker, Request
from baton.shared.transfer.notices import request_tag
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def request(name: str) -> Request:
    return Request(Sequence(name, [1, 2, 3], 8, SamplingParams()), "stream", "transfer", 0.0, 0)


def worker(members=(), joining=(), max_batch=4, fail=()):
    started = []

    def start(req: Request, post) -> None:
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


def test_a_step_that_raises_fails_its_batch_and_the_service_goes_on(monkeypatch):
    """Every request of the batch gets an error reply and its slots back; a request that arrives
    after runs in a new batch."""
    monkeypatch.setattr(decode_service, "PARK_S", 0.01)  # an idle run returns soon
    a, b, c = request("a"), request("b"), request("c")
    stepped, errors, finished, freed = [], [], [], []

    def step(seqs):
        stepped.append([s.request_id for s in seqs])
        if len(stepped) == 1:
            raise RuntimeError("kernel fault")
        for s in seqs:
            s.finish_reason = "length"
        return [[7] for _ in seqs]

    async def publish_error(req, error):
        errors.append((req.seq.request_id, error.code.value, error.message))

    async def finish(tag, req, reason):
        finished.append((req.seq.request_id, reason))
        w.requests.pop(tag, None)

    async def publish(req, tokens):
        pass

    async def engine_call(fn, *args):
        return await asyncio.to_thread(fn, *args)
    w, _ = worker(joining=[a, b])
    w.__dict__.update(
        _start=lambda req, post: None, _stepping=False, _engine_wake=threading.Event(),
        engine=SimpleNamespace(call=engine_call), runner=SimpleNamespace(step=step),
        metrics=SimpleNamespace(step_seconds=SimpleNamespace(observe=lambda s: None),
                                tokens=SimpleNamespace(inc=lambda n: None)),
        store=SimpleNamespace(free=freed.append), requests={request_tag(r.seq.request_id): r for r in (a, b, c)},
        _publish_error=publish_error, _finish=finish, _publish=publish)
    for name in ("_run_batch", "_run", "_rebatch", "_after", "_fail_batch"):
        setattr(w, name, MethodType(getattr(DecodeWorker, name), w))

    async def scenario():
        await asyncio.wait_for(w._run_batch(), 10)  # its step raises: the run ends, the batch fails
        w._joining.append(c)
        await asyncio.wait_for(w._run_batch(), 10)  # the next request: a new batch, to its end
    asyncio.run(scenario())
    assert stepped == [["a", "b"], ["c"]]
    assert [(rid, code) for rid, code, _ in errors] == [("a", "internal"), ("b", "internal")]
    assert all("a decode step failed: RuntimeError: kernel fault" in message for _, _, message in errors)
    assert freed == ["a", "b"] and finished == [("c", "length")]
    assert w._members == [] and not w._stepping and list(w.requests) == []


class RecordingBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, list[int]]] = []  # (subject, chunk seq, tokens), as written

    async def publish(self, subject, message, reply="") -> None:
        self.sent.append((subject, message.seq, message.token_ids))

    def write_pending(self) -> bool:
        return True


class PrefillHereRunner:
    """`ModelRunner.prefill_and_start` as decode calls it for a prompt it computes itself: the
    first token 7, drawn before the draft window; notes what the bus had sent by the window."""

    def __init__(self, bus: RecordingBus) -> None:
        self.bus, self.sent_by_the_window = bus, {}

    def prefill_and_start(self, seqs, draft_state, sampled_by=None, on_sampled=None):
        if on_sampled is not None:
            on_sampled([SimpleNamespace(first_token=7)])
        self.sent_by_the_window[seqs[0].request_id] = list(self.bus.sent)
        seqs[0].emit([7])  # start_decode


def test_a_prompt_computed_here_streams_its_first_token_before_its_draft_window_once(monkeypatch):
    """Without logprobs, the first token goes out as soon as it is drawn and the engine thread
    waits until it is written; with logprobs (computed as the request starts), once it starts.
    Each request's first token goes out once, as chunk 0."""
    monkeypatch.setattr(decode_service, "FIRST_TOKENS_WAIT_S", 60.0)  # only the loop's signal ends the wait
    bus = RecordingBus()
    plain, with_logprobs = request("plain"), request("logprobs")
    with_logprobs.seq = Sequence("logprobs", [1, 2, 3], 8, SamplingParams(), logprobs=1)
    for r in (plain, with_logprobs):
        r.stream, r.prefill = f"inbox.{r.seq.request_id}", Sequence(r.seq.request_id, [1, 2, 3], 8, SamplingParams())
    w, _ = worker(joining=[plain, with_logprobs])
    w.__dict__.update(bus=bus, runner=PrefillHereRunner(bus), spec=SimpleNamespace(enabled=True), probe_prefix="probe")
    for name in ("_start", "_prefill_here", "_after", "_first_ahead", "_publish_first", "_publish"):
        setattr(w, name, MethodType(getattr(DecodeWorker, name), w))
    w._stream_first_token = DecodeWorker._stream_first_token

    async def scenario():
        loop = asyncio.get_running_loop()
        tasks = []

        def post(item: tuple) -> None:  # engine thread -> loop, as `_run_batch` does
            loop.call_soon_threadsafe(lambda: tasks.append(asyncio.ensure_future(w._after(*item))))
        batch = await asyncio.wait_for(asyncio.to_thread(DecodeWorker._rebatch, w, post), 10)

        async def both_posted() -> None:  # "first" (the plain request), then "rebatch"
            while len(tasks) < 2:
                await asyncio.sleep(0)
        await asyncio.wait_for(both_posted(), 10)
        await asyncio.gather(*tasks)
        return batch
    batch = asyncio.run(scenario())
    assert names(batch) == ["plain", "logprobs"]
    assert w.runner.sent_by_the_window == {"plain": [("inbox.plain", 0, [7])], "logprobs": [("inbox.plain", 0, [7])]}
    assert bus.sent == [("inbox.plain", 0, [7]), ("inbox.logprobs", 0, [7])]
    assert plain.first_token_at is not None and with_logprobs.first_token_at is not None
