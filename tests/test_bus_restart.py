"""The bus across a nats-server killed -9 and restarted on its port (issue 25): a stream in flight
ends with `unavailable` instead of a reply with a gap; a reply sent before the requester has
subscribed again is sent again; a request answered "no responders" right after its reconnect is
sent again once the service has subscribed again."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import CancelReply, CancelRequest, GenerateRequest
from baton.shared.bus import Bus
from baton.shared.bus.server import NatsServer
from e2e_cluster import done_within, until
from nats_proxy import SwallowingProxy
from test_bus_stream import chunk, last_chunk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SUBJECT = "test.restart"


async def restarted(server: NatsServer, *buses: Bus) -> None:
    """Kill the server, start it again on its port, and wait until every bus is connected again."""
    os.kill(server.pid, signal.SIGKILL)
    await asyncio.to_thread(server.restart)
    await until(lambda: all(bus.connection.is_connected for bus in buses), 30, "every bus connected again",
                every_s=0.05)


def test_a_stream_in_flight_across_a_restart_ends_unavailable_on_both_sides():
    async def scenario():
        with NatsServer() as server:
            async with await Bus.connect(server.url, "client") as client, \
                    await Bus.connect(server.url, "service") as service:
                more, ended = asyncio.Event(), asyncio.Event()

                async def endless(request):
                    try:
                        for i in range(10_000):
                            yield chunk(i)
                            await more.wait()
                            more.clear()
                    finally:
                        ended.set()
                await service.serve(SUBJECT, GenerateRequest, endless)
                stream = client.stream_request(SUBJECT, GenerateRequest(prompt="x"), type(chunk(0)), 30)
                assert await stream.__anext__() == chunk(0)
                await restarted(server, client, service)
                with pytest.raises(BatonError) as raised:
                    await stream.__anext__()
                assert raised.value.code is ErrorCode.UNAVAILABLE and "connection was lost" in raised.value.message
                more.set()  # the service's next chunk finds its connection re-made: it ends the stream
                await asyncio.wait_for(ended.wait(), 10)
    asyncio.run(scenario())


def test_an_answer_sent_before_the_requester_is_back_reaches_it():
    """The service reconnects fast and answers at once; the client comes back 2 s later. Without
    sending again on "no responders", nats-server drops the answer and the client times out."""
    async def scenario():
        with NatsServer() as server:
            async with await Bus.connect(server.url, "client", reconnect_wait_s=2.0) as client, \
                    await Bus.connect(server.url, "service", reconnect_wait_s=0.05) as service:
                reached, go = asyncio.Event(), asyncio.Event()

                async def answer_when_told(request: CancelRequest) -> CancelReply:
                    reached.set()
                    await go.wait()
                    return CancelReply(request_id=request.request_id, cancelled=True)
                await service.serve(SUBJECT, CancelRequest, answer_when_told)
                asked = asyncio.create_task(client.request(SUBJECT, CancelRequest(request_id="r1"), CancelReply, 30))
                await done_within(reached.wait(), 10, "the request reaching the service")
                os.kill(server.pid, signal.SIGKILL)
                await asyncio.to_thread(server.restart)
                await until(lambda: service.connection.is_connected, 30, "the service connected again", every_s=0.01)
                assert not client.connection.is_connected  # still waiting to reconnect
                go.set()
                assert (await asked).cancelled
    asyncio.run(scenario())


def test_a_request_sent_while_the_server_is_down_is_served_once_the_service_is_back():
    async def scenario():
        with NatsServer() as server:
            async with await Bus.connect(server.url, "client", reconnect_wait_s=0.05) as client, \
                    await Bus.connect(server.url, "service", reconnect_wait_s=1.0) as service:
                async def answer(request: CancelRequest) -> CancelReply:
                    return CancelReply(request_id=request.request_id, cancelled=False)
                await service.serve(SUBJECT, CancelRequest, answer)
                os.kill(server.pid, signal.SIGKILL)
                await until(lambda: not client.connection.is_connected, 10, "the client seeing the server gone",
                            every_s=0.01)
                asked = asyncio.create_task(client.request(SUBJECT, CancelRequest(request_id="r2"), CancelReply, 30))
                await asyncio.to_thread(server.restart)  # the client is back first, the service up to 1 s later
                assert (await asked).request_id == "r2"
    asyncio.run(scenario())


def test_an_answer_lost_with_its_connection_is_sent_again_on_the_next_one():
    """The answer went into a socket that then died (issue 29's 15 s cut: the router replied on its
    connection to the cut-off server a second before nats-py gave up on it, and 2 unary clients
    waited 180 s for nothing). Now a unary answer waits for the server's PONG after it and, if the
    connection is lost first, goes again on the next one."""
    async def scenario():
        with NatsServer() as server:
            proxy = SwallowingProxy(server.url)
            async with proxy as service_url, await Bus.connect(server.url, "client") as client, \
                    await Bus.connect(service_url, "service", reconnect_wait_s=0.05) as service:
                async def answer(request: CancelRequest) -> CancelReply:
                    proxy.swallow = True  # the answer is the next thing the service sends
                    return CancelReply(request_id=request.request_id, cancelled=True)
                await service.serve(SUBJECT, CancelRequest, answer)
                reply = await client.request(SUBJECT, CancelRequest(request_id="r3"), CancelReply, 15)
                assert proxy.swallowed.is_set() and reply == CancelReply(request_id="r3", cancelled=True)
                assert service.connection.stats["reconnects"] >= 1
    asyncio.run(scenario())


def test_a_stream_whose_last_chunk_is_lost_with_its_connection_ends_unavailable():
    """The stream's last chunk went into a socket that then died. A client without Baton's
    liveness probe would wait for an end that never comes, and Baton's own was told "the router is
    gone", which it is not. Now the end of a stream waits for the server's PONG after it and, if
    the connection is lost first, the client is told on the next one that the end may be lost."""
    async def scenario():
        with NatsServer() as server:
            proxy = SwallowingProxy(server.url)
            async with proxy as service_url, await Bus.connect(server.url, "client") as client, \
                    await Bus.connect(service_url, "service", reconnect_wait_s=0.05) as service:
                first_arrived = asyncio.Event()

                async def two_chunks(request):
                    yield chunk(0)
                    await asyncio.wait_for(first_arrived.wait(), 10)
                    proxy.swallow = True  # the last chunk is the next thing the service sends
                    yield last_chunk()
                await service.serve(SUBJECT, GenerateRequest, two_chunks)
                got = []
                with pytest.raises(BatonError) as raised:
                    async with client.stream_request(SUBJECT, GenerateRequest(prompt="x"), type(chunk(0)),
                                                     30) as chunks:
                        async for item in chunks:
                            got.append(item)
                            first_arrived.set()
                assert proxy.swallowed.is_set() and got == [chunk(0)]
                assert raised.value.code is ErrorCode.UNAVAILABLE and "last chunks" in raised.value.message
    asyncio.run(scenario())
