"""The table of event fields in ``docs/reference.md``, rendered from ``Event``'s own declaration (never typed by hand).

``python -m benchmarks.event_fields`` prints the markdown; ``--write docs/reference.md`` replaces the block between
``<!-- EVENT FIELDS -->`` and ``<!-- /EVENT FIELDS -->`` in that file instead.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from instruments.markdown import replace_block
from lightning_numguard.reporting.events import REQUIRED_FIELDS, Event, field_docs

__all__ = ["main", "table"]


def table() -> str:
    """One row per field of ``Event``, in declaration order: its name, type, whether a reader requires it, its doc."""
    docs = field_docs(Event)
    lines = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for f in fields(Event):
        kind = str(f.type).replace("|", "\\|")  # the annotation as written (``from __future__ import annotations``)
        required = "yes" if f.name in REQUIRED_FIELDS else ""
        meaning = docs[f.name].replace("``", "`").replace("|", "\\|")  # markdown code spans; max-|x| in a cell
        lines.append(f"| `{f.name}` | `{kind}` | {required} | {meaning} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.event_fields", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", help="a markdown file whose EVENT FIELDS block is replaced (docs/reference.md)")
    args = p.parse_args(argv)
    if not args.write:
        print(table())
        return
    replace_block(args.write, "EVENT FIELDS", table())


if __name__ == "__main__":
    main()
