"""The router's tokenization (services/router/tokenize.py): prompts of several clients take turns,
so one client's backlog delays another's prompt by at most what is already being tokenized; a
client with too many prompts waiting is `busy`; a cancelled prompt is skipped. The encoder here
blocks until the test lets each prompt through, so the order is observed, not timed."""
from __future__ import annotations

import asyncio
import threading

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.services.router.tokenize import FairTokenizer
from e2e_cluster import until

pytestmark = pytest.mark.unit
POLL_S = 0.005  # the conditions are set by the tokenizer's thread: look again this often


class GatedEncoder:
    """encode(prompt) waits until the test releases one prompt; records the order prompts start in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._gate = threading.Semaphore(0)
        self._lock = threading.Lock()

    def __call__(self, prompt: str) -> list[int]:
        with self._lock:
            self.started.append(prompt)
        assert self._gate.acquire(timeout=10), "never released"
        if prompt == "bad":
            raise ValueError("cannot encode")
        return [len(prompt)]

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()


async def tokenizing(tokenizer: FairTokenizer, encoder: GatedEncoder, client: str, prompt: str) -> asyncio.Task:
    """The one thread busy with `prompt` (the encoder holds it until released)."""
    task = asyncio.create_task(tokenizer.encode(client, prompt))
    await until(lambda: encoder.started == [prompt], 5, f"the encoder started on {prompt!r} alone", every_s=POLL_S)
    return task


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_another_clients_prompt_goes_next_not_after_the_whole_backlog():
    async def scenario():
        encoder = GatedEncoder()
        tokenizer = FairTokenizer(encoder, threads=1)
        flood = [asyncio.create_task(tokenizer.encode("flood", f"f{i}")) for i in range(6)]
        await until(lambda: encoder.started == ["f0"], 5, "the encoder started on f0 alone", every_s=POLL_S)
        small = asyncio.create_task(tokenizer.encode("other", "small"))
        await until(lambda: tokenizer.waiting("other") == 1, 5, "one prompt of `other` waiting", every_s=POLL_S)
        encoder.release(2)
        assert await small == [5]
        # the thread takes the next prompt after small's reply
        await until(lambda: len(encoder.started) == 3, 5, "a third prompt started", every_s=POLL_S)
        assert encoder.started == ["f0", "small", "f1"]
        encoder.release(5)
        assert await asyncio.gather(*flood) == [[2]] * 6
        assert encoder.started == ["f0", "small", "f1", "f2", "f3", "f4", "f5"]
        tokenizer.close()
    run(scenario)


def test_clients_with_backlogs_alternate():
    async def scenario():
        encoder = GatedEncoder()
        tokenizer = FairTokenizer(encoder, threads=1)
        first = await tokenizing(tokenizer, encoder, "a", "a0")
        rest = [asyncio.create_task(tokenizer.encode(c, f"{c}{i}")) for c in "ab" for i in (1, 2, 3)]
        await until(lambda: tokenizer.waiting("a") == 3 and tokenizer.waiting("b") == 3, 5,
                    "3 prompts of a and 3 of b waiting", every_s=POLL_S)
        encoder.release(7)
        await asyncio.gather(first, *rest)
        assert encoder.started == ["a0", "b1", "a1", "b2", "a2", "b3", "a3"]  # b had no turn yet
        tokenizer.close()
    run(scenario)


def test_a_client_with_too_many_prompts_waiting_is_busy_and_others_are_not():
    async def scenario():
        encoder = GatedEncoder()
        tokenizer = FairTokenizer(encoder, threads=1, max_waiting_per_client=2)
        running = await tokenizing(tokenizer, encoder, "a", "a0")
        waiting = [asyncio.create_task(tokenizer.encode("a", f"a{i}")) for i in (1, 2)]
        await until(lambda: tokenizer.waiting("a") == 2, 5, "2 prompts of a waiting", every_s=POLL_S)
        with pytest.raises(BatonError) as refused:
            await tokenizer.encode("a", "a3")
        assert refused.value.code is ErrorCode.BUSY
        other = asyncio.create_task(tokenizer.encode("b", "b0"))
        encoder.release(4)
        assert await asyncio.gather(running, *waiting, other) == [[2], [2], [2], [2]]
        tokenizer.close()
    run(scenario)


def test_a_cancelled_prompt_is_skipped_and_an_encoder_error_reaches_its_caller():
    async def scenario():
        encoder = GatedEncoder()
        tokenizer = FairTokenizer(encoder, threads=1)
        running = await tokenizing(tokenizer, encoder, "a", "a0")
        gone = asyncio.create_task(tokenizer.encode("b", "gone"))
        bad = asyncio.create_task(tokenizer.encode("c", "bad"))
        await until(lambda: tokenizer.waiting("b") == 1 and tokenizer.waiting("c") == 1, 5,
                    "a prompt of b and one of c waiting", every_s=POLL_S)
        gone.cancel()
        encoder.release(2)
        assert await running == [2]
        with pytest.raises(ValueError):
            await bad
        assert encoder.started == ["a0", "bad"]
        tokenizer.close()
    run(scenario)
