"""The README's table of event kinds, rendered from the checks' declaration (``core/registry``), never by hand.

``python -m benchmarks.kinds_table`` prints the markdown; ``--write README.md`` replaces the block between
``<!-- EVENT KINDS -->`` and ``<!-- /EVENT KINDS -->`` in that file instead.
"""

from __future__ import annotations

import argparse

from instruments.markdown import replace_block
from lightning_numguard.detect.registry import kinds_table

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kinds_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", help="a markdown file whose EVENT KINDS block is replaced (README.md)")
    args = p.parse_args(argv)
    if not args.write:
        print(kinds_table())
        return
    replace_block(args.write, "EVENT KINDS", kinds_table())


if __name__ == "__main__":
    main()
