"""Subject names: versioned, public and internal apart, worker ids checked."""
from __future__ import annotations

import pytest

from baton.proto import subjects

pytestmark = pytest.mark.unit


def test_public_and_internal_prefixes_are_separate():
    assert subjects.GENERATE == "baton.v1.generate" and subjects.CANCEL == "baton.v1.cancel"
    internal = [subjects.REGISTER, subjects.HEARTBEAT, subjects.DEREGISTER, subjects.LOOKUP, subjects.PLAN,
                subjects.WORKER_EVENTS, subjects.decode_reserve("d0"), subjects.decode_release("d0"),
                subjects.prefill_dispatch("p0")]
    assert all(name.startswith("baton.internal.v1.") for name in internal)
    assert len(set(internal)) == len(internal)


def test_per_worker_subjects():
    assert subjects.decode_reserve("decode-0") == "baton.internal.v1.decode.decode-0.reserve"
    assert subjects.prefill_dispatch("p_1") == "baton.internal.v1.prefill.p_1.dispatch"


@pytest.mark.parametrize("worker_id", ["", "a.b", "*", ">", "a b", "x" * 65, None])
def test_worker_ids_that_would_break_subjects_are_refused(worker_id):
    with pytest.raises(ValueError):
        subjects.decode_reserve(worker_id)
