"""Who may talk to whom on the server `baton up` embeds: it generates a service user and a client
user; an unauthenticated client is refused; the client user may use the public API and its own
reply inboxes only — it can neither publish to internal subjects nor read other inboxes."""
import asyncio

import nats.errors
import pytest

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from e2e_cluster import Reference, running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(auth=True) as c:
        yield c


def test_unauthenticated_client_is_refused(cluster):
    async def run():
        with pytest.raises(BatonError) as info:
            await Bus.connect(cluster.nats_url, "anonymous", connect_timeout_s=2)
        return info.value
    assert asyncio.run(run()).code.value == "unavailable"


def test_client_credentials_serve_the_public_api(cluster):
    async def run():
        async with await Bus.connect(cluster.nats_url, "client", **cluster.client.connect_options()) as bus:
            return await bus.request(subjects.GENERATE, GenerateRequest(token_ids=[5, 9, 300], max_tokens=6),
                                     GenerateReply, timeout=60)
    reply = asyncio.run(run())
    assert reply.token_ids == Reference().greedy([5, 9, 300], 6)[:len(reply.token_ids)]


async def received(sub, timeout: float = 0.5) -> bool:
    try:
        await sub.next_msg(timeout=timeout)
        return True
    except Exception:  # nats TimeoutError: nothing arrived
        return False


def test_client_cannot_publish_internal_or_read_other_inboxes(cluster):
    async def run():
        service = await Bus.connect(cluster.nats_url, "service", **cluster.service.connect_options())
        client = await Bus.connect(cluster.nats_url, "client", **cluster.client.connect_options())
        try:
            sc, cc = service.connection, client.connection
            # the client publishes to an internal subject: the service never sees it
            internal = await sc.subscribe(f"{subjects.INTERNAL}.probe")
            await sc.flush()
            await cc.publish(f"{subjects.INTERNAL}.probe", b"forged")
            await cc.flush()
            forged = await received(internal)
            # the client subscribes to other inboxes and to its own; the service replies to each
            spies = [await cc.subscribe(s) for s in ("_INBOX.>", "_INBOX_bob.>", f"{subjects.INTERNAL}.>")]
            own = await cc.subscribe(f"{cluster.client.inbox_prefix}.probe")
            await cc.flush()
            await cc.flush()
            for subject in ("_INBOX.other.1", "_INBOX_bob.reply", f"{subjects.INTERNAL}.registry.heartbeat"):
                await sc.publish(subject, b"secret")
            await sc.publish(f"{cluster.client.inbox_prefix}.probe", b"yours")
            await sc.flush()
            leaked = [await received(s) for s in spies]
            return forged, leaked, await received(own, 2.0)
        finally:
            await client.close()
            await service.close()
    forged, leaked, own = asyncio.run(run())
    assert own, "the client must receive on its own inbox (control)"
    assert not forged, "a client published to an internal subject"
    assert leaked == [False, False, False], "a client read another inbox or internal traffic"


def test_client_may_ping_the_probe_of_a_chunk_it_received_and_learns_the_sender_is_gone(cluster):
    """allow_responses: the client may publish to the reply subject of a message it received (a
    chunk's probe), so its stream learns that the sender died; any other inbox stays closed to it
    (a ping there is dropped by the server: a timeout, not "no responders")."""
    async def run():
        service = await Bus.connect(cluster.nats_url, "service", **cluster.service.connect_options())
        client = await Bus.connect(cluster.nats_url, "client", **cluster.client.connect_options())
        hang = asyncio.Event()

        async def one_chunk_then_hang(request):
            yield StreamChunk(request_id="r1", token_ids=[1], text="a")
            await asyncio.wait_for(hang.wait(), 10)

        try:
            await service.serve(f"{subjects.PUBLIC}.test.stream", GenerateRequest, one_chunk_then_hang)
            stream = client.stream_request(f"{subjects.PUBLIC}.test.stream", GenerateRequest(prompt="x"),
                                           StreamChunk, timeout_per_message=30)
            assert (await stream.__anext__()).token_ids == [1]
            with pytest.raises(nats.errors.TimeoutError):
                await client.connection.request("_INBOX.not-a-reply-to-you", b"", timeout=1)
            await service.connection.close()
            with pytest.raises(BatonError) as raised:
                await asyncio.wait_for(stream.__anext__(), 6)
            assert raised.value.code is ErrorCode.UNAVAILABLE
        finally:
            hang.set()
            await client.close()
            await service.close()
    asyncio.run(run())
