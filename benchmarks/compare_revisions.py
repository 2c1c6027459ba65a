"""Same command, same run: the guard of another git revision against this checkout's.

    python -m benchmarks.compare_revisions --before REV [benchmarks.overhead options]

The package as it was at ``REV`` is extracted (``git archive``) into a temporary folder under the
name ``lightning_numguard_before`` (its absolute imports rewritten to that name), and the run gets
the variants ``before_numguard_default`` and ``before_numguard_all``, timed in the same interleaved
rounds as this checkout's ``numguard_default`` and ``numguard_all`` and the plain baseline. A
refactoring is "no slower" when its ratios to the shared baseline are no higher than the old ones.

Example (the figures of the redesign in CHANGELOG.md)::

    python -m benchmarks.compare_revisions --before 5ba7ae0 --rounds 8 --steps 30 --warmup 6 \\
        --models mlp,cnn,lm --no-micro --no-counts --out benchmarks/results/redesign
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import overhead, variants

ROOT = Path(__file__).resolve().parents[1]
ALIAS = "lightning_numguard_before"


def extract(rev: str, into: Path) -> Path:
    """The package at ``rev`` as ``into/lightning_numguard_before``, its imports rewritten."""
    archive = into / "before.tar"
    subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(archive), rev, "lightning_numguard"], cwd=ROOT, check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "lightning_numguard"
    for path in pkg.rglob("*.py"):
        path.write_text(re.sub(r"\blightning_numguard\b", ALIAS, path.read_text()))
    return pkg.rename(into / ALIAS)


def register(before: Any) -> None:
    """Add the ``before_*`` variants to the variant table used by the harness."""
    make = variants.make_variant
    old = before.NumGuardCallback

    def make_variant(name: str, tmp: Path) -> tuple[dict[str, Any], list[Any]]:
        if name == "before_numguard_default":
            return {}, [old(dirpath=str(tmp / "numguard"))]
        if name == "before_numguard_all":
            return {}, [old(dirpath=str(tmp / "numguard"), check=list(variants.ALL_CHECKS))]
        return make(name, tmp)

    extra = ("before_numguard_default", "before_numguard_all")
    variants.make_variant = make_variant
    variants.VARIANTS = (*variants.VARIANTS, *extra)
    overhead.VARIANTS = variants.VARIANTS
    harness = importlib.import_module("benchmarks.harness")
    harness.make_variant = make_variant  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--before", required=True, help="git revision of the package to compare against")
    args, rest = p.parse_known_args(argv)
    if "--variants" not in rest:
        rest += ["--variants", "numguard_default,numguard_all,before_numguard_default,before_numguard_all"]
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.before, Path(tmp))
        sys.path.insert(0, tmp)
        register(importlib.import_module(ALIAS))
        overhead.main(rest)


if __name__ == "__main__":
    main()
