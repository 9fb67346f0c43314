"""Fixtures shared by every test module."""
from __future__ import annotations

import os

import pytest

from baton.shared.bus.server import NatsServer

# Every process the tests start on this machine gives UCX TCP lanes on loopback only. UCX opens
# lanes on every interface present when a process starts; the multihost tests create and delete a
# bridge interface in this namespace, and a cluster of another test running beside them (two at a
# time, pytest-xdist) then had its WRITEs stall until the transfer deadline (30 s): reproduced by
# deleting a veth beside a running cluster (the next request took 30.2 s; 0.07 s with this set).
# The multihost hosts set their own (`UCX_NET_DEVICES=eth0`, tests/multihost.py), and the
# container tier's compose project does not get it (tests/test_containers.py).
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(scope="session")
def nats_server() -> str:
    """URL of a real nats-server (JetStream on, temporary store) shared by the whole session."""
    with NatsServer() as server:
        yield server.url



@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the logs its fixtures offer (`item.logs_on_failure`, a list
    of callables returning text), printed under the failure (a test's exception never reaches a
    fixture's yield, so a fixture cannot print them itself)."""
    report = yield
    if report.when == "call" and report.failed:
        for logs in getattr(item, "logs_on_failure", ()):
            report.sections.append(("service logs", logs()))
    return report
