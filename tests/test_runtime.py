"""services/runtime.py: the loop's exception handler keeps nats-py's reconnect noise quiet and
nothing else."""
import asyncio
import gc
import logging
import socket

import pytest

from baton.services.runtime import quiet_reconnect_noise

pytestmark = pytest.mark.unit


def abandon_future_failing_with(exc: Exception) -> None:
    """A future that fails and is never awaited, as nats-py leaves one behind a connect timeout."""
    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(quiet_reconnect_noise)
        asyncio.get_running_loop().create_future().set_exception(exc)
        gc.collect()  # the future is garbage now: asyncio reports it was never retrieved
    asyncio.run(scenario())


@pytest.fixture(autouse=True)
def earlier_garbage_collected(caplog):
    """Futures other tests left behind are reported when collected: collect them first, so what
    these tests read is only what their own future caused."""
    gc.collect()
    caplog.clear()


def test_a_late_name_lookup_failure_is_one_debug_line(caplog):
    with caplog.at_level(logging.DEBUG):
        abandon_future_failing_with(socket.gaierror(-3, "Temporary failure in name resolution"))
    assert [r.levelname for r in caplog.records if "name lookup" in r.getMessage()] == ["DEBUG"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_any_other_unretrieved_exception_is_still_an_error(caplog):
    abandon_future_failing_with(ValueError("a real bug"))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "never retrieved" in errors[0].getMessage()
