"""The router's relay rules for one attempt (pure logic: events are fed by hand)."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from baton.proto.errors import BatonError, ErrorCode, NotListening
from baton.proto.internal import Ack, CachedPrefix, PrefillDone, PrefixEvents, ReserveReply, SamplingParams, TokenChunk
from baton.proto.public import Logprobs, SpecStats, Timing
from baton.services.router.affinity import PrefixAffinity
from baton.services.router.flow import (AttemptLost, DecodeLost, Flow, NoCapacity, RouterPolicy, RouterTimeouts,
                                        continued)
from baton.shared.kv.plan import TransferPlan
from baton.shared.kv.prefix_hash import digests
from proto_examples import ALLOCATION, PLAN

pytestmark = pytest.mark.unit
LATE = BatonError(ErrorCode.INTERNAL, "transfer of r: deadline passed")


def flow(idle_s: float = 2) -> Flow:
    return Flow(None, None, None, RouterTimeouts(first_token_s=2, idle_s=idle_s), "r", [1, 2], 4, SamplingParams(), None)


def chunk(seq: int, ids: list[int], finished: bool = False) -> TokenChunk:
    summary = dict(finish_reason="length", spec=SpecStats(verify_steps=1, drafted=3, accepted=2),
                   timing=Timing(ttft_ms=1.0, total_ms=2.0)) if finished else {}
    return TokenChunk(request_id="r", seq=seq, token_ids=ids, finished=finished, **summary)


async def relay(f: Flow, *events) -> list[list[int]]:
    for event in events:
        f.events.put_nowait(event)
    return [ids async for ids, _ in f._relay()]


def test_a_prefill_failure_after_decode_started_does_not_end_the_stream():
    f = flow()
    got = asyncio.run(relay(f, ("chunk", chunk(0, [5])), ("prefill_error", LATE), ("chunk", chunk(1, [6], True))))
    assert got == [[5], [6]] and f.outcome.finish_reason == "length"


def ahead(token: int) -> TokenChunk:
    """Prefill's copy of the first token, sent as soon as it is sampled."""
    return TokenChunk(request_id="r", seq=0, token_ids=[token], source="prefill")


def test_the_first_token_from_prefill_is_relayed_once_and_decode_goes_on_after_it():
    f = flow()
    got = asyncio.run(relay(f, ("chunk", ahead(5)), ("chunk", chunk(0, [5])), ("chunk", chunk(1, [6, 7])),
                            ("chunk", chunk(2, [8], True))))
    assert got == [[5], [6, 7], [8]] and f.outcome.finish_reason == "length"


def test_prefills_copy_of_the_first_token_after_decodes_is_dropped():
    f = flow()
    got = asyncio.run(relay(f, ("chunk", chunk(0, [5])), ("chunk", ahead(5)), ("chunk", chunk(1, [6], True))))
    assert got == [[5], [6]] and f.outcome.finish_reason == "length"


def test_a_first_token_decode_does_not_confirm_ends_the_request_with_an_internal_error():
    with pytest.raises(BatonError) as raised:
        asyncio.run(relay(flow(), ("chunk", ahead(5)), ("chunk", chunk(0, [9]))))
    assert raised.value.code is ErrorCode.INTERNAL and "not prefill's [5]" in raised.value.message


@pytest.mark.parametrize("kind", ["error", "prefill_error", "decode_lost"])
def test_a_state_lost_after_only_prefills_first_token_was_sent_continues_after_it(kind):
    """The first token reached the client, decode never streamed: the transfer failed, prefill
    or decode is gone. The request continues elsewhere after that token (not from the start,
    which with sampling could give the client a different first token)."""
    with pytest.raises(DecodeLost) as lost:
        asyncio.run(relay(flow(), ("chunk", ahead(5)), (kind, LATE)))
    assert lost.value.error is LATE


def test_decode_silent_after_prefills_first_token_is_decode_lost_at_the_idle_timeout():
    with pytest.raises(DecodeLost) as lost:
        asyncio.run(relay(flow(idle_s=0.05), ("chunk", ahead(5))))
    assert lost.value.error.code is ErrorCode.TIMEOUT


class Recorder:
    """A bus that answers every request with an Ack and remembers what was asked."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def request(self, subject, message, reply_cls, timeout, joined_at=None):
        self.sent.append((subject, message))
        return Ack()


def test_a_stop_string_in_prefills_first_token_ends_the_request_at_once_and_releases_decode():
    """Decode has not streamed yet, so it has nothing to count: the flow does not wait for it."""
    f = Flow(Recorder(), None, None, RouterTimeouts(first_token_s=60, idle_s=60), "r", [1, 2], 4, SamplingParams(),
             None)
    f.decode_id = "d"

    async def run():
        got = []
        f.events.put_nowait(("chunk", ahead(5)))
        async for ids, _ in f._relay():
            got.append(ids)
            f.stop()  # the router's TextStream matched a stop string in it
        return got
    assert asyncio.run(asyncio.wait_for(run(), 10)) == [[5]]
    assert f.outcome.finish_reason == "stop"
    (subject, release), = f.bus.sent
    assert subject.endswith(".d.release") and release.finish_reason == "abort"


@pytest.mark.parametrize("max_tokens, sampling, asked", [
    (4, SamplingParams(), True),
    (1, SamplingParams(), False),  # the only token: a transfer lost after it would leave nothing to continue
    (4, SamplingParams(logprobs=2), False),  # decode computes its logprobs from the state
    (4, SamplingParams(prompt_logprobs=1), False),
])
def test_prefill_is_asked_for_the_first_token_ahead_unless_it_is_the_only_one_or_logprobs_are_asked_for(
        max_tokens, sampling, asked):
    f = Flow(Recorder(), OneDecode(), None, RouterTimeouts(), "r", [1, 2], max_tokens, sampling, None)
    f.stream_subject = "_INBOX.x.7"
    asyncio.run(f._prefill("p"))
    (subject, dispatch), = f.bus.sent
    assert subject.endswith(".p.dispatch") and dispatch.first_token_to == ("_INBOX.x.7" if asked else None)


def with_prompt_logprobs() -> Flow:
    return Flow(None, None, None, RouterTimeouts(first_token_s=2, idle_s=2), "r", [1, 2], 4,
                SamplingParams(prompt_logprobs=1), None)


def test_chunks_wait_for_the_prompt_logprobs_when_they_are_asked_for():
    f = with_prompt_logprobs()
    prompt = Logprobs(token_ids=[2], logprobs=[-0.5], top_ids=[[2]], top_logprobs=[[-0.5]])
    done = PrefillDone(request_id="r", first_token_id=5, transfer_bytes=1, prefill_ms=1.0, transfer_ms=1.0,
                       prompt_logprobs=prompt)
    seen = []

    async def run():
        for event in (("chunk", chunk(0, [5])), ("chunk", chunk(1, [6]))):
            f.events.put_nowait(event)
        async for ids, _ in f._relay():
            seen.append((ids, f.prompt_logprobs))  # set before the first tokens reach the caller
            if len(seen) == 2:
                return
        raise AssertionError("the relay ended early")

    async def main():
        task = asyncio.create_task(run())
        async with asyncio.timeout(2):
            while not f.events.empty():  # the relay has taken both chunks
                await asyncio.sleep(0)
        assert not seen  # and holds them: prefill's reply has not come
        f.events.put_nowait(("prefilled", done))
        await asyncio.wait_for(task, 2)

    asyncio.run(main())
    assert seen == [([5], prompt), ([6], prompt)]


def test_a_prefill_failure_while_chunks_wait_for_the_prompt_logprobs_loses_the_attempt():
    with pytest.raises(AttemptLost):
        asyncio.run(relay(with_prompt_logprobs(), ("chunk", chunk(0, [5])), ("prefill_error", LATE)))


def test_a_prefill_failure_before_the_first_token_loses_the_attempt():
    with pytest.raises(AttemptLost):
        asyncio.run(relay(flow(), ("prefill_error", LATE)))


def test_a_decode_error_after_the_first_token_ends_the_request():
    with pytest.raises(BatonError, match="decode gone"):
        asyncio.run(relay(flow(), ("chunk", chunk(0, [5])),
                          ("error", BatonError(ErrorCode.UNAVAILABLE, "decode gone"))))


def test_prefill_leaving_matters_only_until_decode_streams():
    f = flow()
    f.prefill_id, f.decode_id = "p", "d"
    f.worker_left("p", "lease expired")
    assert f.events.get_nowait()[0] == "prefill_error"
    f.worker_left("d", "lease expired")
    assert f.events.get_nowait()[0] == "decode_lost"


class SilentBus:
    """A bus whose requests are never answered (a prefill that died without a word)."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def request(self, subject, message, reply_cls, timeout, joined_at=None):
        self.asked.set()
        await asyncio.sleep(timeout)  # the silence itself: no reply within the timeout
        raise BatonError(ErrorCode.TIMEOUT, f"no reply from {subject} within {timeout} s")


def test_a_target_sent_to_a_prefill_that_leaves_is_lost_at_its_left_event_not_at_the_timeout():
    async def run():
        f = Flow(SilentBus(), None, None, RouterTimeouts(first_token_s=60), "r", [1, 2], 4, SamplingParams(), None)
        f.prefill_id, f.decode_id = "p", "d"
        target = asyncio.create_task(f._target(SimpleNamespace(decode_worker_id="d", allocation=ALLOCATION), PLAN))
        await asyncio.wait_for(f.bus.asked.wait(), 2)
        f.worker_left("p", "lease expired")
        with pytest.raises(AttemptLost, match="worker p left"):
            await asyncio.wait_for(target, 2)  # not the 60 s first-token timeout
    asyncio.run(run())


class AnsweringBus:
    """Answers every request at once with an Ack, recording the timeout it was given."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    async def request(self, subject, message, reply_cls, timeout):
        self.timeouts.append(timeout)
        return reply_cls()


def test_the_first_token_timeout_bounds_an_attempt_from_its_admission_not_each_stage_anew():
    """An attempt admitted 59.9 s ago (first_token_s = 60): the target request gets what is left of
    the 60 s, and the relay then waits only that long for the first token (before, each of them
    waited the whole first_token_s again, so a slow prefill left a stream silent for 2-3x it)."""
    async def run():
        f = Flow(AnsweringBus(), None, None, RouterTimeouts(first_token_s=60), "r", [1, 2], 4, SamplingParams(), None)
        f.prefill_id, f.decode_id = "p", "d"
        f._first_token_by = time.monotonic() + 0.1  # what _admit set 59.9 s ago
        await f._target(SimpleNamespace(decode_worker_id="d", allocation=ALLOCATION), PLAN)
        assert f.bus.timeouts and f.bus.timeouts[0] <= 0.1
        with pytest.raises(BatonError, match="no token within 60 s of its admission"):
            await asyncio.wait_for(relay(f), 10)  # not another 60 s
    asyncio.run(run())


def test_decode_lost_after_the_first_token_lets_the_request_continue_elsewhere():
    gone = BatonError(ErrorCode.UNAVAILABLE, "worker d left")
    with pytest.raises(DecodeLost) as lost:
        asyncio.run(relay(flow(), ("chunk", chunk(0, [5])), ("decode_lost", gone)))
    assert lost.value.error is gone


def test_decode_lost_before_the_first_token_is_a_plain_retry():
    with pytest.raises(AttemptLost) as lost:
        asyncio.run(relay(flow(), ("decode_lost", BatonError(ErrorCode.UNAVAILABLE, "worker d left"))))
    assert type(lost.value) is AttemptLost


def test_decode_silent_past_the_idle_timeout_mid_stream_is_decode_lost():
    with pytest.raises(DecodeLost) as lost:
        asyncio.run(relay(flow(idle_s=0.05), ("chunk", chunk(0, [5]))))
    assert lost.value.error.code is ErrorCode.TIMEOUT


def test_a_continuation_draws_fresh_randomness():
    assert continued(SamplingParams(), 7) == SamplingParams(output_in_prompt=7)  # unseeded: no seed to change
    seeded = SamplingParams(temperature=0.8, seed=42)
    after = continued(seeded, 7)
    assert after.seed != 42 and 0 <= after.seed < 2**64 and after.temperature == 0.8
    assert after == continued(seeded, 7) and after.seed != continued(seeded, 8).seed


def test_a_continuation_counts_what_was_sent_as_output_and_asks_no_prompt_logprobs():
    after = continued(continued(SamplingParams(presence_penalty=1.0, prompt_logprobs=2, min_tokens=10), 3), 4)
    assert (after.output_in_prompt, after.min_tokens, after.prompt_logprobs) == (7, 3, None)


def test_a_lost_chunk_loses_decode_so_the_request_continues_after_what_was_sent():
    with pytest.raises(DecodeLost, match="chunk 1 lost"):
        asyncio.run(relay(flow(), ("chunk", chunk(0, [5])), ("chunk", chunk(2, [7]))))


def test_a_lost_first_chunk_loses_the_attempt():
    with pytest.raises(AttemptLost, match="chunk 0 lost") as lost:
        asyncio.run(relay(flow(), ("chunk", chunk(1, [7]))))
    assert not isinstance(lost.value, DecodeLost)


def test_silence_after_a_reconnect_loses_decode_within_the_reconnect_timeout():
    f = Flow(None, None, None, RouterTimeouts(first_token_s=60, idle_s=60, reconnect_s=0.2), "r", [1, 2], 4,
             SamplingParams(), None)
    with pytest.raises(DecodeLost, match="no token within 0.2 s"):
        asyncio.run(relay(f, ("chunk", chunk(0, [5])), ("reconnected", None)))


def test_a_chunk_after_a_reconnect_restores_the_idle_timeout():
    f = Flow(None, None, None, RouterTimeouts(first_token_s=60, idle_s=60, reconnect_s=0.2), "r", [1, 2], 4,
             SamplingParams(), None)

    async def run():
        task = asyncio.create_task(relay(f, ("chunk", chunk(0, [5])), ("reconnected", None), ("chunk", chunk(1, [6]))))
        # the wait is the thing tested: past reconnect_s (0.2 s, a timer on this loop's clock that would
        # fire first) nothing may end it now, only the idle timeout
        await asyncio.sleep(0.5)
        assert not task.done()
        f.events.put_nowait(("chunk", chunk(2, [7], True)))
        return await task
    assert asyncio.run(run()) == [[5], [6], [7]]


class Prefills:
    """The part of the router's Directory `_pick_prefill` reads."""

    def __init__(self, **queued_and_draining: tuple[int, bool]) -> None:
        self.workers = [SimpleNamespace(registration=SimpleNamespace(worker_id=w, role="prefill"),
                                        load=SimpleNamespace(queued_prompt_tokens=q, draining=d))
                        for w, (q, d) in queued_and_draining.items()]
        self.affinity = PrefixAffinity()

    def of_role(self, role: str) -> list:
        return self.workers

    def outstanding(self, worker_id: str) -> int:
        return 0


def test_a_draining_prefill_is_never_picked_even_when_least_loaded():
    f = Flow(None, Prefills(idle=(0, True), busy=(500, False)), None, RouterTimeouts(), "r", [1], 4, SamplingParams(),
             None)
    assert f._pick_prefill(f.directory.of_role("prefill")) == "busy"
    f.directory = Prefills(a=(0, True), b=(0, True))
    with pytest.raises(NoCapacity):  # it waits in the queue for a prefill that takes prompts
        f._pick_prefill(f.directory.of_role("prefill"))
    with pytest.raises(NoCapacity):
        f._pick_prefill([])


def test_a_follow_up_turn_goes_to_the_prefill_that_holds_its_prefix_unless_its_queue_outweighs_it():
    turn1 = list(range(1, 97))
    f = Flow(None, Prefills(a=(0, False), b=(0, False)), None, RouterTimeouts(), "r", turn1 + [5] * 40, 4,
             SamplingParams(), None)
    assert f._pick_prefill(f.directory.of_role("prefill")) == "a"  # nothing cached anywhere: the first least loaded
    held = CachedPrefix(blocks=5, digest=digests(turn1, 16, 5)[-1], tokens=len(turn1))  # b's cache reports turn 1
    f.directory.affinity.apply(PrefixEvents(worker_id="b", instance_id="i", seq=3, block=16, added=[held],
                                            snapshot=True))
    assert f._pick_prefill(f.directory.of_role("prefill")) == "b"
    assert f._prefill_work == 40  # what b should compute
    f.directory.workers[1].load.queued_prompt_tokens = 1000
    assert f._pick_prefill(f.directory.of_role("prefill")) == "a"  # 1000 queued tokens outweigh 96 cached


class OneDecode:
    """The part of the router's Directory `_reserve` reads: one decode worker, `d`."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.turns = PrefixAffinity()

    async def known(self, role: str) -> list:
        return [SimpleNamespace(registration=SimpleNamespace(worker_id="d"), load=SimpleNamespace(free_slots=4,
                                                                                                  free_pages=64))]

    async def plan(self, prefill_id: str, decode_id: str) -> TransferPlan:
        return PLAN

    def joined_at(self, worker_id: str) -> float:
        return 0.0

    def outstanding(self, worker_id: str) -> int:
        return 0

    def add_outstanding(self, worker_id: str, amount: int) -> None:
        self.held[worker_id] = self.held.get(worker_id, 0) + amount


class FailingBus:
    def __init__(self, error: BatonError) -> None:
        self.error = error

    async def request(self, subject, message, reply_cls, timeout, joined_at=None):
        raise self.error


def test_an_internal_error_from_decode_loses_the_attempt_so_it_is_retried_on_other_workers():
    """decode could not serve this pair (e.g. it cannot load the prefill's transfer metadata): the
    request is not at fault, so the attempt is lost (retried once elsewhere), not the request."""
    broken = BatonError(ErrorCode.INTERNAL, "reserve failed: ValueError: bad metadata")
    f = Flow(FailingBus(broken), OneDecode(), None, RouterTimeouts(), "r", [1, 2], 4, SamplingParams(), None)
    with pytest.raises(AttemptLost) as lost:
        asyncio.run(f._reserve("p"))
    assert lost.value.error is broken and f.directory.held == {"d": 0}
    refused = BatonError(ErrorCode.BAD_REQUEST, "max_tokens too large")  # the request's own fault: not retried
    f = Flow(FailingBus(refused), OneDecode(), None, RouterTimeouts(), "r", [1, 2], 4, SamplingParams(), None)
    with pytest.raises(BatonError) as raised:
        asyncio.run(f._reserve("p"))
    assert raised.value is refused


def test_a_prefill_found_not_listening_is_not_picked_again_until_it_leaves():
    """The target went to a prefill whose process is gone ("no responders"): the retry does not
    pick it again (before, with no other prefill, it was picked again and the request failed at
    once); the request waits in the queue instead, and once that prefill has left, a worker
    registering under its id is a new process and may be picked."""
    f = Flow(None, Prefills(p=(0, False)), None, RouterTimeouts(), "r", [1], 4, SamplingParams(), None)
    f.prefill_id, f.decode_id = "p", "d"
    lost = AttemptLost(NotListening("no service is listening on baton.internal.v1.prefill.p.target"), "p")
    f._mark_gone(lost.gone)
    with pytest.raises(NoCapacity):
        f._pick_prefill(f.directory.of_role("prefill"))
    f.worker_left("p", "lease expired")
    assert f._pick_prefill(f.directory.of_role("prefill")) == "p"


def test_a_worker_found_not_listening_that_never_leaves_is_tried_again_after_the_recheck_time():
    """A live prefill that a NATS route flap hid (its node restarting) answers no one for a moment
    but stays registered: the request does not wait for it to leave, which it never does (it
    timed out in the queue after 30 s), but tries it again once `gone_recheck_s` has passed."""
    f = Flow(None, Prefills(p=(0, False)), None, RouterTimeouts(gone_recheck_s=15.0), "r", [1], 4,
             SamplingParams(), None)
    marked = time.monotonic()
    f._mark_gone("p")
    assert marked + 15.0 <= f._gone["p"] <= time.monotonic() + 15.0
    with pytest.raises(NoCapacity):
        f._pick_prefill(f.directory.of_role("prefill"))
    f._gone["p"] = time.monotonic()  # the recheck time has passed
    assert f._pick_prefill(f.directory.of_role("prefill")) == "p"


def test_a_target_that_finds_nobody_listening_names_the_prefill_gone():
    async def run():
        f = Flow(FailingBus(NotListening("no service is listening on x")), None, None, RouterTimeouts(), "r", [1], 4,
                 SamplingParams(), None)
        f.prefill_id, f.decode_id = "p", "d"
        with pytest.raises(AttemptLost) as lost:
            await f._target(SimpleNamespace(decode_worker_id="d", allocation=ALLOCATION), PLAN)
        assert lost.value.gone == "p"
        f = Flow(FailingBus(BatonError(ErrorCode.TIMEOUT, "no reply")), None, None, RouterTimeouts(), "r", [1], 4,
                 SamplingParams(), None)
        f.prefill_id, f.decode_id = "p", "d"
        with pytest.raises(AttemptLost) as lost:
            await f._target(SimpleNamespace(decode_worker_id="d", allocation=ALLOCATION), PLAN)
        assert lost.value.gone is None  # a silent prefill may only be slow
    asyncio.run(run())


class LateReplyingBus:
    """Answers a dispatch `delay_s` after it is sent, as a prefill that sees its WRITE complete
    after decode has already streamed the whole request."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def request(self, subject, message, reply_cls, timeout, joined_at=None):
        await asyncio.sleep(self.delay_s)  # the late reply itself
        return PrefillDone(request_id="r", first_token_id=5, transfer_bytes=1, prefill_ms=1.0, transfer_ms=1.0,
                           cached_tokens=7)


def prefilling(bus, prefill_report_s: float = 1.0) -> Flow:
    f = Flow(bus, SimpleNamespace(joined_at=lambda _: None, add_outstanding=lambda *_: None), None,
             RouterTimeouts(first_token_s=60, prefill_report_s=prefill_report_s), "r", [1, 2], 4,
             SamplingParams(), None)
    f._prefill_task = asyncio.create_task(f._prefill("p"))
    return f


def test_a_request_decode_finished_before_prefill_replied_still_gets_prefill_counts():
    """Under load decode saw the WRITE, streamed 24 tokens and finished before prefill's reply
    (cached tokens, timing) reached the router: the client's usage said 0 cached tokens."""
    async def run():
        f = prefilling(LateReplyingBus(0.2))
        await relay(f, ("chunk", chunk(0, [5], True)))
        return f
    f = asyncio.run(run())
    assert f.outcome.finish_reason == "length" and f.prefill_done is not None and f.prefill_done.cached_tokens == 7


def test_a_prefill_that_never_replies_delays_the_end_of_a_finished_request_only_by_prefill_report_s(caplog):
    async def run():
        f = prefilling(SilentBus(), prefill_report_s=0.2)
        got = await asyncio.wait_for(relay(f, ("chunk", chunk(0, [5], True))), 10)  # not first_token_s (60)
        f._prefill_task.cancel()
        return f, got
    f, got = asyncio.run(run())
    assert got == [[5]] and f.outcome.finish_reason == "length" and f.prefill_done is None
    assert "prefill's reply did not come within 0.2 s" in caplog.text


@pytest.mark.parametrize("prompt, sampling, limit, cached, asked", [
    ([1] * 8, SamplingParams(), 8, 0, True),
    ([1] * 9, SamplingParams(), 8, 0, False),  # longer than the limit
    ([1] * 8, SamplingParams(), 0, 0, False),  # turned off
    ([1] * 8, SamplingParams(prompt_logprobs=1), 8, 0, False),  # prefill's reply carries them
    ([1] * 8, SamplingParams(), 8, 4, False),  # the picked prefill holds a prefix: cheaper there
])
def test_a_short_prompt_nobody_holds_a_prefix_of_may_be_prefilled_on_decode(prompt, sampling, limit, cached, asked):
    f = Flow(None, None, None, RouterTimeouts(), "r", prompt, 4, sampling, None, RouterPolicy(limit))
    f._prefill_work = len(prompt) - cached  # as _pick_prefill leaves it
    assert f._may_prefill_on_decode() is asked


class Reserving(Recorder):
    """A bus whose decode answers a reservation, prefilling the prompt itself when asked to."""

    async def request(self, subject, message, reply_cls, timeout, joined_at=None):
        self.sent.append((subject, message))
        if subject.endswith(".reserve"):
            return ReserveReply(request_id="r", decode_worker_id="d", allocation=ALLOCATION,
                                prefilled_here=message.prefill_here)
        return Ack()


class BusyDecode(OneDecode):
    def outstanding(self, worker_id: str) -> int:
        return 1  # this router has a request on it already


@pytest.mark.parametrize("directory, asked", [(OneDecode(), True), (BusyDecode(), False)])
def test_decode_is_asked_to_prefill_only_when_this_router_has_nothing_on_it(directory, asked):
    f = Flow(Reserving(), directory, None, RouterTimeouts(), "r", [1, 2], 4, SamplingParams(), None)
    reply, _ = asyncio.run(f._reserve("p", ask_to_prefill=True))
    (subject, reserve), = f.bus.sent
    assert reserve.prefill_here is asked and reply.prefilled_here is asked


class Both(OneDecode):
    """One prefill `p` and one decode `d`; this router has `busy` requests on each."""
    affinity = PrefixAffinity()

    def __init__(self, busy: int = 0) -> None:
        super().__init__()
        self.busy = busy

    async def known(self, role: str) -> list:
        if role == "prefill":
            return Prefills(p=(0, False)).workers
        return await super().known(role)

    def outstanding(self, worker_id: str) -> int:
        return self.busy if worker_id == "p" else 0


@pytest.mark.parametrize("busy", [0, 1])
def test_an_attempt_that_decode_prefills_sends_prefill_only_the_prompt_to_keep_when_idle(busy):
    """Decode took the prompt: no dispatch of the request, no target and no release to prefill;
    an idle prefill gets the prompt to keep in its prefix cache, a busy one nothing."""
    async def run():
        f = Flow(Reserving(), Both(busy), SimpleNamespace(open=lambda events: "_INBOX.x.1", close=lambda s: None),
                 RouterTimeouts(), "r", [1, 2], 4, SamplingParams(), None)
        await f._admit()
        assert f.prefill_id is None and f.decode_id == "d" and f.served_by == "d (prefilled there)"
        await asyncio.gather(*f._tasks)  # the cache dispatch, if any, has gone out and been answered
        f.outcome.finish_reason = "length"
        await f._end_attempt("done")
        return f.bus.sent
    sent = asyncio.run(run())
    assert [subject.rsplit(".", 2)[1:] for subject, _ in sent] == [["d", "reserve"]] + [["p", "dispatch"]] * (not busy)
    if not busy:
        assert sent[1][1].cache_only and sent[1][1].first_token_to is None and sent[1][1].token_ids == [1, 2]
