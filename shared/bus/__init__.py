"""Typed NATS bus for Baton services (see proto/README.md for subjects and messages)."""
from .bus import Bus
from .endpoint import Endpoint, EndpointStats
from .server import NatsServer, NatsServerError
from .stream import ReplyStream

__all__ = ["Bus", "Endpoint", "EndpointStats", "NatsServer", "NatsServerError", "ReplyStream"]
