"""The real-model diagnosis table, as markdown: one line per row from its :class:`~harness.Result` (pure; the
generator ``benchmarks/diagnosis_table.py`` and the test that the committed table is current both use it)."""

from __future__ import annotations

import os
from importlib.metadata import version

from instruments.diagnosis.real.harness import ROOT, Leaf, Result, marker_line

HEADER = (
    "| # | model | fault | the fault is at | guard: kind | guard: module | guard: op | guard: line | right? |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def versions() -> str:
    """The versions the table was generated with (library line numbers depend on them)."""
    return ", ".join(f"{name} {version(name)}" for name in ("torch", "pytorch-lightning", "transformers"))


def _at(path: str | None, line: int | None) -> str:
    return f"{os.path.basename(path)}:{line}" if path and line else "—"


def _module(name: str | None, root_name: str) -> str:
    if name is None:
        return "—"
    return f"`{name}`" if name != ROOT else f'`""` ({root_name})'


def fault_at(result: Result) -> str:
    """Where the fault is: ``file:line``, and the module (or the parameter / batch field a leaf names)."""
    row, want = result.row, result.want
    if isinstance(row.fault, Leaf):
        return f"`{want.where}` (made non-finite at {_at(row.file, marker_line(row.file, row.fault.tag))})"
    return f"{_at(want.file, want.line)}, {_module(want.module, result.root_name)}"


def guard_source(event: dict) -> str:
    source = event.get("source")
    if not source or ":" not in source:
        return "—"
    path, line = source.rsplit(":", 1)
    return f"{os.path.basename(path)}:{line}"


def verdict(result: Result) -> str:
    """✓ or ✗ with the fields that differ; and the ops other events blame although they are not the fault."""
    text = "✓" if result.right else "✗ " + ", ".join(result.wrong)
    return text + (f"; other events blame {', '.join(result.stray)}" if result.stray else "")


def line_of(index: int, result: Result) -> str:
    """One row of the full table."""
    e, row = result.event, result.row
    kind = e.get("kind", "nothing found")
    if e and isinstance(row.fault, Leaf):
        kind += f" `{', '.join((e.get('where') or [])[:2])}`"
    extra = [f"batch_idx {e.get('batch_idx')}" if row.batch_idx is not None else "", row.note]
    note = "; ".join(x for x in extra if x)
    fault = row.story + (f" ({note})" if note else "")
    module = _module(e.get("module"), result.root_name) if e else "—"
    return (
        f"| {index} | {row.model} | {fault} | {fault_at(result)} | {kind} | {module} | {e.get('op') or '—'} "
        f"| {guard_source(e)} | {verdict(result)} |"
    ).replace("\n", " ")


def family(result: Result) -> str:
    model = result.row.model
    if model.startswith("HF "):
        return "Hugging Face `transformers`"
    return "Lightning's demos" if model.startswith("Lightning demo") else "user-style code"


def full_table(results: list[Result]) -> str:
    return "\n".join([HEADER, *(line_of(i, r) for i, r in enumerate(results, 1))])


def short_table(results: list[Result]) -> str:
    """The README's summary: rows right per family, and the rows named wrong."""
    right = sum(r.right for r in results)
    lines = [
        f"{right} of {len(results)} rows right ([docs/diagnosis.md](docs/diagnosis.md)).",
        "",
        "| code | rows | right | named wrong |",
        "|---|---|---|---|",
    ]
    for name in dict.fromkeys(family(r) for r in results):
        rows = [r for r in results if family(r) == name]
        wrong = ", ".join(f"`{r.row.name}`" for r in rows if not r.right) or "—"
        lines.append(f"| {name} | {len(rows)} | {sum(r.right for r in rows)} | {wrong} |")
    return "\n".join(lines)
