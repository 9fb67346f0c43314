"""TCP proxies between a bus and nats-server that lose what a network partition loses (tests only).

    async with SwallowingProxy(server.url) as url:   # connect the bus under test to `url`
"""
from __future__ import annotations

import asyncio


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


class Proxy:
    """Copies bytes both ways between its clients and the server at `server_url`; a subclass
    decides what one direction loses (`upstream`: from the bus, `downstream`: to it)."""

    def __init__(self, server_url: str):
        self.upstream_port = int(server_url.rsplit(":", 1)[1])
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self._server.close()

    async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await copy(reader, writer)

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await copy(reader, writer)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pipes = [asyncio.create_task(self.upstream(reader, up_writer)),
                 asyncio.create_task(self.downstream(up_reader, writer))]
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)  # one side closed: close both
        for pipe in pipes:
            pipe.cancel()
        writer.transport.abort()
        up_writer.transport.abort()


class SwallowingProxy(Proxy):
    """Can lose what the bus sends next and then drop the connection: what a socket's unsent
    bytes suffer when nats-py gives up on a partitioned server."""

    def __init__(self, server_url: str):
        super().__init__(server_url)
        self.swallow = False  # lose the next bytes from the bus, then close that connection
        self.swallowed = asyncio.Event()

    async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if self.swallow:
                self.swallow = False
                self.swallowed.set()
                return
            writer.write(data)
            await writer.drain()


class CuttingProxy(Proxy):
    """Can cut every connection through it and refuse new ones until restored: what the clients
    of one nats-server see when that server dies, while the rest of the cluster lives on."""

    def __init__(self, server_url: str):
        super().__init__(server_url)
        self.up = True
        self._clients: set[asyncio.StreamWriter] = set()

    def cut(self) -> None:
        self.up = False
        for writer in self._clients:
            writer.transport.abort()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        self._clients.add(writer)
        try:
            await super()._connection(reader, writer)
        finally:
            self._clients.discard(writer)


class FrameDroppingProxy(Proxy):
    """Parses the NATS protocol both ways and drops whole messages, the connection intact: the
    first `drop_up` client messages (PUB/HPUB) whose subject is `up_subject`, and the first
    `drop_down` server messages (MSG/HMSG) whose subject ends with `down_suffix`. What a
    partition does to one message while the connection lives on."""

    def __init__(self, server_url: str, *, up_subject: str = "", drop_up: int = 0,
                 down_suffix: str = "", drop_down: int = 0):
        super().__init__(server_url)
        self.up_subject, self.drop_up = up_subject, drop_up
        self.down_suffix, self.drop_down = down_suffix, drop_down
        self.dropped: list[str] = []

    async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._frames(reader, writer)

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._frames(reader, writer)

    def _drop(self, verb: bytes, subject: str) -> bool:
        if verb in (b"PUB", b"HPUB") and self.drop_up and subject == self.up_subject:
            self.drop_up -= 1
        elif verb in (b"MSG", b"HMSG") and self.drop_down and subject.endswith(self.down_suffix):
            self.drop_down -= 1
        else:
            return False
        self.dropped.append(f"{verb.decode()} {subject}")
        return True

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            verb, *args = line.split()
            frame = line
            if verb in (b"PUB", b"HPUB", b"MSG", b"HMSG"):
                frame += await reader.readexactly(int(args[-1]) + 2)  # payload (headers included) + CRLF
                if self._drop(verb, args[0].decode()):
                    continue
            writer.write(frame)
            await writer.drain()
