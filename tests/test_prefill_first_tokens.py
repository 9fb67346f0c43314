"""Prefill's engine thread hands a batch's first tokens to the event loop and goes on (to the draft
windows and the WRITE) only once the loop has written them, or after FIRST_TOKENS_WAIT_S: computing
on meanwhile held the core and the GIL the loop needed to send them."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from baton.services.prefill import service
from baton.services.prefill.service import PrefillWorker
from baton.shared.metrics import Stamps

pytestmark = pytest.mark.unit


class RecordingBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, list[int]]] = []

    async def publish(self, subject, message, reply="") -> None:
        self.published.append((subject, message.token_ids))


def prefill_worker(bus: RecordingBus) -> SimpleNamespace:
    """The parts of a PrefillWorker the hand-off uses, with its own methods."""
    worker = SimpleNamespace(bus=bus, _tasks=set())
    worker._own = lambda coro: PrefillWorker._own(worker, coro)
    worker._send_first_tokens = lambda sending, written: PrefillWorker._send_first_tokens(worker, sending, written)
    return worker


def jobs_on(loop: asyncio.AbstractEventLoop, first_token_to: list[str | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(request_id=f"r{i}", dispatch=SimpleNamespace(first_token_to=to),
                            done=loop.create_future(), at=Stamps()) for i, to in enumerate(first_token_to)]


def test_the_engine_thread_goes_on_once_the_first_tokens_are_written(monkeypatch):
    monkeypatch.setattr(service, "FIRST_TOKENS_WAIT_S", 60.0)  # here: only the loop's signal ends the wait
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        bus = RecordingBus()
        jobs = jobs_on(loop, ["inbox.a", None, "inbox.c"])  # the second asked for no first token
        outputs = [SimpleNamespace(first_token=t) for t in (7, 8, 9)]
        PrefillWorker._stream_first_tokens(prefill_worker(bus), jobs, outputs)  # this thread: the engine's
        assert bus.published == [("inbox.a", [7]), ("inbox.c", [9])]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_loop_that_does_not_run_holds_the_engine_thread_only_for_the_bound(monkeypatch):
    monkeypatch.setattr(service, "FIRST_TOKENS_WAIT_S", 0.01)
    loop = asyncio.new_event_loop()  # not running: the first token waits for it, the engine thread does not
    try:
        bus = RecordingBus()
        worker = prefill_worker(bus)
        PrefillWorker._stream_first_tokens(worker, jobs_on(loop, ["inbox.a"]), [SimpleNamespace(first_token=7)])
        assert bus.published == []

        async def sent_once_the_loop_runs() -> None:
            while bus.published == [] or worker._tasks:
                await asyncio.sleep(0)
        loop.run_until_complete(asyncio.wait_for(sent_once_the_loop_runs(), 10))
        assert bus.published == [("inbox.a", [7])]
    finally:
        loop.close()
