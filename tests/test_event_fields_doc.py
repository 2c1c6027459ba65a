"""The event schema is declared once, on ``Event``: its docstring and ``docs/reference.md``'s table of fields are
rendered from that declaration."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest

from instruments.event_fields import table
from lightning_numguard.reporting.events import REQUIRED_FIELDS, Event, field_docs

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python -m benchmarks.event_fields --write docs/reference.md"


def _block(text: str) -> str:
    match = re.search(r"<!-- EVENT FIELDS -->\n(.*?)\n<!-- /EVENT FIELDS -->", text, re.S)
    assert match, "docs/reference.md has no EVENT FIELDS block"
    return match.group(1)


def test_the_reference_table_is_the_one_rendered_from_event():
    doc = _block((ROOT / "docs" / "reference.md").read_text(encoding="utf-8"))
    assert doc == table(), f"docs/reference.md's table of event fields is out of date; run `{REGENERATE}`"


def test_the_table_has_one_row_per_field_with_the_required_ones_marked():
    rows = [re.match(r"\| `(\w+)` \| `[^`]+` \| (yes)? \|", line) for line in table().splitlines()[2:]]
    assert all(rows)
    assert [r.group(1) for r in rows if r] == [f.name for f in fields(Event)]
    assert [r.group(1) for r in rows if r and r.group(2)] == list(REQUIRED_FIELDS)


def test_the_docstring_lists_every_field_with_its_doc():
    text = " ".join((Event.__doc__ or "").split())  # the lines are wrapped
    for name, doc in field_docs(Event).items():
        assert f"{name}: {doc}" in text


def test_a_field_without_documentation_is_refused():
    @dataclass
    class Half:
        a: int = field(metadata={"doc": "documented"})
        b: int = 0

    with pytest.raises(TypeError, match=r"Half fields \['b'\] have no documentation"):
        field_docs(Half)
