"""Replace a generated block of a markdown file: the text between ``<!-- NAME -->`` and ``<!-- /NAME -->``."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["replace_block"]


def replace_block(path: str | Path, name: str, text: str) -> None:
    """Put ``text`` between the ``<!-- name -->`` and ``<!-- /name -->`` markers of ``path``.

    Raises:
        SystemExit: the file has no such pair of markers (add them first).
    """
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    target = Path(path)
    doc = target.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{target}: no {begin} ... {end} block to replace; add the two markers first")
    target.write_text(pattern.sub(lambda _: f"{begin}\n{text}\n{end}", doc), encoding="utf-8")
