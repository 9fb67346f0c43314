"""One NIXL agent, driven from one dedicated thread, which also makes its UCX progress.

Threading rule: NIXL's API is not thread safe (the agent runs with NIXL_THREAD_SYNC_NONE), and posting
a WRITE over UCX's `cma` transport copies the bytes inside the call (~25 ms for 256 MiB), which
must not stall an event loop. So the `nixl_agent` lives inside this object and every call to it
goes through `run` / `call` / `submit` as a function `fn(agent, *args)`, executed in FIFO order
on the thread "nixl-<name>". Nothing else may touch the agent or its handles.

Progress: this thread makes all of the agent's UCX progress; NIXL's own progress thread is off.
A WRITE copies inside `transfer()` holding the UCX worker's lock, and NIXL's thread, woken
meanwhile, spun on that lock and took the second core of a 2-core machine: write_soak's p99
was 3.5-4.2 ms with it and 1.7-2.0 ms without (docs/benchmarks.md, stop 15). (Stops 7-14 ran it,
paced, because driving progress from here seemed to leave one request in a thousand stalled;
that was the lost wake-up `_Inbox` fixes.) This thread, between calls,
(1) collects notifications with `get_new_notifs` (which progresses UCX: our notices go out, a
peer's arrive) every EXPECTING_PROGRESS_S while `due()` says a WRITE to us has started (its
sender said so: `hurry`) and `patient()` does not say it may wait (the receiver's engine is
stepping: an arrival waits for the step in flight anyway); every PROGRESS_S while `expecting()`
says a WRITE to us is to come (a receiver holding a reservation), while WRITEs of ours are in
flight, after a call, or while a due WRITE may wait; and every IDLE_PROGRESS_S otherwise. Each
wake-up takes the GIL from the engine thread: at 1 kHz that cost a decode step ~1.5 ms
(docs/benchmarks.md, issue 21), at c = 16 polling every 0.1 ms took 5% of decode's CPU, and at
c = 1 polling every 0.1 ms from reservation to arrival (the whole prefill) cost decode 17 ms of CPU
a request, about half a core beside the prefill it waited for (stop 51). Collected notifications go to the sink (`set_sink`);
(2) checks the state of posted WRITEs (`post`; progresses them), from WATCH_FIRST_S backing off
to WATCH_MAX_S; once none is in flight it calls their callback, then releases their handles
(before any call queued after the callback ran: the handles are gone by the time a caller
woken by it can ask this thread for anything).
Sink and callbacks run on this thread: they must be thread safe (e.g. `loop.call_soon_threadsafe`).

Teardown: the agent is destroyed (UCX torn down) when its last reference goes, and that must
happen here too, not on whichever thread a garbage collection runs later while other agents in
the process are busy. NIXL's handle objects (prepared lists, WRITEs) hold the agent, so their
owners drop them once released (`nixl_ops.release`, `TransferAgent.close`), and exceptions that
leave this thread carry their traceback as text, not frames (`_without_frames`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import select
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .nixl_ops import error_text, refresh, release

log = logging.getLogger(__name__)

PROGRESS_S = 0.001
EXPECTING_PROGRESS_S = 0.0001
IDLE_PROGRESS_S = 0.01  # nothing due, nothing in flight, no recent call: each wake-up takes the GIL
WATCH_FIRST_S = 0.00005  # a small WRITE with its notification takes ~0.2 ms on loopback
WATCH_MAX_S = 0.0005
SPLIT_DESCRIPTORS = 8  # with copy threads, a WRITE of fewer descriptors stays on one thread
_PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
Notifications = dict[str, list[bytes]]  # peer agent name -> messages, in arrival order


def create_agent(name: str, copy_threads: int = 0) -> Any:
    """A NIXL agent with the UCX backend, without NIXL's progress thread (above).

    `copy_threads` > 0 gives the backend that many extra UCX workers, each with its own thread
    (NIXL's UCX thread-pool engine): a WRITE of at least SPLIT_DESCRIPTORS descriptors (after
    NIXL merges adjacent items) is cut into chunks of consecutive descriptors, about one per
    thread, that copy in parallel; `transfer()` returns once every chunk is posted (over `cma`:
    copied) and the WRITE reads DONE once the threads have marked their chunks done. Such a WRITE
    must not be released while in flight (`nixl_ops.cancel`). 0: the calling thread copies."""
    from nixl_cu12 import _api  # not the `nixl` shim: no CUDA torch

    if copy_threads < 0:
        raise ValueError(f"copy_threads must be >= 0, got {copy_threads}")
    agent = _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    params = {"num_threads": str(copy_threads), "split_batch_size": str(SPLIT_DESCRIPTORS)} if copy_threads else {}
    agent.create_backend("UCX", params)
    return agent


class NixlThread:
    def __init__(self, name: str, copy_threads: int = 0):
        self.copy_threads = copy_threads
        self.expecting: Callable[[], bool] = lambda: False  # read on the NIXL thread: must be cheap and safe
        self.due: Callable[[], bool] = lambda: False  # likewise: a WRITE to us has started
        self.patient: Callable[[], bool] = lambda: False  # likewise: a due WRITE may wait PROGRESS_S
        self._calls = _Inbox()
        self._held: Notifications = {}  # collected, not yet handed to a sink (NIXL thread only)
        self._sink: Callable[[Notifications], None] | None = None
        self._watched: list[_Watch] = []  # NIXL thread only
        self._closed = False
        started: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(name, started),
                                        name=f"nixl-{name}", daemon=True)
        self._thread.start()
        started.result()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(agent, *args)` on the NIXL thread and wait for it (start-up and shutdown only:
        it blocks the caller)."""
        return self._submit(fn, args).result()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(agent, *args)` on the NIXL thread; the event loop keeps running meanwhile."""
        return await asyncio.wrap_future(self._submit(fn, args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(agent, *args)` without waiting for it (`fn` must handle its own errors)."""
        self._submit(fn, args)

    async def set_sink(self, sink: Callable[[Notifications], None] | None) -> None:
        """From now on hand notifications (held ones first) to `sink`, called on the NIXL thread."""
        await self.run(self._set_sink, sink)

    def post(self, fn: Callable[..., Any], xfers: list, done: Callable[[], None], *args: Any) -> None:
        """Post `xfers` (`nixl_ops.Xfer`s) with `fn(agent, *args, xfers)`, then keep their `state`
        fresh; once none is "PROC", call `done()` on the NIXL thread and release their handles.
        One queue item: a WRITE that finished inside `fn` (cma copies in the call) is done at once."""
        self.submit(self._post, fn, xfers, done, args)

    def _post(self, agent: Any, fn: Callable[..., Any], xfers: list, done: Callable[[], None],
              args: tuple) -> None:
        try:
            fn(agent, *args, xfers)
        finally:
            self._watched.append(_Watch(xfers, done))
            self._watch_due(agent)

    def hurry(self) -> None:
        """A WRITE to us has started (`due()` now says so): collect notifications at once, and from
        then on every EXPECTING_PROGRESS_S."""
        self.submit(self._progress)

    def close(self) -> None:
        """Run the calls already queued, stop the thread; later calls fail at once."""
        self._closed = True
        self._calls.put(None)
        self._thread.join()
        self._calls.close()

    def _submit(self, fn: Callable[..., Any], args: tuple) -> Future:
        future: Future = Future()
        if self._closed:  # e.g. a notice queued by a task that outlived the agent
            future.set_exception(RuntimeError(f"NIXL thread {self._thread.name} is closed"))
        else:
            self._calls.put((fn, args, future))
        return future

    def _set_sink(self, agent: Any, sink: Callable[[Notifications], None] | None) -> None:
        self._sink = sink
        self._hand_over()

    def _main(self, name: str, started: Future) -> None:
        try:
            agent = create_agent(name, self.copy_threads)
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(None)
        next_progress = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_progress:
                self._progress(agent)
                next_progress = now + self._progress_interval()
            wake = min([next_progress, *(w.next_check for w in self._watch_due(agent))])
            try:
                item = self._calls.get(timeout=max(0.0, wake - time.monotonic()))
            except queue.Empty:
                continue
            if item is None:
                return
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(agent, *args))
                except BaseException as e:
                    future.set_exception(_without_frames(e))
            # what the call sent goes out; a call that made a WRITE due polls at its pace from now on
            next_progress = min(next_progress, time.monotonic() + min(PROGRESS_S, self._progress_interval()))

    def _progress_interval(self) -> float:
        if self.due() and not self.patient():
            return EXPECTING_PROGRESS_S
        return PROGRESS_S if self.expecting() or self._watched else IDLE_PROGRESS_S

    def _watch_due(self, agent: Any) -> list[_Watch]:
        """Refresh the watched WRITEs that are due; finish those with nothing in flight."""
        now = time.monotonic()
        for w in self._watched:
            if now >= w.next_check:
                refresh(agent, w.xfers)
                w.interval = min(max(2 * w.interval, WATCH_FIRST_S), WATCH_MAX_S)
                w.next_check = now + w.interval
        finished = [w for w in self._watched if all(x.state != "PROC" for x in w.xfers)]
        for w in finished:
            self._watched.remove(w)
            try:
                w.done()  # first: the handles are released before this thread runs anything queued after it
            except Exception:
                log.exception("WRITE completion callback failed")
            release(agent, w.xfers)
        return self._watched

    def _progress(self, agent: Any) -> None:
        try:
            for peer, messages in agent.get_new_notifs().items():
                self._held.setdefault(peer, []).extend(messages)
        except Exception as e:
            log.error("NIXL progress failed: %s", error_text(e))
        self._hand_over()

    def _hand_over(self) -> None:
        if self._held and self._sink is not None:
            held, self._held = self._held, {}
            try:
                self._sink(held)
            except Exception as e:  # e.g. the event loop is closed: nobody is listening any more
                log.error("dropped notifications from %s: %s", sorted(held), e)


def _without_frames(error: BaseException) -> BaseException:
    """`error` (and the errors it chains) with its traceback as a note instead of frames, to hand
    to another thread: the frames' locals, and their callers' through `f_back`, hold the agent,
    which must die on this thread (module docstring)."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            e.add_note("raised on the NIXL thread at:\n" + "".join(traceback.format_tb(e.__traceback__)).rstrip())
            e.with_traceback(None)
        e = e.__cause__ or e.__context__
    return error


class _Inbox:
    """The calls for the NIXL thread, FIFO. A put wakes the waiting thread through an eventfd and
    select(). (queue.SimpleQueue.get(timeout=...) was used before: in these processes, with NIXL's
    and UCX's threads running, a get asked to wait 20-25 us sometimes waited until the next put,
    2 s later: about one request in 6,000 then had a finished WRITE nobody looked at until its
    transfer deadline.)"""

    def __init__(self):
        self._items: deque = deque()  # append/popleft are thread safe
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def put(self, item: Any) -> None:
        self._items.append(item)
        os.eventfd_write(self._wake, 1)

    def get(self, timeout: float) -> Any:
        """The oldest item; raises queue.Empty if none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self._items:
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            select.select([self._wake], [], [], left)
            try:
                os.eventfd_read(self._wake)  # a wake-up left by puts already taken only ends this wait early
            except BlockingIOError:
                pass
        return self._items.popleft()

    def close(self) -> None:
        os.close(self._wake)


@dataclass(eq=False)
class _Watch:
    xfers: list
    done: Callable[[], None]
    interval: float = 0.0  # checked at once, then after WATCH_FIRST_S, doubling to WATCH_MAX_S
    next_check: float = 0.0


def cma_hint() -> str:
    """Why cross-process CMA may be unavailable here, and what to set; empty when nothing is known
    to be wrong. UCX copies host memory between processes with process_vm_writev (`cma`), which
    needs ptrace permission over the peer (Yama ptrace_scope 0, or CAP_SYS_PTRACE)."""
    if "UCX_TLS" in os.environ:
        return ""
    try:
        scope = _PTRACE_SCOPE.read_text().strip()
    except OSError:
        scope = "0"
    if scope == "0":
        return ""
    return (f"kernel.yama.ptrace_scope is {scope}, so UCX's cma transport (process_vm_writev) may "
            "be refused between sibling processes; set kernel.yama.ptrace_scope=0 or grant "
            "CAP_SYS_PTRACE, or run every worker with UCX_TLS=^cma (TCP over loopback, slower)")
