"""Internal messages between router, kv-registry, prefill and decode (documented in proto/README.md).

Manifests, allocations and transfer plans are the KV library's records (`baton.shared.kv`
`Record`s): they travel as typed fields, decoded and type-checked with the message, unknown
fields refused; what they mean (a manifest against the model, a plan's pairing) is checked there.
"""
from __future__ import annotations

from typing import Literal

from baton.shared.kv.components import Allocation
from baton.shared.kv.manifest import Manifest
from baton.shared.kv.plan import TransferPlan

from .errors import bad_request
from .fields import AgentMetadata, Count, Finite, Millis, RequestId, Seed, Subject, TokenId, WorkerId
from .message import Message, Part
from .public import (FinishReason, Logprobs, SpecStats, Timing, check_draft_tokens, check_logprobs, check_penalties,
                     check_sampling)

Role = Literal["prefill", "decode"]


class Ack(Message):
    """An empty success reply."""


class SamplingParams(Part):
    temperature: Finite = 0.0
    top_p: Finite = 1.0
    seed: Seed | None = None
    stop_token_ids: list[TokenId] = []
    draft_tokens: int | None = None  # GenerateRequest.draft_tokens: a cap on the deployment's K
    min_tokens: int = 0  # GenerateRequest.min_tokens: stop tokens among the first this many do not stop
    presence_penalty: Finite = 0.0  # GenerateRequest's three penalties (shared/engine/penalties.py)
    frequency_penalty: Finite = 0.0
    repetition_penalty: Finite = 1.0
    output_in_prompt: Count = 0  # a continuation's: the prompt's last this many tokens were output (penalties count them)
    logprobs: int | None = None  # GenerateRequest.logprobs: decode reports the generated tokens' logprobs
    prompt_logprobs: int | None = None  # GenerateRequest.prompt_logprobs: prefill reports the prompt's

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        check_logprobs(self.logprobs, self.prompt_logprobs)
        if self.min_tokens < 0:
            raise bad_request(f"field 'min_tokens': must be >= 0, got {self.min_tokens}")
        check_draft_tokens(self.draft_tokens)


# --- registry ---------------------------------------------------------------------------

class Capacity(Part):
    total_pages: Count
    page_size: Count  # token positions per page
    total_slots: Count  # requests resident at once (ring slots / batch rows)
    max_seq_len: Count  # prompt + completion tokens per request


class WorkerRegistration(Message):
    worker_id: WorkerId
    instance_id: WorkerId  # random per process start: tells a restarted worker from a second live one
    role: Role
    manifest: Manifest  # the worker's KV components (the registry validates it against the model)
    nixl_metadata: AgentMetadata  # NIXL agent metadata (opaque; never unpickled)
    capacity: Capacity


class RegisterReply(Message):
    lease_ms: Count  # heartbeat at least this often or be dropped


class WorkerLoad(Part):
    free_pages: Count
    free_slots: Count
    active_requests: Count
    queued_prompt_tokens: Count
    requests_total: Count = 0  # requests this worker has taken since it started
    draining: bool = False  # stopping: finishing what it holds, taking nothing new (route elsewhere)


class Heartbeat(Message):
    worker_id: WorkerId
    instance_id: WorkerId
    load: WorkerLoad


class HeartbeatReply(Message):
    registered: bool  # False: the lease expired or was never granted; register again


class Deregistration(Message):
    worker_id: WorkerId
    instance_id: WorkerId
    reason: str = ""


class LookupRequest(Message):
    """Live workers, filtered by role and/or id; no filter returns all."""

    role: Role | None = None
    worker_id: WorkerId | None = None


class WorkerInfo(Message):
    registration: WorkerRegistration
    load: WorkerLoad


class LookupReply(Message):
    workers: list[WorkerInfo]


class PlanRequest(Message):
    prefill_worker_id: WorkerId
    decode_worker_id: WorkerId


class PlanReply(Message):
    prefill_worker_id: WorkerId
    decode_worker_id: WorkerId
    plan: TransferPlan


class WorkerEvent(Message):
    kind: Literal["joined", "draining", "left"]  # draining: stopping, still registered, takes nothing new
    worker_id: WorkerId
    role: Role
    reason: str = ""  # for "left": deregistered / lease expired
    instance_id: str = ""  # the worker's instance the event is about


# --- prefix caches (published by prefill workers, read by every router) ------------------

class CachedPrefix(Part):
    """One prompt end a prefill worker's prefix cache holds (shared/kv/prefix_cache.py)."""
    blocks: Count  # whole blocks of `PrefixEvents.block` tokens that the digest covers
    digest: Seed  # their chained digest (shared/kv/prefix_hash.py)
    tokens: Count  # where the cached prompt ends: a prompt that extends it starts up to here


class PrefixEvents(Message):
    """What changed in one prefill worker's prefix cache, or (snapshot) all it holds."""
    worker_id: WorkerId
    instance_id: str
    seq: Count  # per instance: +1 per change message; a snapshot is current at this seq
    block: Count  # tokens per block of the digests
    added: list[CachedPrefix] = []
    evicted: list[CachedPrefix] = []
    snapshot: bool = False  # `added` is everything the cache holds (the reply to a PrefixQuery)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise bad_request(f"field 'block': must be >= 1, got {self.block}")
        if self.snapshot and self.evicted:
            raise bad_request("a snapshot lists what is held, not what was evicted")


class PrefixQuery(Message):
    """Ask a prefill worker for everything its prefix cache holds (reply: a PrefixEvents snapshot)."""


# --- decode ----------------------------------------------------------------------------

class ReserveRequest(Message):
    request_id: RequestId
    token_ids: list[TokenId]  # the prompt
    max_tokens: Count
    sampling: SamplingParams
    stream_subject: Subject  # where decode publishes this request's TokenChunks
    prefill_worker_id: WorkerId  # the only NIXL peer whose WRITEs this reservation accepts
    components: list[str]  # component names ("owner/kind") the transfer plan writes
    draft_state: Literal["none", "transfer", "rebuild", "cold"]  # the plan's: how the draft window starts
    prefill_here: bool = False  # decode may compute the prompt itself if nothing else runs there (no transfer)


class ReserveReply(Message):
    request_id: RequestId
    decode_worker_id: WorkerId
    allocation: Allocation  # the reserved pages and ring slot
    prefilled_here: bool = False  # decode computes the prompt itself: prefill is not needed


class ReleaseRequest(Message):
    """Abort a request and free what it holds: on decode, a reserved or running request's pages
    and slots; on prefill, a dispatched request that has no PrefillTarget yet."""

    request_id: RequestId
    reason: str = ""
    finish_reason: Literal["abort", "stop"] = "abort"  # how decode ends it: "stop" when a stop string matched


class TokenChunk(Message):
    """Decode -> router on the request's stream subject; `seq` counts chunks from 0 so the
    router notices a lost message. A failure is published there as an ErrorReply instead.
    Prefill may send the first token ahead of decode (`source` "prefill": seq 0, that one token,
    as soon as it is sampled); decode's own chunk 0 then repeats it and the router keeps one."""

    request_id: RequestId
    seq: Count
    token_ids: list[TokenId]  # new tokens since the previous chunk
    finished: bool = False
    finish_reason: FinishReason | None = None  # set when finished
    spec: SpecStats | None = None  # set when finished
    timing: Timing | None = None  # set when finished; measured on decode from reserve
    logprobs: Logprobs | None = None  # of token_ids, when the request asked for logprobs
    source: Literal["decode", "prefill"] = "decode"

    def __post_init__(self) -> None:
        if self.source == "prefill" and (self.seq or self.finished or len(self.token_ids) != 1 or self.logprobs):
            raise bad_request("prefill's chunk is chunk 0 with the first token alone")
        summary = (self.finish_reason, self.spec, self.timing)
        if self.finished and None in summary:
            raise bad_request("a finished chunk needs 'finish_reason', 'spec' and 'timing'")
        if not self.finished and summary != (None, None, None):
            raise bad_request("summary fields are only allowed on the finished chunk")


# --- prefill ---------------------------------------------------------------------------

class PrefillDispatch(Message):
    """Router -> prefill: run the prompt now; where its state goes follows in a PrefillTarget
    (sent once decode has reserved slots, while the prompt computes)."""

    request_id: RequestId
    token_ids: list[TokenId]
    sampling: SamplingParams
    first_token_to: Subject | None = None  # publish the first token there as soon as it is sampled
    # (a TokenChunk from "prefill"), before the state is written: the request's stream subject
    cache_only: bool = False  # decode prefills this prompt itself: compute it only to keep it in the
    # prefix cache (for the conversation's next turn); no target follows, the reply comes once it is kept


class PrefillTarget(Message):
    """Router -> prefill: WRITE the dispatched request's state into these reserved decode slots."""

    request_id: RequestId
    decode_worker_id: WorkerId
    decode_allocation: Allocation  # ReserveReply.allocation
    transfer_plan: TransferPlan  # PlanReply.plan


class WriteStarting(Message):
    """Prefill -> decode, published (no reply) as prefill starts a request's WRITE: decode looks
    for the WRITE's notifications every 0.1 ms from now on, not every 1 ms. Only a hint: when it
    is lost, the state is found all the same, up to 1 ms later."""

    request_id: RequestId


class PrefillDone(Message):
    """The reply to PrefillDispatch once the transfer is complete and decode was notified."""

    request_id: RequestId
    first_token_id: TokenId
    transfer_bytes: Count
    prefill_ms: Millis
    transfer_ms: Millis
    prompt_logprobs: Logprobs | None = None  # when the dispatch's sampling asked for them
    cached_tokens: Count = 0  # prompt positions taken from prefill's prefix cache, not computed
