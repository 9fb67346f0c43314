"""The public API's one surface for a request in flight (`RequestFlow`): the router's Flow and the
aggregated baseline's Job both have it, so a change to it breaks neither silently."""
import asyncio
import typing

import pytest

from baton.proto.internal import SamplingParams
from baton.services.aggregated.engine import Job
from baton.services.router.flow import Flow, RouterTimeouts
from baton.services.router.public import Outcome, RequestFlow
from baton.shared.config import RouterSection
from baton.shared.engine.sampling import SamplingParams as EngineSampling
from baton.shared.engine.sequence import Sequence

pytestmark = pytest.mark.unit


def flows() -> list:
    flow = Flow(None, None, None, RouterTimeouts.of(RouterSection()), "r1", [1, 2], 4, SamplingParams(), None)
    job = Job(Sequence("r2", [1, 2], 4, EngineSampling()), None, lambda: None)
    return [flow, job]


@pytest.mark.parametrize("flow", flows(), ids=["Flow", "Job"])
def test_the_router_flow_and_the_aggregated_job_are_request_flows(flow):
    assert isinstance(flow, RequestFlow)  # every method and attribute PublicAPI uses is there
    assert type(flow.outcome) is Outcome  # the one Outcome type
    hints = typing.get_type_hints(RequestFlow)
    for name in hints:
        assert hasattr(flow, name), name
    assert asyncio.iscoroutinefunction(flow.tokens) is False and hasattr(flow.tokens(), "__anext__")
