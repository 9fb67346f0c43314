"""shared/wake_latency.py: the PM QoS request an engine holds, on a file standing in for the device."""
import asyncio
import logging
import struct

import pytest

from baton.services.aggregated.engine import AggregatedEngine
from baton.shared import wake_latency
from baton.shared.config import ConfigError, WorkerSection, check_section
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model


def test_the_request_is_the_latency_as_a_native_int32_held_while_the_file_is_open(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.touch()
    held = wake_latency.hold(0, device)
    assert not held.closed and device.read_bytes() == struct.pack("=i", 0)
    held.close()
    again = wake_latency.hold(75, device)
    assert device.read_bytes() == struct.pack("=i", 75)
    again.close()


def test_leave_asks_nothing(tmp_path):
    assert wake_latency.hold(wake_latency.LEAVE, tmp_path / "absent") is None
    assert not (tmp_path / "absent").exists()


def test_a_device_this_process_cannot_open_is_a_warning_not_an_error(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "baton.shared.wake_latency"):
        assert wake_latency.hold(0, tmp_path / "no" / "such" / "device") is None
    assert "cpu_wake_latency_us 0 not applied: cannot open" in caplog.text


def test_an_engine_holds_the_request_from_start_until_it_closes(tmp_path, monkeypatch):
    device = tmp_path / "cpu_dma_latency"
    device.touch()
    monkeypatch.setattr(wake_latency, "CPU_LATENCY_QOS", device)
    engine = AggregatedEngine(load_model(DEFAULT_MODEL_DIR, projection="blas"), WorkerSection(cpu_wake_latency_us=0))
    assert device.read_bytes() == struct.pack("=i", 0) and not engine.wake_latency.closed
    asyncio.run(engine.close())
    assert engine.wake_latency.closed


def test_the_setting_is_minus_one_or_more():
    with pytest.raises(ConfigError, match="cpu_wake_latency_us"):
        check_section(WorkerSection(cpu_wake_latency_us=-2))
