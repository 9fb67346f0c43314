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
from test_bus_stream import chunk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SUBJECT = "test.restart"


async def restarted(server: NatsServer, *buses: Bus) -> None:
    """Kill the server, start it again on its port, and wait until every bus is connected again."""
    os.kill(server.pid, signal.SIGKILL)
    await asyncio.to_thread(server.restart)
    async with asyncio.timeout(30):
        while not all(bus.connection.is_connected for bus in buses):
            await asyncio.sleep(0.05)


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
                go = asyncio.Event()

                async def answer_when_told(request: CancelRequest) -> CancelReply:
                    await go.wait()
                    return CancelReply(request_id=request.request_id, cancelled=True)
                await service.serve(SUBJECT, CancelRequest, answer_when_told)
                asked = asyncio.create_task(client.request(SUBJECT, CancelRequest(request_id="r1"), CancelReply, 30))
                await asyncio.sleep(0.2)  # the request reached the service
                os.kill(server.pid, signal.SIGKILL)
                await asyncio.to_thread(server.restart)
                async with asyncio.timeout(30):
                    while not service.connection.is_connected:
                        await asyncio.sleep(0.01)
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
                async with asyncio.timeout(10):
                    while client.connection.is_connected:
                        await asyncio.sleep(0.01)
                asked = asyncio.create_task(client.request(SUBJECT, CancelRequest(request_id="r2"), CancelReply, 30))
                await asyncio.to_thread(server.restart)  # the client is back first, the service up to 1 s later
                assert (await asked).request_id == "r2"
    asyncio.run(scenario())
