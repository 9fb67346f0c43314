"""The aggregated baseline streams a prompt's first token as soon as it is drawn, as prefill does
(ahead of the draft windows), unless logprobs are asked for; each first token goes out once (pure
logic: `AggregatedEngine._admit` with the engine thread's prefill stood in for)."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from baton.services.aggregated.engine import AggregatedEngine, Job
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def pushed(job: Job) -> list[list[int]]:
    return [tokens for kind, (tokens, _) in job._events._queue if kind == "tokens"]


def test_the_first_token_reaches_the_job_while_the_engine_thread_still_computes():
    plain = Job(Sequence("plain", [1, 2, 3], 8, SamplingParams()), None, lambda: None)
    with_logprobs = Job(Sequence("logprobs", [1, 2, 3], 8, SamplingParams(), logprobs=1), None, lambda: None)
    plain_first = threading.Event()  # set on the loop once the plain job has its first token
    early = []

    def prefill(batch, sampled):  # engine thread: the first tokens drawn, then the draft windows
        sampled([SimpleNamespace(first_token=7), SimpleNamespace(first_token=8)])
        early.append(plain_first.wait(10))  # the loop has it before this thread goes on
        for job, token in zip(batch, (7, 8)):
            job.seq.emit([token])  # start_decode

    async def scenario():
        loop = asyncio.get_running_loop()
        engine = SimpleNamespace(thread=SimpleNamespace(call=lambda fn, *args: loop.run_in_executor(None, fn, *args)),
                                 _prefill=prefill, running=[])

        async def watch() -> None:
            while not pushed(plain):
                await asyncio.sleep(0.001)
            plain_first.set()
        watching = asyncio.ensure_future(asyncio.wait_for(watch(), 10))
        await asyncio.wait_for(AggregatedEngine._admit(engine, [plain, with_logprobs]), 10)
        await watching
        return engine
    engine = asyncio.run(scenario())
    assert early == [True]
    assert pushed(plain) == [[7]] and pushed(with_logprobs) == [[8]]
    assert engine.running == [plain, with_logprobs]
