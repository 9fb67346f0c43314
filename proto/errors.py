"""Error codes, the exception that carries them, and the error reply that puts them on the wire."""
from __future__ import annotations

from enum import Enum

from .message import Message, Part


class ErrorCode(str, Enum):
    """Stable codes: clients branch on these, never on messages."""

    BAD_REQUEST = "bad_request"  # malformed, unknown version, wrong type, out of range
    TOO_LARGE = "too_large"  # over the NATS max payload or a configured size limit
    BUSY = "busy"  # no capacity now; retry later
    TIMEOUT = "timeout"  # a deadline passed before an answer
    INTERNAL = "internal"  # a bug or an unexpected failure; logged with the request id
    UNAVAILABLE = "unavailable"  # nobody serves the subject, or the service is shutting down
    DUPLICATE_WORKER = "duplicate_worker"  # another live instance holds this worker id


class BatonError(Exception):
    """An error with a stable code; `Bus.serve` turns it into an `ErrorReply`."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code = ErrorCode(code)
        self.message = message

    def to_reply(self) -> ErrorReply:
        return ErrorReply(error=ErrorDetail(code=self.code, message=self.message))


class NotListening(BatonError):
    """`unavailable` because nobody subscribes to the subject (NATS "no responders"): whoever
    served it is gone, or (just after it joined, or after a reconnect) not subscribed yet."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.UNAVAILABLE, message)


def bad_request(message: str) -> BatonError:
    return BatonError(ErrorCode.BAD_REQUEST, message)


class ErrorDetail(Part):
    code: ErrorCode
    message: str


class ErrorReply(Message):
    """The reply to any request that failed: {"v": 1, "error": {"code": ..., "message": ...}}."""

    error: ErrorDetail

    def to_exception(self) -> BatonError:
        return BatonError(self.error.code, self.error.message)
