"""Encoding for the wire and the one mapping from nats-py exceptions to Baton error codes."""
from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import Any, Iterator, TypeVar

import nats.errors

from baton.proto.codec import decode, decode_reply, encode
from baton.proto.errors import BatonError, ErrorCode, ErrorReply, NotListening
from baton.proto.limits import Limits

M = TypeVar("M")

NOT_CONNECTED = (
    nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError, nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError, nats.errors.NoServersError,
)


def decode_event(data: bytes, cls: type[M], logger: logging.Logger) -> M | None:
    """A published message nobody answers (an event): the message, or None after logging why it
    was malformed (there is no one to send an error reply to)."""
    try:
        return decode(data, cls)
    except BatonError as exc:
        logger.warning("ignored a malformed %s: %s", cls.__name__, exc)
        return None


def connection_epoch(nc) -> int:
    """Which connection to a server `nc` is on, counting the one it is reconnecting to. Core NATS
    keeps nothing across a reconnect: a message sent around it may be lost, a subscription's
    messages meanwhile are, so whoever sees the epoch change mid-conversation must assume a gap."""
    return nc.stats["reconnects"] + (0 if nc.is_connected else 1)


def encode_for(subject: str, message: Any, max_payload: int) -> bytes:
    """Encode `message`, refusing with too_large what the server would refuse to carry."""
    data = encode(message)
    if len(data) > max_payload:
        raise BatonError(ErrorCode.TOO_LARGE,
                         f"{type(message).__name__} for {subject} is {len(data)} bytes; the NATS server "
                         f"accepts at most {max_payload} bytes per message (max_payload)")
    return data


def decode_reply_from(subject: str, data: bytes, cls: type[M], limits: Limits) -> M:
    """A reply of type `cls`; an error reply is raised as its BatonError, a malformed one as internal."""
    try:
        reply = decode_reply(data, cls, limits)
    except BatonError as exc:
        raise BatonError(ErrorCode.INTERNAL, f"malformed reply from {subject}: {exc.message}") from exc
    if isinstance(reply, ErrorReply):
        raise reply.to_exception()
    return reply


@contextmanager
def nats_errors_mapped(subject: str, timeout: float | None = None) -> Iterator[None]:
    try:
        yield
    except nats.errors.NoRespondersError:
        raise NotListening(f"no service is listening on {subject}") from None
    except asyncio.TimeoutError:  # nats.errors.TimeoutError included
        raise BatonError(ErrorCode.TIMEOUT, f"no reply from {subject} within {timeout:g} s") from None
    except nats.errors.MaxPayloadError:
        raise BatonError(ErrorCode.TOO_LARGE, f"message for {subject} exceeds the NATS max_payload") from None
    except NOT_CONNECTED as exc:
        raise BatonError(ErrorCode.UNAVAILABLE,
                         f"cannot reach NATS for {subject}: {type(exc).__name__} {exc}".rstrip()) from None


async def gone(nc, probe: str, timeout: float) -> bool:
    """Whether the sender whose probe subject is `probe` is gone: nats-server answers a ping to it
    with "no responders". A live sender's subscription takes the ping and ignores it (a timeout
    here), as does a NATS that cannot be reached for now."""
    try:
        await nc.request(probe, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        return True
    except (asyncio.TimeoutError, nats.errors.Error):
        pass
    return False
