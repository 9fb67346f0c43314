"""proto/README.md documents every subject, message, field and error code that the code defines."""
from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from baton.proto import subjects
from baton.proto.errors import ErrorCode
from proto_examples import message_classes

pytestmark = pytest.mark.unit

README = (Path(subjects.__file__).parent / "README.md").read_text()


def test_every_subject_is_documented():
    names = [value for name, value in vars(subjects).items() if name.isupper() and isinstance(value, str)]
    per_worker = (subjects.decode_reserve, subjects.decode_release, subjects.decode_prefixes, subjects.prefill_dispatch,
                  subjects.prefill_target, subjects.prefill_release, subjects.prefill_prefixes)
    names += [subject("WID").replace("WID", "<worker_id>") for subject in per_worker]
    missing = [name for name in names if f"`{name}" not in README]
    assert missing == []


def test_every_message_and_field_is_documented():
    missing = []
    for cls in message_classes():
        if not re.search(rf"`{cls.__name__}\b", README):
            missing.append(cls.__name__)
        missing += [f"{cls.__name__}.{f.name}" for f in msgspec.structs.fields(cls) if f.name not in README]
    assert missing == []


def test_every_error_code_is_documented():
    assert [code.value for code in ErrorCode if f"`{code.value}`" not in README] == []
