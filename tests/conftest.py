"""Fixtures shared by every test module."""
from __future__ import annotations

import pytest

from baton.shared.bus.server import NatsServer


@pytest.fixture(scope="session")
def nats_server() -> str:
    """URL of a real nats-server (JetStream on, temporary store) shared by the whole session."""
    with NatsServer() as server:
        yield server.url
