"""Every test the docs name as evidence exists: the support matrix and the strategies page cite tests by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/support-matrix.md", "docs/strategies.md", "docs/performance.md", "docs/diagnosis.md")
#: ``test_x.py`` (optionally ``::name``), or ``::name`` alone, which belongs to the file named last before it
REFERENCE = re.compile(r"(test_\w+\.py)(?:::([\w*]+))?|`::([\w*]+)")


def defined_tests() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in ROOT.glob("tests/**/test_*.py"):
        found.setdefault(path.name, set()).update(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    return found


def references(text: str) -> list[tuple[str, str | None]]:
    """``(file, test name or None)`` for every reference in ``text``; a name may end in ``*`` (a prefix)."""
    out: list[tuple[str, str | None]] = []
    current = ""
    for match in REFERENCE.finditer(text):
        if match.group(1):
            current = match.group(1)
            out.append((current, match.group(2)))
        elif current:
            out.append((current, match.group(3)))
    return out


def _exists(name: str | None, names: set[str]) -> bool:
    if name is None:
        return True
    if name.endswith("*"):
        return any(n.startswith(name[:-1]) for n in names)
    return name in names


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc):
    tests = defined_tests()
    refs = references((ROOT / doc).read_text(encoding="utf-8"))
    missing = [f"{f}::{n}" if n else f for f, n in refs if f not in tests or not _exists(n, tests[f])]
    assert missing == [], f"{doc} names tests that do not exist"


def test_the_reference_reader_catches_a_wrong_name():
    tests = {"test_a.py": {"test_one"}}
    refs = references("shown by `test_a.py::test_one`, `::test_two` and `test_b.py`")
    assert refs == [("test_a.py", "test_one"), ("test_a.py", "test_two"), ("test_b.py", None)]
    assert [r for r in refs if r[0] not in tests or not _exists(r[1], tests[r[0]])] == refs[1:]
