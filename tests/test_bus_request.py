"""Bus request/reply against a real nats-server: replies, error mapping, bad input, stats, deadlines across a pause."""
from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import nats
import pytest

from baton.proto.codec import decode_reply, encode
from baton.proto.errors import BatonError, ErrorCode, ErrorReply
from baton.proto.internal import PlanReply, PlanRequest
from baton.proto.public import CancelReply, CancelRequest, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from e2e_cluster import done_within, until

pytestmark = pytest.mark.integration

SUBJECT = "test.bus.cancel"


async def echo(request: CancelRequest) -> CancelReply:
    return CancelReply(request_id=request.request_id, cancelled=True)


def run(scenario, url):
    asyncio.run(asyncio.wait_for(scenario(url), 10))


async def connected(url: str) -> Bus:
    return await Bus.connect(url, "test")


def test_request_reply(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            endpoint = await bus.serve(SUBJECT, CancelRequest, echo)
            reply = await bus.request(SUBJECT, CancelRequest(request_id="r1"), CancelReply, timeout=2)
            assert reply == CancelReply(request_id="r1", cancelled=True)
            assert endpoint.stats.requests == 1 and endpoint.stats.errors == {}
            assert endpoint.stats.latency_max_s > 0
    run(scenario, nats_server)


def test_a_request_is_written_to_the_socket_by_the_request_itself(nats_server):
    """A lone request does not wait for nats-py's flusher task: `request` writes it to the socket
    a turn after its task queued it (the router's dispatch is on every first token's path). A
    nats-py whose internals differ leaves it to the flusher: this fails then."""
    async def scenario(url):
        async with await connected(url) as bus:
            await bus.serve(SUBJECT, CancelRequest, echo)
            wrote, write_pending = [], bus.write_pending
            bus.write_pending = lambda: wrote.append(write_pending()) or wrote[-1]
            reply = await bus.request(SUBJECT, CancelRequest(request_id="r1"), CancelReply, timeout=2)
            assert reply == CancelReply(request_id="r1", cancelled=True)
            assert wrote == [True]
    run(scenario, nats_server)


def test_a_request_cancelled_before_it_is_written_leaves_no_task_waiting_for_its_reply(nats_server):
    """Cancelled in the turn between queueing and writing, the request's nats-py task (which has
    no timer of its own) is cancelled too, not left waiting for a reply that never comes."""
    async def scenario(url):
        never = asyncio.Event()

        async def silent(request: CancelRequest) -> CancelReply:
            await never.wait()
        async with await connected(url) as bus:
            await bus.serve(SUBJECT, CancelRequest, silent)
            await bus.serve(SUBJECT + ".echo", CancelRequest, echo)  # nats-py's reply subscription (its task) made first
            await bus.request(SUBJECT + ".echo", CancelRequest(request_id="r0"), CancelReply, timeout=2)
            before = asyncio.all_tasks()
            asking = asyncio.create_task(bus.request(SUBJECT, CancelRequest(request_id="r1"), CancelReply, timeout=30))
            await asyncio.sleep(0)  # `asking` started its request task and waits a turn
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking
            left = lambda: {t for t in asyncio.all_tasks() - before if "serve" not in t.get_name()}
            await until(lambda: not left(), 5, "no task of the cancelled request left", every_s=0.01)
            never.set()  # the handler ends: the bus closes without waiting out its grace period
    run(scenario, nats_server)


def test_a_comma_separated_server_list_connects_to_one_that_answers(nats_server):
    """`--nats-url a,b,c` as `baton generate` passes it: servers tried in turn, not one bad URL."""
    async def scenario(url):
        async with await Bus.connect(f"nats://127.0.0.1:1, {url}", "test") as bus:
            await bus.serve(SUBJECT, CancelRequest, echo)
            assert (await bus.request(SUBJECT, CancelRequest(request_id="r"), CancelReply, timeout=2)).cancelled
    run(scenario, nats_server)


def test_a_responder_that_just_joined_is_waited_for_while_its_subscriptions_settle(nats_server):
    """In a NATS cluster a worker's subscriptions reach other servers a moment after it joined:
    "no responders" within SETTLE_S of `joined_at` sends the request again."""
    async def scenario(url):
        async with await connected(url) as client, await connected(url) as worker:
            no_responders = asyncio.Event()  # the client was answered "no responders" (and may send again)
            settling = client.settling

            def observed(joined_at: float = 0.0):
                check = settling(joined_at)

                def settling_now() -> bool:
                    no_responders.set()
                    return check()
                return settling_now
            client.settling = observed

            async def subscribe_late():  # only once the request found nobody there
                await done_within(no_responders.wait(), 2, 'the request answered "no responders"')
                await worker.serve(SUBJECT, CancelRequest, echo)
            late = asyncio.create_task(subscribe_late())
            reply = await client.request(SUBJECT, CancelRequest(request_id="r"), CancelReply, timeout=2,
                                         joined_at=time.monotonic())
            assert reply.cancelled and no_responders.is_set()
            await late
            with pytest.raises(BatonError) as gone:  # long joined: no responders is unavailable at once
                await client.request("test.bus.nobody", CancelRequest(request_id="r"), CancelReply, timeout=2,
                                     joined_at=time.monotonic() - 60)
            assert gone.value.code is ErrorCode.UNAVAILABLE
    run(scenario, nats_server)


def test_no_responders_is_unavailable(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            with pytest.raises(BatonError) as raised:
                await bus.request("test.bus.nobody", CancelRequest(request_id="r"), CancelReply, timeout=2)
            assert raised.value.code is ErrorCode.UNAVAILABLE and "test.bus.nobody" in raised.value.message
    run(scenario, nats_server)


def test_silence_is_timeout(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            # a handler that never answers in time: its silence (5 s) is the thing tested
            await bus.serve("test.bus.silent", CancelRequest, lambda request: asyncio.sleep(5))
            with pytest.raises(BatonError) as raised:
                await bus.request("test.bus.silent", CancelRequest(request_id="r"), CancelReply, timeout=0.2)
            assert raised.value.code is ErrorCode.TIMEOUT
            await bus.close(grace_s=0.1)  # cancels the sleeping handler
    run(scenario, nats_server)


PAUSED_TIMEOUT_S = 0.5  # the requests' deadline in the paused-process test


async def unary(client: Bus):
    return await client.request(SUBJECT, CancelRequest(request_id="p"), CancelReply, timeout=PAUSED_TIMEOUT_S)


async def first_chunk(client: Bus):
    async with client.stream_request(SUBJECT, GenerateRequest(prompt="x", stream=True), StreamChunk,
                                     PAUSED_TIMEOUT_S) as chunks:
        return await anext(chunks)


PAUSED_REPLIES = {unary: CancelReply(request_id="p", cancelled=True),
                  first_chunk: StreamChunk(request_id="p", token_ids=[1], text="a")}


@pytest.mark.parametrize("ask", [unary, first_chunk], ids=["request", "stream"])
def test_a_reply_that_arrived_while_the_process_was_paused_is_not_reported_as_a_timeout(nats_server, ask):
    """A deadline that passes while the process is stopped (SIGSTOP, a stalled VM) fires late, in
    the same loop turn as the socket read that carries the reply: the reply, already here, wins.
    The responder runs on its own thread and NATS connection; the requester's loop is blocked
    (its process "paused") from before the reply is sent until the reply is on the wire and the
    request's deadline has passed."""
    received, paused, replied, stop = (threading.Event() for _ in range(4))

    def respond(ready: threading.Event) -> None:
        async def serve():
            nc = await nats.connect(nats_server)

            async def on_request(msg) -> None:
                received.set()
                await asyncio.to_thread(paused.wait, 10)
                await msg.respond(encode(PAUSED_REPLIES[ask]))
                await nc.flush()
                replied.set()
            await nc.subscribe(SUBJECT, cb=on_request)
            await nc.flush()
            ready.set()
            await asyncio.to_thread(stop.wait, 20)
            await nc.close()
        asyncio.run(serve())

    ready = threading.Event()
    responder = threading.Thread(target=respond, args=(ready,), daemon=True)
    responder.start()
    assert ready.wait(10)

    async def scenario(url):
        async with await connected(url) as client:
            asked = asyncio.create_task(ask(client))
            assert await asyncio.to_thread(received.wait, 5)
            received_at = time.monotonic()  # the request was sent, so its deadline running, by now
            paused.set()  # from here this loop is blocked, as in a stopped process
            assert replied.wait(5)
            # the pause itself, the thing tested: it lasts until the request's deadline has passed
            # (PAUSED_TIMEOUT_S after it was sent, so before received_at + PAUSED_TIMEOUT_S), with a margin
            time.sleep(max(0.0, received_at + PAUSED_TIMEOUT_S + 0.3 - time.monotonic()))
            assert await asyncio.wait_for(asked, 5) == PAUSED_REPLIES[ask]
    try:
        run(scenario, nats_server)
    finally:
        stop.set()
        responder.join(10)


def test_oversize_request_is_too_large_before_publishing(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            endpoint = await bus.serve("test.bus.big", GenerateRequest, echo)
            huge = GenerateRequest(prompt="x" * (bus.connection.max_payload + 1))
            with pytest.raises(BatonError) as raised:
                await bus.request("test.bus.big", huge, CancelReply, timeout=2)
            assert raised.value.code is ErrorCode.TOO_LARGE and "max_payload" in raised.value.message
            with pytest.raises(BatonError):
                await bus.publish("test.bus.big", huge)
            assert endpoint.stats.requests == 0
    run(scenario, nats_server)


def test_oversize_reply_becomes_a_too_large_error_reply(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            async def huge_plan(request):
                return PlanReply(prefill_worker_id="p", decode_worker_id="d", plan={"blob": "x" * (2 << 20)})

            await bus.serve("test.bus.bigreply", PlanRequest, huge_plan)
            with pytest.raises(BatonError) as raised:
                await bus.request("test.bus.bigreply", PlanRequest(prefill_worker_id="p", decode_worker_id="d"),
                                  PlanReply, timeout=2)
            assert raised.value.code is ErrorCode.TOO_LARGE
    run(scenario, nats_server)


@pytest.mark.parametrize("exception, code", [
    (BatonError(ErrorCode.BUSY, "no decode capacity"), ErrorCode.BUSY),
    (RuntimeError("boom"), ErrorCode.INTERNAL),
])
def test_handler_errors_become_error_replies(nats_server, exception, code, caplog):
    async def scenario(url):
        async with await connected(url) as bus:
            async def failing(request):
                raise exception

            endpoint = await bus.serve("test.bus.failing", CancelRequest, failing)
            with pytest.raises(BatonError) as raised:
                await bus.request("test.bus.failing", CancelRequest(request_id="req-42"), CancelReply, timeout=2)
            assert raised.value.code is code
            assert endpoint.stats.errors == {code.value: 1}
    run(scenario, nats_server)
    if code is ErrorCode.INTERNAL:
        assert "req-42" in caplog.text and "boom" in caplog.text


def test_bad_bytes_get_bad_request_and_the_endpoint_keeps_serving(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            endpoint = await bus.serve(SUBJECT, CancelRequest, echo)
            nc = bus.connection
            for data in (b"\xc1garbage", msgpack.packb({"v": 9, "request_id": "r"}),
                         msgpack.packb({"v": 1, "request_id": 5}), msgpack.packb({"v": 1}), b""):
                reply = decode_reply((await nc.request(SUBJECT, data, timeout=2)).data, CancelReply)
                assert isinstance(reply, ErrorReply) and reply.error.code is ErrorCode.BAD_REQUEST
            await nc.publish(SUBJECT, b"\x00no reply subject")
            assert await bus.request(SUBJECT, CancelRequest(request_id="ok"), CancelReply, timeout=2)
            assert endpoint.stats.errors == {"bad_request": 6} and endpoint.stats.requests == 7
    run(scenario, nats_server)


def test_malformed_reply_is_internal(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            async def wrong_reply(msg):
                await msg.respond(msgpack.packb({"v": 1, "request_id": "r", "cancelled": "yes"}))

            await bus.connection.subscribe("test.bus.liar", cb=wrong_reply)
            with pytest.raises(BatonError) as raised:
                await bus.request("test.bus.liar", CancelRequest(request_id="r"), CancelReply, timeout=2)
            assert raised.value.code is ErrorCode.INTERNAL and "'cancelled'" in raised.value.message
    run(scenario, nats_server)


def test_beyond_max_in_flight_the_reply_is_busy(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            release = asyncio.Event()

            async def slow(request):
                await release.wait()
                return await echo(request)

            await bus.serve("test.bus.slow", CancelRequest, slow, max_in_flight=2)
            calls = [asyncio.create_task(bus.request("test.bus.slow", CancelRequest(request_id=f"r{i}"),
                                                     CancelReply, timeout=2)) for i in range(3)]
            done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            release.set()
            results = await asyncio.gather(*calls, return_exceptions=True)
            busy = [r for r in results if isinstance(r, BatonError)]
            assert len(busy) == 1 and busy[0].code is ErrorCode.BUSY and busy[0] is done.pop().exception()
            assert sum(isinstance(r, CancelReply) for r in results) == 2
    run(scenario, nats_server)


def test_connect_failure_is_unavailable():
    async def scenario():
        with pytest.raises(BatonError) as raised:
            await Bus.connect("nats://127.0.0.1:9", "test", connect_timeout_s=0.5)
        assert raised.value.code is ErrorCode.UNAVAILABLE and "127.0.0.1:9" in raised.value.message
    asyncio.run(scenario())


def test_publish_to_a_served_subject_without_reply(nats_server):
    async def scenario(url):
        async with await connected(url) as bus:
            seen = asyncio.Queue()
            await bus.serve("test.bus.events", CancelRequest, seen.put)
            await bus.publish("test.bus.events", CancelRequest(request_id="e1"))
            assert (await asyncio.wait_for(seen.get(), 2)).request_id == "e1"
    run(scenario, nats_server)


def test_serve_returns_only_once_the_server_routes_to_the_endpoint(nats_server):
    async def scenario(url):
        async with await connected(url) as client:
            for i in range(100):  # with a single flush in Bus.serve, ~1 in 12 of these failed
                async with await connected(url) as service:
                    await service.serve(f"test.bus.fresh.{i}", CancelRequest, echo)
                    await client.request(f"test.bus.fresh.{i}", CancelRequest(request_id="r"), CancelReply, 2)
    run(scenario, nats_server)


def test_let_out_returns_once_a_request_started_this_turn_is_written_to_the_socket(nats_server):
    """The router dispatches a prompt, then works on its reservation: `let_out` between the two
    puts the dispatch on the wire first (nats-py writes through a flusher task, turns later)."""
    async def scenario(url):
        async with await connected(url) as bus:
            await bus.serve(SUBJECT, CancelRequest, echo)
            transport = bus.connection._transport
            written: list[bytes] = []
            write = transport.writelines

            def recording(chunks):
                chunks = list(chunks)
                written.extend(chunks)
                return write(chunks)
            transport.writelines = recording
            try:
                reply = asyncio.create_task(bus.request(SUBJECT, CancelRequest(request_id="out-first"), CancelReply))
                await Bus.let_out()
                assert any(b"out-first" in chunk for chunk in written), written
                assert (await reply).cancelled
            finally:
                transport.writelines = write
    run(scenario, nats_server)
