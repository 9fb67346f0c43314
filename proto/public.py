"""Public messages: `baton.v1.generate` and `baton.v1.cancel` (documented in proto/README.md)."""
from __future__ import annotations

from typing import Literal

from .errors import BatonError, ErrorCode, bad_request
from .fields import Count, Finite, Millis, RequestId, Seed, TokenId
from .limits import Limits
from .message import Message, Part

FinishReason = Literal["length", "stop", "abort", "error"]


class GenerateRequest(Message):
    prompt: str | None = None  # exactly one of prompt / token_ids
    token_ids: list[TokenId] | None = None
    max_tokens: int = 128  # 1 .. Limits.max_tokens
    temperature: Finite = 0.0  # 0 = greedy
    top_p: Finite = 1.0  # 0 < top_p <= 1
    seed: Seed | None = None
    draft_tokens: int | None = None  # <= this many drafts per step (0: none); None: the deployment's K
    stream: bool = False
    stop: list[str] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False  # generate past the end-of-text token (to max_tokens or another stop)
    min_tokens: int = 0  # 0 .. max_tokens: no stop token or stop string ends the request before this many tokens
    presence_penalty: Finite = 0.0  # -2 .. 2: subtracted from a token's logit once it is in the output
    frequency_penalty: Finite = 0.0  # -2 .. 2: subtracted per occurrence in the output
    repetition_penalty: Finite = 1.0  # 0 < r <= 10: a token seen in prompt or output: logit / r (positive) or * r
    logprobs: int | None = None  # 0 .. 20: each generated token's logprob and this many most likely alternatives
    prompt_logprobs: int | None = None  # 0 .. 20: the same for the prompt's tokens (from its second on)
    request_id: RequestId | None = None  # chosen by the client so it can cancel; else the router picks

    def validate(self, limits: Limits) -> None:
        if (self.prompt is None) == (self.token_ids is None):
            raise bad_request("exactly one of 'prompt' and 'token_ids' must be given")
        prompt_size = len(self.prompt if self.prompt is not None else self.token_ids)
        if prompt_size == 0:
            raise bad_request(f"field '{'prompt' if self.prompt is not None else 'token_ids'}': must not be empty")
        if self.prompt is not None and prompt_size > limits.max_prompt_chars:
            raise BatonError(ErrorCode.TOO_LARGE,
                             f"field 'prompt': {prompt_size} characters; the limit is {limits.max_prompt_chars}")
        if self.token_ids is not None and prompt_size > limits.max_prompt_tokens:
            raise BatonError(ErrorCode.TOO_LARGE,
                             f"field 'token_ids': {prompt_size} tokens; the limit is {limits.max_prompt_tokens}")
        if not 1 <= self.max_tokens <= limits.max_tokens:
            raise bad_request(f"field 'max_tokens': must be between 1 and {limits.max_tokens}, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad_request(f"field 'min_tokens': must be between 0 and max_tokens ({self.max_tokens}), "
                              f"got {self.min_tokens}")
        check_sampling(self.temperature, self.top_p)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        check_draft_tokens(self.draft_tokens)
        check_logprobs(self.logprobs, self.prompt_logprobs)
        if self.token_ids is not None:
            check_logprob_size(self, len(self.token_ids))
        if len(self.stop) > limits.max_stop or len(self.stop_token_ids) > limits.max_stop:
            raise bad_request(f"fields 'stop' and 'stop_token_ids': at most {limits.max_stop} entries each")
        for i, text in enumerate(self.stop):
            if not 1 <= len(text) <= limits.max_stop_chars:
                raise bad_request(f"field 'stop[{i}]': must have 1 to {limits.max_stop_chars} characters")


def check_sampling(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise bad_request(f"field 'temperature': must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise bad_request(f"field 'top_p': must be in (0, 1], got {top_p}")


def check_penalties(presence: float, frequency: float, repetition: float) -> None:
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2 <= value <= 2:
            raise bad_request(f"field '{name}': must be between -2 and 2, got {value}")
    if not 0 < repetition <= 10:
        raise bad_request(f"field 'repetition_penalty': must be in (0, 10], got {repetition}")


MAX_LOGPROBS = 20  # most likely alternatives per position (vLLM's default bound, OpenAI's top_logprobs)
MAX_LOGPROB_ENTRIES = 1 << 16  # logprobs one request may ask for, alternatives included: keeps replies < 1 MiB


def check_logprobs(logprobs: int | None, prompt_logprobs: int | None) -> None:
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"field '{name}': must be between 0 and {MAX_LOGPROBS}, got {value}")


def check_logprob_size(req: "GenerateRequest", prompt_tokens: int) -> None:
    """Every reported logprob travels in one reply (unary) or one chunk (prompt logprobs); a request
    whose logprobs could not fit in a message is refused before any work is done."""
    entries = 0
    if req.logprobs is not None:
        entries += (req.logprobs + 1) * req.max_tokens
    if req.prompt_logprobs is not None:
        entries += (req.prompt_logprobs + 1) * prompt_tokens
    if entries > MAX_LOGPROB_ENTRIES:
        raise BatonError(ErrorCode.TOO_LARGE, f"logprobs for {prompt_tokens} prompt and {req.max_tokens} completion "
                         f"tokens come to {entries} values; the limit is {MAX_LOGPROB_ENTRIES} (ask for fewer "
                         f"alternatives or fewer tokens)")


MAX_DRAFT_TOKENS = 16  # also the bound on a deployment's --draft-tokens (shared/config.py, SpecConfig)


def check_draft_tokens(draft_tokens: int | None) -> None:
    """A per-request cap on speculation: it lowers the deployment's K (0: no drafts), never raises
    it (KV is reserved for K drafts). Any k leaves the output the target's: verification keeps
    greedy tokens exact and sampled ones distributed as the target's."""
    if draft_tokens is not None and not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise bad_request(f"field 'draft_tokens': must be between 0 and {MAX_DRAFT_TOKENS}, got {draft_tokens}")


class Logprobs(Part):
    """Log-probabilities of a run of tokens under the target model: the log-softmax of its raw
    logits (no temperature, no top-p), the same with speculation on or off. Position i: token
    token_ids[i] had logprob logprobs[i]; top_ids[i] / top_logprobs[i] are the most likely tokens
    there, most likely first (as many as the request asked for)."""

    token_ids: list[TokenId] = []
    logprobs: list[Finite] = []
    top_ids: list[list[TokenId]] = []
    top_logprobs: list[list[Finite]] = []

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not len(self.logprobs) == len(self.top_ids) == len(self.top_logprobs) == n:
            raise bad_request(f"logprobs: {n} tokens need as many 'logprobs', 'top_ids' and 'top_logprobs'")
        if any(len(i) != len(v) or len(i) > MAX_LOGPROBS for i, v in zip(self.top_ids, self.top_logprobs)):
            raise bad_request(f"logprobs: 'top_ids' and 'top_logprobs' differ, or exceed {MAX_LOGPROBS} per position")

    def __add__(self, other: "Logprobs") -> "Logprobs":
        return Logprobs.joined([self, other])

    @staticmethod
    def joined(runs: list["Logprobs"]) -> "Logprobs":
        """Consecutive runs as one, in one pass (adding them one at a time would copy n² entries)."""
        return Logprobs(token_ids=[t for r in runs for t in r.token_ids], logprobs=[v for r in runs for v in r.logprobs],
                        top_ids=[i for r in runs for i in r.top_ids], top_logprobs=[v for r in runs for v in r.top_logprobs])

    def __getitem__(self, part: slice) -> "Logprobs":
        return Logprobs(token_ids=self.token_ids[part], logprobs=self.logprobs[part], top_ids=self.top_ids[part],
                        top_logprobs=self.top_logprobs[part])


class Usage(Part):
    prompt_tokens: Count
    completion_tokens: Count
    cached_tokens: Count = 0  # of the prompt's tokens, those prefill took from its prefix cache


class SpecStats(Part):
    """Speculative decoding counters; all zero when speculation is off."""

    verify_steps: Count = 0  # target forwards that verified drafts
    drafted: Count = 0  # draft tokens proposed
    accepted: Count = 0  # draft tokens accepted

    def __post_init__(self) -> None:
        if self.accepted > self.drafted:
            raise bad_request(f"field 'accepted': {self.accepted} exceeds drafted ({self.drafted})")

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class Timing(Part):
    ttft_ms: Millis  # request received -> first token
    total_ms: Millis  # request received -> last token


class GenerateReply(Message):
    """The one reply to a non-streaming generate."""

    request_id: RequestId
    token_ids: list[TokenId]
    text: str
    finish_reason: FinishReason
    usage: Usage
    spec: SpecStats
    timing: Timing
    logprobs: Logprobs | None = None  # of token_ids, when the request asked for logprobs
    prompt_logprobs: Logprobs | None = None  # of the prompt's tokens from the second on, when asked for
    prompt_token_ids: list[TokenId] | None = None  # the whole prompt, with prompt_logprobs


class StreamChunk(Message):
    """One message of a streaming generate; the last has finished=True and the summary fields."""

    request_id: RequestId
    token_ids: list[TokenId]  # new tokens since the previous chunk
    text: str  # new text since the previous chunk
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    spec: SpecStats | None = None
    timing: Timing | None = None
    logprobs: Logprobs | None = None  # of this chunk's token_ids, when the request asked for logprobs
    prompt_logprobs: Logprobs | None = None  # on the first chunk with tokens, when the request asked for them
    prompt_token_ids: list[TokenId] | None = None  # the whole prompt, with prompt_logprobs

    def __post_init__(self) -> None:
        summary = (self.finish_reason, self.usage, self.spec, self.timing)
        if self.finished and None in summary:
            raise bad_request("a finished chunk needs 'finish_reason', 'usage', 'spec' and 'timing'")
        if not self.finished and summary != (None, None, None, None):
            raise bad_request("summary fields are only allowed on the finished chunk")


class CancelRequest(Message):
    request_id: RequestId


class CancelReply(Message):
    request_id: RequestId
    cancelled: bool  # False: unknown or already finished (not an error)
