"""One valid example of every message, for round-trip and fuzz tests."""
from __future__ import annotations

import inspect

from baton.proto import errors, internal, public
from baton.proto.errors import ErrorCode, ErrorDetail, ErrorReply
from baton.proto.message import Part
from baton.shared.kv.components import Allocation, Component, ComponentId, Geometry, Region
from baton.shared.kv.manifest import Manifest
from baton.shared.kv.plan import Pair, TransferPlan

USAGE = public.Usage(prompt_tokens=6, completion_tokens=3)
SPEC = public.SpecStats(verify_steps=2, drafted=6, accepted=1)
TIMING = public.Timing(ttft_ms=12.5, total_ms=31.0)
SAMPLING = internal.SamplingParams(temperature=0.7, top_p=0.9, seed=2**64 - 1, stop_token_ids=[2], draft_tokens=2,
                                   logprobs=3, prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=0.25,
                                   repetition_penalty=1.2, output_in_prompt=4)
CAPACITY = internal.Capacity(total_pages=4096, page_size=16, total_slots=64, max_seq_len=4096)
LOAD = internal.WorkerLoad(free_pages=3900, free_slots=60, active_requests=4, queued_prompt_tokens=0)
LOGPROBS = public.Logprobs(token_ids=[412, 9], logprobs=[-0.25, -1.5], top_ids=[[412, 7], [3, 9]],
                           top_logprobs=[[-0.25, -2.0], [-1.0, -1.5]])
FULL_PAGES = Component(ComponentId("target", "FULL", (2, 5)),
                       Geometry(dtype="bfloat16", item_rows=16, num_items=4096, row_bytes=512, header_bytes=0,
                                item_bytes=16384, window=None, kv_heads=2, head_dim=64, order="item_major",
                                layers_per_item=2),
                       (Region(addr=2**47 - 4096, nbytes=4096 * 16384, item_bytes=16384),))
MANIFEST = Manifest(worker_id="decode-0", role="decode", fingerprint="sha256:00ff", mode="ring", components=(FULL_PAGES,))
PLAN = TransferPlan(prefill_worker="prefill-0", decode_worker="decode-0", fingerprint="sha256:00ff",
                    pairs=(Pair(FULL_PAGES, FULL_PAGES),), not_provided=("draft/SWA_RING",), draft_state="cold")
ALLOCATION = Allocation(request_id="r-1", num_tokens=40, length=3, floor=0, slot=3, page_ids=(1, 2, 3),
                        swa_page_ids=(7, -1), reused=16)
REGISTRATION = internal.WorkerRegistration(
    worker_id="decode-0", instance_id="5f0c3a9e1b7d42c8", role="decode", manifest=MANIFEST,
    nixl_metadata=bytes(range(256)) * 2, capacity=CAPACITY)

EXAMPLES = [
    public.GenerateRequest(prompt="To be, or not to be", max_tokens=32, stop=["\n\n"], request_id="r-1"),
    public.GenerateRequest(token_ids=[1, 2, 2**31 - 1], temperature=1.0, top_p=0.5, seed=7, draft_tokens=0, stream=True,
                           stop_token_ids=[0]),
    public.GenerateReply(request_id="r-1", token_ids=[412, 9, 77], text=" that is the", finish_reason="length",
                         usage=USAGE, spec=SPEC, timing=TIMING),
    public.StreamChunk(request_id="r-1", token_ids=[412], text=" that"),
    public.GenerateReply(request_id="r-2", token_ids=[412, 9], text=" that is", finish_reason="length",
                         usage=USAGE, spec=SPEC, timing=TIMING, logprobs=LOGPROBS, prompt_logprobs=LOGPROBS,
                         prompt_token_ids=[5, 412, 9]),
    public.StreamChunk(request_id="r-2", token_ids=[412, 9], text=" that is", logprobs=LOGPROBS,
                       prompt_logprobs=LOGPROBS[:1], prompt_token_ids=[5, 412]),
    public.StreamChunk(request_id="r-1", token_ids=[], text="", finished=True, finish_reason="stop",
                       usage=USAGE, spec=public.SpecStats(), timing=TIMING),
    public.GenerateRequest(prompt="To be", logprobs=20, prompt_logprobs=0, presence_penalty=-2.0, frequency_penalty=0.5,
                           repetition_penalty=1.3),
    public.CancelRequest(request_id="r-1"),
    public.CancelReply(request_id="r-1", cancelled=False),
    ErrorReply(error=ErrorDetail(code=ErrorCode.BUSY, message="cluster full")),
    internal.Ack(),
    REGISTRATION,
    internal.RegisterReply(lease_ms=3000),
    internal.Heartbeat(worker_id="decode-0", instance_id="5f0c3a9e1b7d42c8", load=LOAD),
    internal.HeartbeatReply(registered=True),
    internal.Deregistration(worker_id="decode-0", instance_id="5f0c3a9e1b7d42c8", reason="shutdown"),
    internal.LookupRequest(role="prefill"),
    internal.LookupRequest(worker_id="decode-0"),
    internal.LookupReply(workers=[internal.WorkerInfo(registration=REGISTRATION, load=LOAD)]),
    internal.PlanRequest(prefill_worker_id="prefill-0", decode_worker_id="decode-0"),
    internal.PlanReply(prefill_worker_id="prefill-0", decode_worker_id="decode-0",
                       plan=PLAN),
    internal.WorkerEvent(kind="left", worker_id="decode-0", role="decode", reason="lease expired"),
    internal.PrefixEvents(worker_id="prefill-0", instance_id="5f0c3a9e1b7d42c8", seq=7, block=16,
                          added=[internal.CachedPrefix(blocks=12, digest=2**64 - 5, tokens=197)],
                          evicted=[internal.CachedPrefix(blocks=3, digest=11, tokens=58)]),
    internal.PrefixEvents(worker_id="prefill-0", instance_id="5f0c3a9e1b7d42c8", seq=7, block=16, snapshot=True,
                          added=[internal.CachedPrefix(blocks=12, digest=2**64 - 5, tokens=197)]),
    internal.PrefixQuery(),
    internal.ReserveRequest(request_id="r-1", token_ids=[5, 6, 7], max_tokens=32, sampling=SAMPLING,
                            stream_subject="_INBOX.abc.def", prefill_worker_id="prefill-0",
                            components=["target/FULL", "target/SWA_RING", "draft/SWA_RING", "aux/AUX"],
                            draft_state="transfer"),
    internal.ReserveReply(request_id="r-1", decode_worker_id="decode-0", allocation=ALLOCATION),
    internal.ReleaseRequest(request_id="r-1", reason="client cancelled"),
    internal.WriteStarting(request_id="r-1"),
    internal.TokenChunk(request_id="r-1", seq=0, token_ids=[412, 9]),
    internal.TokenChunk(request_id="r-2", seq=0, token_ids=[412, 9], logprobs=LOGPROBS),
    internal.TokenChunk(request_id="r-3", seq=0, token_ids=[412], source="prefill"),
    internal.TokenChunk(request_id="r-1", seq=1, token_ids=[77], finished=True, finish_reason="length",
                        spec=SPEC, timing=TIMING),
    internal.PrefillDispatch(request_id="r-1", token_ids=[5, 6, 7], sampling=SAMPLING),
    internal.PrefillDispatch(request_id="r-2", token_ids=[5, 6, 7], sampling=SAMPLING, first_token_to="_INBOX.abc.3"),
    internal.PrefillTarget(request_id="r-1", decode_worker_id="decode-0",
                           decode_allocation=ALLOCATION, transfer_plan=PLAN),
    internal.PrefillDone(request_id="r-1", first_token_id=412, transfer_bytes=1 << 20, prefill_ms=8.0,
                         transfer_ms=0.4),
    internal.PrefillDone(request_id="r-2", first_token_id=412, transfer_bytes=1 << 20, prefill_ms=8.0,
                         transfer_ms=0.4, prompt_logprobs=LOGPROBS),
    internal.PrefillDone(request_id="r-3", first_token_id=412, transfer_bytes=1 << 20, prefill_ms=2.0,
                         transfer_ms=0.4, cached_tokens=320),
]


def message_classes():
    """Every message type defined in proto/ (nested ones included)."""
    for module in (public, internal, errors):
        for _, cls in inspect.getmembers(module, lambda obj: isinstance(obj, type) and issubclass(obj, Part)):
            if cls.__module__ == module.__name__:
                yield cls
