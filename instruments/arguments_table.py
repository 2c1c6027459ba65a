"""The table of arguments in ``docs/reference.md``, rendered from their declarations (never typed by hand).

Every argument is declared once (:class:`~lightning_numguard.config.arguments.GuardConfig`; a group's fields in
:mod:`~lightning_numguard.config.groups`). ``python -m benchmarks.arguments_table`` prints the markdown;
``--write docs/reference.md`` replaces the block between ``<!-- ARGUMENTS -->`` and ``<!-- /ARGUMENTS -->``.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from instruments.markdown import replace_block
from lightning_numguard.config.arguments import GuardConfig
from lightning_numguard.config.groups import GROUPS, field_docs

__all__ = ["main", "table"]


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|")


def _default(value: Any) -> str:
    return f"`{value!r}`".replace("|", "\\|")


def table() -> str:
    """One row per top-level argument, then one per field of each group (``spikes.sigma``); the flat names kept from
    before the groups last, each with the place it moved to."""
    lines = ["| argument | default | meaning |", "|---|---|---|"]
    moved = []
    for name, arg in GuardConfig.__arguments__.items():
        if arg.moved_to is not None:
            moved.append(f"`{name}` → `{arg.moved_to}`")
            continue
        if name in GROUPS:
            group = GROUPS[name]
            lines.append(f"| `{name}` | `{group.__name__}()` | {_cell(arg.doc)}: |")
            docs = field_docs(group)
            for f in fields(group):
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                lines.append(f"| `{name}.{f.name}` | {_default(default)} | {_cell(docs[f.name])} |")
            continue
        lines.append(f"| `{name}` | {_default(arg.default_value())} | {_cell(arg.doc)} |")
    lines.append(f"| deprecated flat names | | accepted and mapped, with a `DeprecationWarning`: {', '.join(moved)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.arguments_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", help="a markdown file whose ARGUMENTS block is replaced (docs/reference.md)")
    args = p.parse_args(argv)
    if not args.write:
        print(table())
        return
    replace_block(args.write, "ARGUMENTS", table())


if __name__ == "__main__":
    main()
