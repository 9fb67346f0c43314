"""Receipts (proto/README.md, "Receipts"): a request to an acknowledged subject (baton.v1.generate)
lost on its way is sent again and handled once; a resend of one already taken is acknowledged
again and not handled again; when two servers take it, the client keeps to one server's replies;
a server that dies before it answers is noticed through the receipt's probe, not at the timeout;
an answer lost with the client's own server is asked for again once the client is back."""
from __future__ import annotations

import asyncio

import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import GenerateReply, GenerateRequest, SpecStats, StreamChunk, Timing, Usage
from baton.shared.bus import Bus
from baton.shared.bus import endpoint as endpoint_module
from baton.shared.bus.endpoint import SentAnswers
from baton.shared.bus.senders import acting_for, request_sender
from baton.shared.bus.server import NatsServer
from e2e_cluster import done_within, until
from nats_proxy import CuttingProxy, FrameDroppingProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
REQUEST = GenerateRequest(token_ids=[1, 2], max_tokens=2)


def reply(ids: list[int]) -> GenerateReply:
    return GenerateReply(request_id="r", token_ids=ids, text="", finish_reason="length",
                         usage=Usage(prompt_tokens=2, completion_tokens=len(ids)), spec=SpecStats(),
                         timing=Timing(ttft_ms=1.0, total_ms=1.0))


def chunks(ids: list[int]) -> list[StreamChunk]:
    *body, last = [StreamChunk(request_id="r", token_ids=[i], text="") for i in ids]
    return body + [StreamChunk(request_id="r", token_ids=last.token_ids, text="", finished=True,
                               finish_reason="length", usage=Usage(prompt_tokens=2, completion_tokens=len(ids)),
                               spec=SpecStats(), timing=Timing(ttft_ms=1.0, total_ms=1.0))]


async def streamed(client: Bus) -> list[int]:
    ids = []
    async with client.stream_request(subjects.GENERATE, REQUEST, StreamChunk, 30) as got:
        async for chunk in got:
            ids += chunk.token_ids
    return ids


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_request_lost_on_its_way_is_sent_again_and_handled_once(stream):
    """The first copy never reaches the server (dropped between client and server, the client's
    connection intact): no receipt comes, the client sends it again, and it is served once."""
    async def scenario():
        with NatsServer() as server:
            proxy = FrameDroppingProxy(server.url, up_subject=subjects.GENERATE, drop_up=1)
            async with proxy as client_url, await Bus.connect(client_url, "client") as client, \
                    await Bus.connect(server.url, "router") as router:
                handled = []

                async def unary(request):
                    handled.append(request)
                    return reply([7, 8])

                async def streaming(request):
                    handled.append(request)
                    for chunk in chunks([7, 8]):
                        yield chunk
                await router.serve(subjects.GENERATE, GenerateRequest, streaming if stream else unary)
                if stream:
                    got = await streamed(client)
                else:
                    got = (await client.request(subjects.GENERATE, REQUEST, GenerateReply, 30)).token_ids
                assert proxy.dropped == [f"HPUB {subjects.GENERATE}"]
                assert got == [7, 8] and len(handled) == 1
    asyncio.run(scenario())


def test_a_resend_of_a_request_already_taken_is_acknowledged_again_and_not_handled_again():
    """The receipt is lost on its way back, so the client sends the request again while the
    server is still working on it: the server acknowledges the resend and handles it once."""
    async def scenario():
        with NatsServer() as server:
            proxy = FrameDroppingProxy(server.url, down_suffix=subjects.RECEIPT_SUFFIX, drop_down=1)
            async with proxy as client_url, await Bus.connect(client_url, "client") as client, \
                    await Bus.connect(server.url, "router") as router:
                handled, resent = [], asyncio.Event()
                seen = []

                async def slow(request):
                    handled.append(request)
                    await asyncio.wait_for(resent.wait(), 20)  # answers only once the resend came
                    return reply([5])
                endpoint = await router.serve(subjects.GENERATE, GenerateRequest, slow)
                original = endpoint._acknowledge_receipt

                async def counting(msg):
                    seen.append(msg.reply)
                    if len(seen) == 2:
                        resent.set()
                    return await original(msg)
                endpoint._acknowledge_receipt = counting
                got = await client.request(subjects.GENERATE, REQUEST, GenerateReply, 30)
                assert proxy.dropped and proxy.dropped[0].endswith(subjects.RECEIPT_SUFFIX)
                assert got.token_ids == [5] and len(handled) == 1
                assert len(seen) == 2 and seen[0] == seen[1]  # the same reply subject, sent twice
    asyncio.run(scenario())


def test_when_two_servers_take_a_request_the_client_keeps_to_the_replies_of_one():
    """Two routers outside a queue group both take the request: the client's stream is one
    router's chunks, never a mix of both."""
    async def scenario():
        with NatsServer() as server:
            async with await Bus.connect(server.url, "client") as client, \
                    await Bus.connect(server.url, "router-a") as a, await Bus.connect(server.url, "router-b") as b:
                for bus, ids in ((a, [1, 2, 3]), (b, [7, 8, 9])):
                    async def streaming(request, ids=ids):
                        for chunk in chunks(ids):
                            yield chunk
                            await asyncio.sleep(0.05)  # deliberate pacing: both routers' chunks interleave on the wire
                    await bus.serve(subjects.GENERATE, GenerateRequest, streaming)
                for _ in range(3):
                    assert await streamed(client) in ([1, 2, 3], [7, 8, 9])
    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_router_gone_before_its_first_reply_is_noticed_through_the_receipt(stream):
    """The router took the request and went away before it answered: the client pings the
    receipt's probe and gets `unavailable` within seconds, not at its own 60 s timeout (before,
    neither a unary request nor a stream without a first chunk had anything to ping)."""
    async def scenario():
        with NatsServer() as server:
            async with await Bus.connect(server.url, "client") as client:
                router = await Bus.connect(server.url, "router")
                taken = asyncio.Event()

                async def never(request):
                    taken.set()
                    await asyncio.sleep(3600)  # a router that never answers: the thing tested
                    yield chunks([1])[0]
                await router.serve(subjects.GENERATE, GenerateRequest, never)
                call = asyncio.create_task(streamed(client) if stream else client.request(
                    subjects.GENERATE, REQUEST, GenerateReply, 60))
                await asyncio.wait_for(taken.wait(), 10)
                await router.connection.close()  # gone, without a word to the client
                with pytest.raises(BatonError) as raised:
                    await asyncio.wait_for(call, 20)
                assert raised.value.code is ErrorCode.UNAVAILABLE and "gone" in raised.value.message
    asyncio.run(scenario())


def test_an_answer_lost_with_the_clients_own_server_is_sent_again_when_the_client_asks():
    """The client's nats-server went away while the answer passed through it (a NATS node killed
    under load, tests/test_multihost.py): the router's connection never broke, so nothing told it,
    and the client waited out its timeout. Now the client, connected again, asks the receipt's
    probe for the answer, and the router sends it again."""
    async def scenario():
        with NatsServer() as server:
            proxy = CuttingProxy(server.url)
            async with proxy as client_url, await Bus.connect(client_url, "client", reconnect_wait_s=0.05) as client, \
                    await Bus.connect(server.url, "router") as router:
                reached, go = asyncio.Event(), asyncio.Event()

                async def answer_when_told(request):
                    reached.set()
                    await go.wait()
                    return reply([7, 8])
                endpoint = await router.serve(subjects.GENERATE, GenerateRequest, answer_when_told)
                asked = asyncio.create_task(client.request(subjects.GENERATE, REQUEST, GenerateReply, 60))
                await done_within(reached.wait(), 10, "the request reaching the router")
                proxy.cut()
                await until(lambda: not client.connection.is_connected, 10, "the client seeing its server gone",
                            every_s=0.01)
                go.set()
                await until(lambda: endpoint.stats.requests == 1, 10, "the answer sent with the client away",
                            every_s=0.01)
                proxy.up = True
                got = await done_within(asked, 20, "the answer, asked for again")
                assert got == reply([7, 8]) and endpoint.stats.requests == 1
    asyncio.run(scenario())


def test_answers_kept_to_send_again_are_bounded_by_age_and_bytes(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(endpoint_module.time, "monotonic", lambda: now[0])
    kept = SentAnswers(keep_s=60.0, max_bytes=10)
    kept.add("a", b"1234")
    kept.add("b", b"5678")
    kept.add("a", b"abcd")  # sent again: one copy, counted once
    assert (kept.get("a"), kept.get("b")) == (b"abcd", b"5678")
    kept.add("c", b"90ab")  # 12 bytes: the oldest goes
    assert (kept.get("b"), kept.get("a"), kept.get("c")) == (None, b"abcd", b"90ab")
    now[0] += 61.0
    assert kept.get("c") is None and kept.get("a") is None


def test_a_handler_knows_which_client_sent_the_request(nats_server):
    """Each connection names itself on baton.v1.generate (subjects.CLIENT_HEADER); a frontend
    names its own client instead (`acting_for`); the handler reads it (`request_sender`), as the
    router's fair tokenization does."""
    async def scenario():
        async with await Bus.connect(nats_server, "router") as router, \
                await Bus.connect(nats_server, "one") as one, await Bus.connect(nats_server, "two") as two:
            senders = []

            async def unary(request):
                senders.append(request_sender.get())
                return reply([7])

            async def on_behalf(name: str) -> None:
                acting_for.set(name)
                await one.request(subjects.GENERATE, REQUEST, GenerateReply, timeout=10)

            await router.serve(subjects.GENERATE, GenerateRequest, unary)
            await one.request(subjects.GENERATE, REQUEST, GenerateReply, timeout=10)
            await two.request(subjects.GENERATE, REQUEST, GenerateReply, timeout=10)
            await asyncio.create_task(on_behalf("http 10.0.0.7"))
            await one.request(subjects.GENERATE, REQUEST, GenerateReply, timeout=10)  # acting_for was that task's
            assert senders == [one.client_id, two.client_id, "http 10.0.0.7", one.client_id]
            assert one.client_id != two.client_id
    asyncio.run(asyncio.wait_for(scenario(), 30))
