"""The guard's host cost per step in machine instructions, counted by valgrind: a number that does not move with load.

    python -m benchmarks.host_instructions [--steps 100,400] [--jobs 2] [--checks] [--write docs/performance.md]

Bytecodes (``benchmarks/host_work.py``) count the Python a step runs but not what its calls cost in C: a
``random.getstate`` is one bytecode and about 110,000 instructions, an op's dispatch a few thousand. Here each variant
(``baseline``, ``numguard_default``, ``floor_default``) fits the host-time benchmark's tiny MLP
(``benchmarks/host_time.py``) for two lengths under ``valgrind --tool=callgrind``, which counts every instruction the
process executes (with one BLAS and OpenMP thread: their workers' spin-waits are not the step's); the difference
between the two lengths, divided by the steps between them, is the cost of one step with the start-up and the fit's
own start and end taken out, and the variant's minus the plain fit's is what it adds. Two runs give the same numbers
to within about 10,000 instructions a step (of 4 million). A fit under valgrind runs about fifty times slower (the
imports are most of it): six fits take about ten minutes on two cores. Needs ``valgrind`` on the ``PATH``.

``--checks`` also counts the defaults with one part left out each (``numguard_no_outputs``, ``numguard_no_inputs``,
``numguard_no_ops``, ``numguard_no_spike``) and the floor without its output reads (``floor_no_outputs``): what each
part of the defaults adds to a step, and the least that reading the block outputs costs (ten more fits).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.variants import FLOOR_PARTS, PARTS
from instruments.markdown import replace_block

__all__ = ["instructions_per_step"]

VARIANTS = ("baseline", "numguard_default", "floor_default")
#: no BLAS or OpenMP worker threads (their spin-waits would add tens of thousands of instructions a step, at random)
#: and one string hash seed (the order of sets and the probes of dicts, and so the garbage collector's passes, would
#: move the count by a few percent from one run to the next)
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
REPO = Path(__file__).resolve().parents[1]

_FIT = """
import argparse, sys
import torch
from benchmarks.harness import StepClock, quiet, run_fit
from benchmarks.host_time import tiny_mlp
variant, steps = sys.argv[1], int(sys.argv[2])
quiet()
torch.set_num_threads(1)
args = argparse.Namespace(steps=steps, warmup=10, device="cpu", precision="32", rounds=1)
run_fit(tiny_mlp(steps + 2), variant, args, steps, StepClock("cpu"))
"""


def _total(out_file: Path) -> int:
    """The ``summary:`` line of a callgrind output file: the instructions the process executed."""
    for line in out_file.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {out_file}")


def _count(variant: str, steps: int, folder: Path) -> int:
    out = folder / f"callgrind.{variant}.{steps}"
    script = folder / "fit.py"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        str(script),
        variant,
        str(steps),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **_ONE_THREAD}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} ({steps} steps) failed under valgrind:\n{done.stderr[-2000:]}")
    return _total(out)


def instructions_per_step(steps: tuple[int, int], jobs: int, variants: tuple[str, ...] = VARIANTS) -> dict[str, float]:
    """Per variant, the instructions one step executes (the two fits' difference over the steps between them)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("benchmarks.host_instructions needs valgrind on the PATH (apt install valgrind)")
    with tempfile.TemporaryDirectory(prefix="numguard-instr-") as tmp:
        folder = Path(tmp)
        (folder / "fit.py").write_text(_FIT, encoding="utf-8")
        runs = [(v, n) for v in variants for n in steps]
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            totals = dict(zip(runs, pool.map(lambda r: _count(r[0], r[1], folder), runs)))
    short, long = steps
    return {v: (totals[(v, long)] - totals[(v, short)]) / (long - short) for v in variants}


def table(per_step: dict[str, float]) -> str:
    base = per_step["baseline"]
    lines = [
        "| tiny MLP 8-8-8-8-4 (GELU), batch 4 | instructions per step | added to the plain step |",
        "|---|---:|---:|",
    ]
    names = {"baseline": "plain `Trainer`", "numguard_default": "`NumGuardCallback()`", "floor_default": "floor"}
    for v in VARIANTS:
        added = "" if v == "baseline" else f"{per_step[v] - base:,.0f}"
        lines.append(f"| {names[v]} | {per_step[v]:,.0f} | {added} |")
    return "\n".join(lines)


def parts_table(per_step: dict[str, float]) -> str:
    """What each part of the defaults adds to a step: the defaults' count minus the count without it."""
    lines = [
        "| part of the defaults | instructions per step without it | what it adds to a step |",
        "|---|---:|---:|",
    ]
    for variant, part in PARTS.items():
        lines.append(f"| {part} | {per_step[variant]:,.0f} | {per_step['numguard_default'] - per_step[variant]:,.0f} |")
    for variant, part in FLOOR_PARTS.items():
        lines.append(f"| {part} | {per_step[variant]:,.0f} | {per_step['floor_default'] - per_step[variant]:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_instructions", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="100,400", help="the two fit lengths")
    p.add_argument("--jobs", type=int, default=2, help="fits run at once under valgrind")
    p.add_argument("--checks", action="store_true", help="also what each part of the defaults adds (ten more fits)")
    p.add_argument("--write", metavar="MARKDOWN", help="replace the host_instructions block(s) of this file")
    args = p.parse_args(argv)
    short, long = (int(s) for s in args.steps.split(","))
    if not 0 < short < long:
        p.error(f"--steps wants two lengths, the shorter first, got {args.steps!r}")
    variants = VARIANTS + (tuple(PARTS) + tuple(FLOOR_PARTS) if args.checks else ())
    per_step = instructions_per_step((short, long), args.jobs, variants)
    text = table(per_step)
    print(text)
    if args.write:
        replace_block(args.write, "host_instructions", text)
    if args.checks:
        parts = parts_table(per_step)
        print(parts)
        if args.write:
            replace_block(args.write, "host_instructions_parts", parts)


if __name__ == "__main__":
    main()
