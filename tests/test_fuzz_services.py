"""Hostile payloads against a running cluster: thousands of malformed messages to every public
subject. No service process dies, every message gets an error reply, and a good request afterwards
is served exactly."""
import asyncio
import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.proto import subjects
from baton.proto.public import GenerateReply, GenerateRequest
from baton.shared.bus import Bus
from e2e_cluster import Reference, running_cluster, wait_all_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
EXAMPLES = int(os.environ.get("BATON_FUZZ_EXAMPLES", "1000"))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64),
                    st.floats(allow_nan=True), st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=20)
FIELDS = ["v", "prompt", "token_ids", "max_tokens", "temperature", "top_p", "seed", "stream", "stop",
          "stop_token_ids", "request_id"]
# maps that look like requests (known field names, hostile values), arbitrary maps, raw bytes
payloads = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, min_size=1, max_size=6).map(
        lambda d: msgpack.packb(d, use_bin_type=True)),
    values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.binary(max_size=200),
)


class Target:
    bus: Bus = None
    loop: asyncio.AbstractEventLoop = None


def send(subject: str, payload: bytes) -> dict:
    async def go():
        msg = await Target.bus.connection.request(subject, payload, timeout=30)
        return msgpack.unpackb(msg.data, raw=False)
    return Target.loop.run_until_complete(go())


@pytest.fixture(scope="module")
def cluster():
    with running_cluster() as c:
        Target.loop = asyncio.new_event_loop()
        Target.bus = Target.loop.run_until_complete(Bus.connect(c.nats_url, "fuzz"))
        yield c
        Target.loop.run_until_complete(Target.bus.close())
        Target.loop.close()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(subject=st.sampled_from([subjects.GENERATE, subjects.CANCEL]), payload=payloads)
def test_hostile_payloads_get_error_replies(cluster, subject, payload):
    reply = send(subject, payload)
    assert isinstance(reply, dict)
    if "error" in reply:
        assert reply["error"]["code"] in ("bad_request", "too_large", "busy"), reply
    else:  # a payload that happens to be a valid request must get a valid answer
        assert "request_id" in reply, reply


def test_services_survive_and_still_serve_exactly(cluster):
    assert not cluster.dead(), cluster.dead()
    prompt = [5, 17, 300, 42, 9, 1000, 7]
    reply = Target.loop.run_until_complete(Target.bus.request(
        subjects.GENERATE, GenerateRequest(token_ids=prompt, max_tokens=16), GenerateReply, timeout=120))
    want = Reference().greedy(prompt, 16)
    assert (reply.token_ids, reply.finish_reason) == (want, "length" if len(want) == 16 else "stop")
    Target.loop.run_until_complete(wait_all_free(cluster.nats_url, timeout_s=180))
