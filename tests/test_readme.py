"""The README says what is true: its commands are the ones CI runs, its links resolve, its benchmark
table is the one generated from the committed results file."""

from __future__ import annotations

import json
import re
from pathlib import Path

from instruments.readme_table import table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def block(name: str) -> str:
    match = re.search(rf"<!-- {name} -->\n(.*?)\n<!-- /{name} -->", README, re.S)
    assert match, f"README.md has no {name} block"
    return match.group(1)


def test_the_two_commands_are_the_ones_ci_runs():
    commands = re.findall(r"```bash\n(.+?)\n```", README.split("## The two commands", 1)[1])[:2]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for command in commands:
        assert command in ci, command
    assert ci[-1] == commands[1], "the README's test command is the last step of .ci/run"


def test_every_relative_link_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links to its docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_the_benchmark_table_is_generated_from_the_results_file():
    results = json.loads((ROOT / "benchmarks" / "results" / "overhead.json").read_text(encoding="utf-8"))
    assert block("BENCHMARK TABLE") == table(results)


def test_the_readme_stays_short():
    assert len(README.splitlines()) < 340  # three front doors: the Trainer, Fabric (LitGPT) and a plain loop
