"""Whether a worker's NIXL metadata can be used, checked once when it registers (the registry).

A registration carries the worker's NIXL agent metadata, opaque bytes every peer loads before its
first WRITE or notice. Metadata that does not load, names another agent, or does not register the
memory the manifest advertises would otherwise be found only by the first request sent to or from
that worker, which then fails. `MetadataCheck` loads it the way a peer does, into a scratch agent
(UCX backend, no memory of its own, no peer kept): NIXL parses it and opens a UCX endpoint to the
worker's address, so the worker must also be reachable from here with this process's `UCX_TLS`;
then the manifest's regions are prepared against the memory the metadata registers.

NIXL's parser is not safe on arbitrary bytes: some corruptions of a real metadata blob crash the
process that loads them (segfault inside `add_remote_agent`). So the scratch agent lives in a
child process (`python -m baton.shared.transfer.metadata_check`, one request at a time over its
stdin/stdout: a little-endian u32 length, then msgpack), which is started again after a crash;
metadata that crashes it is refused, so it never reaches a peer, which would crash the same way.
"""
from __future__ import annotations

import asyncio
import os
import struct
import sys
from typing import Any, BinaryIO

import msgpack

from .regions import Region

_LENGTH = struct.Struct("<I")


class MetadataCheck:
    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s  # one check, the child's start-up (~0.5 s) included
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one check at a time

    async def problem(self, worker_id: str, metadata: bytes, regions: list[Region]) -> str:
        """Why a peer could not use worker `worker_id`'s metadata with these regions; "" if it can.
        Raises TimeoutError if the check did not finish within `timeout_s` (the child is killed)."""
        request = msgpack.packb([worker_id, metadata, [[r.addr, r.nbytes, r.device_id, r.mem_kind]
                                                       for r in regions]])
        async with self._lock:
            try:
                return await asyncio.wait_for(self._ask(request), self.timeout_s)
            except (asyncio.IncompleteReadError, ConnectionError):  # the child died (BrokenPipeError included)
                code = await self._reap()
                return f"its NIXL metadata crashed NIXL's loader (the checking process ended with {code})"
            except asyncio.TimeoutError:
                await self._reap()
                raise

    async def start(self) -> None:
        """Start the checking process now, so that the first registration does not wait for it."""
        async with self._lock:
            await self._spawn()

    async def close(self) -> None:
        async with self._lock:
            if self._child is not None and self._child.returncode is None:
                self._child.stdin.close()
                try:
                    await asyncio.wait_for(self._child.wait(), 5.0)
                except asyncio.TimeoutError:
                    await self._reap()
            self._child = None

    async def _spawn(self) -> None:
        if self._child is None:  # its stdin closing (our exit, even a kill -9) ends it
            self._child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def _ask(self, request: bytes) -> str:
        await self._spawn()
        self._child.stdin.write(_LENGTH.pack(len(request)) + request)
        await self._child.stdin.drain()
        (n,) = _LENGTH.unpack(await self._child.stdout.readexactly(_LENGTH.size))
        return msgpack.unpackb(await self._child.stdout.readexactly(n))

    async def _reap(self) -> int | None:
        child, self._child = self._child, None
        if child is None:
            return None
        if child.returncode is None:
            child.kill()
        return await child.wait()


def problem(agent: Any, worker_id: str, metadata: bytes, rows: list[list]) -> str:
    """The check itself, in the child: load as a peer would, compare the name, prepare the regions
    (one list per memory kind, as a peer prepares them). rows: [addr, nbytes, device id, memory
    kind] of each region the manifest names."""
    from .nixl_ops import error_text
    try:
        name = agent.add_remote_agent(metadata)
    except Exception as e:
        return (f"its NIXL metadata does not load ({error_text(e)}): not a NIXL agent's metadata, "
                "or the agent's address cannot be reached from the registry")
    name = name.decode() if isinstance(name, bytes) else name
    try:
        if name != worker_id:
            return f"its NIXL metadata belongs to agent {name!r}"
        for kind in dict.fromkeys(row[3] for row in rows):
            try:  # one row per region: is it inside memory the metadata registers?
                agent.prep_xfer_dlist(name, [(addr, nbytes, dev) for addr, nbytes, dev, k in rows if k == kind],
                                      kind).release()
            except Exception as e:
                return (f"its manifest's {kind} regions are not memory its NIXL agent registered "
                        f"({error_text(e)})")
        return ""
    finally:
        agent.remove_remote_agent(name)


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    from .nixl_thread import create_agent
    agent = create_agent(f"baton-metadata-check-{os.getpid()}")
    while header := requests.read(_LENGTH.size):
        (n,) = _LENGTH.unpack(header)
        worker_id, metadata, rows = msgpack.unpackb(requests.read(n))
        reply = msgpack.packb(problem(agent, worker_id, metadata, rows))
        replies.write(_LENGTH.pack(len(reply)) + reply)
        replies.flush()


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "wb")  # the protocol keeps the real stdout;
    os.dup2(2, 1)  # NIXL's own log lines (it logs to stdout) go to stderr with everything else
    serve(sys.stdin.buffer, replies)
