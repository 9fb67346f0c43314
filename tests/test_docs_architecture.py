"""docs/architecture.md names code: every `path.py` it names exists, every `Class.member` is a
member of that class in the code, and every `tests/file.py::test` it gives a hop exists. A
rename that leaves the walk of one request behind fails here."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
SOURCES = [p.read_text() for d in ("baton", "services", "shared", "proto", "kernels") for p in (ROOT / d).rglob("*.py")]


def named(pattern: str) -> list[str]:
    return sorted({m[1] for m in re.finditer(rf"`({pattern})`", DOC)})


def class_source(name: str) -> str:
    """The text of `class name` (to the next top-level statement), wherever it is defined."""
    for text in SOURCES:
        if found := re.search(rf"^class {name}\b.*?(?=^\S|\Z)", text, re.M | re.S):
            return found[0]
    raise AssertionError(f"docs/architecture.md names class {name}, which no module defines")


def test_named_files_exist():
    missing = [path for path in named(r"[\w/]+\.py") if not (ROOT / path).is_file()]
    assert not missing, missing


def test_named_members_are_in_their_class():
    members = named(r"[A-Z]\w*\.\w+")
    absent = [m for m in members if not re.search(rf"\b{m.split('.')[1]}\b", class_source(m.split(".")[0]))]
    assert len(members) > 50 and not absent, absent


def test_named_tests_exist():
    tests = named(r"tests/\w+\.py::\w+")
    absent = [t for t in tests if not re.search(rf"^(async )?def {t.split('::')[1]}\(",
                                                 (ROOT / t.split("::")[0]).read_text(), re.M)]
    assert len(tests) > 15 and not absent, absent
