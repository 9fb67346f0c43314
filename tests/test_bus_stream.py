"""Streaming replies and the router's token inbox against a real nats-server, and shutdown with requests in flight."""
from __future__ import annotations

import asyncio

import pytest

from baton.proto.errors import BatonError, ErrorCode
from baton.proto.internal import Ack, ReleaseRequest, TokenChunk
from baton.proto.public import CancelReply, CancelRequest, GenerateRequest, SpecStats, StreamChunk, Timing, Usage
from baton.services.router.tokens import TokenInbox
from baton.shared.bus import Bus
from e2e_cluster import done_within

pytestmark = pytest.mark.integration

SUBJECT = "test.stream.generate"


def run(scenario, url):
    asyncio.run(asyncio.wait_for(scenario(url), 10))


def chunk(i: int) -> StreamChunk:
    return StreamChunk(request_id="r1", token_ids=[i], text=f"<{i}>")


def last_chunk() -> StreamChunk:
    return StreamChunk(request_id="r1", token_ids=[], text="", finished=True, finish_reason="length",
                       usage=Usage(prompt_tokens=1, completion_tokens=3), spec=SpecStats(),
                       timing=Timing(ttft_ms=1.0, total_ms=2.0))


async def three_tokens(request: GenerateRequest):
    for i in range(3):
        yield chunk(i)
    yield last_chunk()


def test_streaming_replies_arrive_in_order_and_end_at_finished(nats_server):
    async def scenario(url):
        async with await Bus.connect(url, "test") as bus:
            await bus.serve(SUBJECT, GenerateRequest, three_tokens)
            received = [c async for c in bus.stream_request(SUBJECT, GenerateRequest(prompt="x", stream=True),
                                                            StreamChunk, timeout_per_message=2)]
            assert received == [chunk(0), chunk(1), chunk(2), last_chunk()]
            assert bus._streams == set()  # the inbox subscription is gone
    run(scenario, nats_server)


def test_error_mid_stream_ends_it_with_the_error(nats_server):
    async def scenario(url):
        async with await Bus.connect(url, "test") as bus:
            async def fails_after_one(request):
                yield chunk(0)
                raise BatonError(ErrorCode.INTERNAL, "decode worker lost")

            await bus.serve(SUBJECT, GenerateRequest, fails_after_one)
            received = []
            with pytest.raises(BatonError) as raised:
                async with bus.stream_request(SUBJECT, GenerateRequest(prompt="x"), StreamChunk, 2) as stream:
                    async for item in stream:
                        received.append(item)
            assert received == [chunk(0)] and raised.value.message == "decode worker lost"
    run(scenario, nats_server)


def test_stream_errors_map_like_requests(nats_server):
    async def scenario(url):
        async with await Bus.connect(url, "test") as bus:
            with pytest.raises(BatonError) as raised:
                async for _ in bus.stream_request("test.stream.nobody", GenerateRequest(prompt="x"), StreamChunk, 2):
                    pass
            assert raised.value.code is ErrorCode.UNAVAILABLE

            async def stalls(request):
                yield chunk(0)
                await asyncio.sleep(5)  # the stall itself, past the 0.2 s per-message timeout

            await bus.serve(SUBJECT, GenerateRequest, stalls)
            stream = bus.stream_request(SUBJECT, GenerateRequest(prompt="x"), StreamChunk, timeout_per_message=0.2)
            assert await stream.__anext__() == chunk(0)
            with pytest.raises(BatonError) as raised:
                await stream.__anext__()
            assert raised.value.code is ErrorCode.TIMEOUT

            with pytest.raises(BatonError) as raised:
                bus.stream_request(SUBJECT, GenerateRequest(prompt="x" * (2 << 20)), StreamChunk)
            assert raised.value.code is ErrorCode.TOO_LARGE
            await bus.close(grace_s=0.1)
    run(scenario, nats_server)


def test_a_silent_stream_pings_its_sender_and_fails_fast_once_the_sender_is_gone(nats_server):
    """Silent past the liveness interval: a live sender's probe ignores the ping and the stream
    goes on; once the sender's connection is gone the ping gets "no responders" and the stream
    raises unavailable within seconds, long before its 30 s timeout."""
    async def scenario(url):
        async with await Bus.connect(url, "client") as client:
            server = await Bus.connect(url, "router")
            resume, hang = asyncio.Event(), asyncio.Event()

            async def pauses_then_hangs(request):
                yield chunk(0)
                await resume.wait()
                yield chunk(1)
                await asyncio.wait_for(hang.wait(), 10)

            await server.serve(SUBJECT, GenerateRequest, pauses_then_hangs)
            stream = client.stream_request(SUBJECT, GenerateRequest(prompt="x"), StreamChunk, timeout_per_message=30)
            assert await stream.__anext__() == chunk(0)
            asyncio.get_running_loop().call_later(3, resume.set)  # silent past two liveness intervals
            assert await stream.__anext__() == chunk(1)
            await server.connection.close()  # the router dies: no endpoint cleanup, no reply
            with pytest.raises(BatonError) as raised:  # within seconds: not at the 30 s timeout
                await done_within(stream.__anext__(), 5, "the stream failing once its sender is gone")
            assert raised.value.code is ErrorCode.UNAVAILABLE and "gone" in raised.value.message
            hang.set()
            await server.close()
    run(scenario, nats_server)


def test_router_token_inbox_routes_chunks_published_by_another_service(nats_server):
    """One wildcard subscription per router; each open subject's chunks reach its own queue in
    order, an error reply arrives as ("error", ...), and a closed subject's chunks are dropped."""
    async def scenario(url):
        async with await Bus.connect(url, "router") as router, await Bus.connect(url, "decode") as decode:
            inbox = TokenInbox(router)
            await inbox.start()
            first, second = asyncio.Queue(), asyncio.Queue()
            a, b = inbox.open(first), inbox.open(second)
            for seq, ids in enumerate([[5, 6], [7]]):
                await decode.publish(a, TokenChunk(request_id="r1", seq=seq, token_ids=ids))
            await decode.publish(b, BatonError(ErrorCode.INTERNAL, "transfer failed").to_reply())
            await decode.publish(a, TokenChunk(
                request_id="r1", seq=2, token_ids=[8], finished=True, finish_reason="stop",
                spec=SpecStats(verify_steps=1, drafted=3, accepted=2), timing=Timing(ttft_ms=1, total_ms=3)))
            received = [await asyncio.wait_for(first.get(), 2) for _ in range(3)]
            assert [kind for kind, _ in received] == ["chunk"] * 3
            assert [c.seq for _, c in received] == [0, 1, 2] and received[-1][1].finished
            kind, error = await asyncio.wait_for(second.get(), 2)
            assert kind == "error" and error.code is ErrorCode.INTERNAL
            inbox.close(a)
            await decode.publish(a, TokenChunk(request_id="r1", seq=3, token_ids=[9]))
            await decode.publish(b, TokenChunk(request_id="r2", seq=0, token_ids=[1]))
            assert (await asyncio.wait_for(second.get(), 2))[1].token_ids == [1]  # b still open, a not
            assert first.empty()
    run(scenario, nats_server)


def test_closing_a_bus_answers_requests_in_flight_with_unavailable(nats_server):
    async def scenario(url):
        async with await Bus.connect(url, "client") as client:
            service = await Bus.connect(url, "service")
            started = asyncio.Event()

            async def hangs(request):
                started.set()
                await asyncio.Event().wait()

            async def stream_hangs(request):
                yield chunk(0)
                await asyncio.Event().wait()

            await service.serve("test.stream.hangs", CancelRequest, hangs)
            await service.serve(SUBJECT, GenerateRequest, stream_hangs)
            call = asyncio.create_task(client.request("test.stream.hangs", CancelRequest(request_id="r"),
                                                      CancelReply, timeout=5))
            stream = client.stream_request(SUBJECT, GenerateRequest(prompt="x"), StreamChunk, 5)
            assert await stream.__anext__() == chunk(0)
            await started.wait()
            await service.close(grace_s=0.1)
            for pending in (call, stream.__anext__()):
                with pytest.raises(BatonError) as raised:
                    await pending
                assert raised.value.code is ErrorCode.UNAVAILABLE and "shutting down" in raised.value.message
    run(scenario, nats_server)


def test_graceful_close_lets_handlers_finish(nats_server):
    async def scenario(url):
        async with await Bus.connect(url, "client") as client:
            service = await Bus.connect(url, "service")

            started = asyncio.Event()

            async def slowish(request):
                started.set()
                await asyncio.sleep(0.2)  # a handler still busy when the close begins (the thing tested)
                return Ack()

            await service.serve("test.stream.slowish", ReleaseRequest, slowish)
            call = asyncio.create_task(client.request("test.stream.slowish", ReleaseRequest(request_id="r"), Ack, 5))
            await done_within(started.wait(), 5, "the handler taking the request")
            await service.close(grace_s=2)
            assert await call == Ack()
    run(scenario, nats_server)
