"""Prompts tokenized off the event loop, a fair share per client.

A few threads tokenize (the tokenizer releases the GIL). Waiting prompts queue per client (the
sender of the request, `shared/bus/senders.py`) and a free thread takes the oldest prompt of the
next client in turn (a client with nothing waiting goes first; one just served goes last), so one
client's many long prompts delay another's by at most the prompts already being tokenized, not by
its whole backlog. A client with `max_waiting_per_client` prompts waiting gets `busy` for the next.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from baton.proto.errors import BatonError, ErrorCode

Job = tuple[str, asyncio.Future]  # (prompt, its token ids once tokenized)


class FairTokenizer:
    def __init__(self, encode: Callable[[str], list[int]], threads: int = 2, max_waiting_per_client: int = 64) -> None:
        self._encode, self._threads, self._max_waiting = encode, threads, max_waiting_per_client
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._waiting: OrderedDict[str, deque[Job]] = OrderedDict()  # client -> its prompts; the order is the turn
        self._running = 0

    async def encode(self, client: str, prompt: str) -> list[int]:
        waiting = self._waiting.get(client)
        if waiting is None:  # nothing of it waits: its turn comes before those that were just served
            waiting = self._waiting[client] = deque()
            self._waiting.move_to_end(client, last=False)
        if len(waiting) >= self._max_waiting:
            raise BatonError(ErrorCode.BUSY, f"{len(waiting)} prompts of this client wait to be tokenized; retry later")
        ids: asyncio.Future = asyncio.get_running_loop().create_future()
        waiting.append((prompt, ids))
        self._dispatch()
        return await ids  # cancelled (the client left): dropped when its turn comes

    def waiting(self, client: str) -> int:
        return len(self._waiting.get(client, ()))

    def _dispatch(self) -> None:
        while self._running < self._threads and self._waiting:
            client, jobs = next(iter(self._waiting.items()))
            prompt, ids = jobs.popleft()
            if jobs:
                self._waiting.move_to_end(client)  # its next prompt waits for everyone else's turn
            else:
                del self._waiting[client]
            if ids.cancelled():
                continue
            self._running += 1
            tokenized = asyncio.wrap_future(self._pool.submit(self._encode, prompt))
            tokenized.add_done_callback(lambda done, ids=ids: self._finished(done, ids))

    def _finished(self, done: asyncio.Future, ids: asyncio.Future) -> None:
        self._running -= 1
        if not ids.done():
            if done.cancelled():
                ids.cancel()
            elif done.exception() is not None:
                ids.set_exception(done.exception())
            else:
                ids.set_result(done.result())
        self._dispatch()

    def close(self) -> None:
        for jobs in self._waiting.values():
            for _, ids in jobs:
                ids.cancel()
        self._waiting.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
