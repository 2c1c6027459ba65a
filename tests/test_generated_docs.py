"""Every generated block of the docs is what its generator produces today (issue 27).

A block is the text between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in a markdown file of the repository. Each one
is either generated (listed in ``GENERATORS`` with the command that rewrites it, and regenerated here), checked
by the tests of its own generator (``CHECKED_ELSEWHERE``), or written by hand from a measured run
(``HAND_WRITTEN``). A new block must be put in one of the three: a table typed by hand where a generator exists
drifts from it (the diagnosis table's line numbers did).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from instruments import arguments_table, event_fields, readme_table
from lightning_numguard.detect.registry import kinds_table

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- ([A-Z][A-Z0-9 ]+) -->\n(.*?)\n<!-- /\1 -->", re.S)


def _benchmark_table() -> str:
    results = json.loads((ROOT / "benchmarks" / "results" / "overhead.json").read_text(encoding="utf-8"))
    return readme_table.table(results)


#: (file, block) -> (generator, the command that rewrites the block)
GENERATORS: dict[tuple[str, str], tuple[Callable[[], str], str]] = {
    ("docs/reference.md", "EVENT FIELDS"): (
        event_fields.table,
        "python -m benchmarks.event_fields --write docs/reference.md",
    ),
    ("docs/reference.md", "ARGUMENTS"): (
        arguments_table.table,
        "python -m benchmarks.arguments_table --write docs/reference.md",
    ),
    ("README.md", "EVENT KINDS"): (kinds_table, "python -m benchmarks.kinds_table --write README.md"),
    ("README.md", "BENCHMARK TABLE"): (
        _benchmark_table,
        "python -m benchmarks.readme_table benchmarks/results/overhead.json --write README.md",
    ),
}
#: Blocks regenerated and compared by their generator's own tests (tests/diagnosis).
CHECKED_ELSEWHERE = {
    # tests/diagnosis/real/test_real_models.py::test_committed_tables_are_current regenerates these from real fits
    ("README.md", "DIAGNOSIS TABLE"),
    ("docs/diagnosis.md", "DIAGNOSIS TABLE"),
    ("docs/diagnosis.md", "REAL DIAGNOSIS TABLE"),
    ("docs/diagnosis.md", "SCENARIO TABLE"),
    ("docs/diagnosis.md", "ANOMALY TABLE"),
}
#: Blocks with no generator: written from a measured run or by hand, each held by tests of what it states.
HAND_WRITTEN = {("README.md", "SUPPORT MATRIX"), ("benchmarks/README.md", "FSDP2 RESULT")}


def _blocks() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for path in sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("benchmarks/*.md")):
        for name, text in BLOCK.findall(path.read_text(encoding="utf-8")):
            found[(path.relative_to(ROOT).as_posix(), name)] = text
    return found


def test_every_block_is_generated_checked_elsewhere_or_hand_written() -> None:
    blocks = set(_blocks())
    known = set(GENERATORS) | CHECKED_ELSEWHERE | HAND_WRITTEN
    assert blocks - known == set(), "a block nobody regenerates: add its generator to GENERATORS"
    assert set(GENERATORS) <= blocks, "a generated block is gone from its file"


@pytest.mark.parametrize("key", sorted(GENERATORS), ids=lambda key: f"{key[0]}:{key[1]}")
def test_the_block_is_what_its_generator_produces(key: tuple[str, str]) -> None:
    generate, command = GENERATORS[key]
    assert _blocks()[key] == generate(), f"{key[0]}'s {key[1]} is out of date; run `{command}`"
