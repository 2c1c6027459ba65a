"""The guard's host work per step as a count that does not move with the load: Python bytecodes executed.

    python -m benchmarks.host_work [--steps 30] [--write docs/performance.md]

A step's host time on this shared machine moves by a third from one run to the next; the number of Python
bytecodes the step executes does not (two runs of the same code give the same count). One fit per model and variant
(``baseline``, ``numguard_default``, ``floor_default``) with ``sys.settrace`` counting every opcode event over the
steps after the warm-up (every frame: the guard's own code, Lightning's dispatch of its hooks, torch's hook path);
the added count is the variant's minus the plain fit's, with the part of it in the package's own files, and the
Python calls a step makes into the package's functions (frames entered: a function, a comprehension, a generator
resumed), which in a real fit cost more than the bytecodes inside them. Each bytecode costs CPython 3.11 roughly
30-60 ns, on top of the ops the step dispatches (``benchmarks/op_count.py``). Models: the host-time benchmark's tiny
MLP (``benchmarks/host_time.py``; the benchmark MLP has its structure, so the same count) and the deep residual MLP
of 96 watched blocks (does the count grow with the blocks?).
"""

from __future__ import annotations

import argparse
import collections
import sys
from types import FrameType
from typing import Any

import torch

from benchmarks.harness import StepClock, quiet, run_fit
from benchmarks.host_time import tiny_mlp
from instruments import bench_models
from instruments.markdown import replace_block

__all__ = ["bytecodes_per_step"]

VARIANTS = ("baseline", "numguard_default", "floor_default")
PACKAGE = "lightning_numguard"


def bytecodes_per_step(
    spec: bench_models.ModelSpec, variant: str, args: argparse.Namespace
) -> tuple[float, float, float]:
    """``(all bytecodes, those in the package's files, Python calls into the package's functions)`` per step of one fit
    of ``variant``, after the warm-up (a call is a frame of the package entered: a function, a comprehension, a
    generator resumed)."""
    by_file: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def opcode(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            by_file[frame.f_code.co_filename] += 1
        return opcode

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        calls[frame.f_code.co_filename] += 1
        frame.f_trace_opcodes = True
        return opcode

    clock = StepClock("cpu")
    started = [0]

    def on_start() -> None:
        started[0] += 1
        if started[0] == args.warmup + 1:
            sys.settrace(trace)

    def on_end() -> None:
        if started[0] == args.steps:
            sys.settrace(None)

    clock.on_start.append(on_start)
    clock.on_end.append(on_end)
    try:
        run_fit(spec, variant, args, args.steps, clock)
    finally:
        sys.settrace(None)
    steps = args.steps - args.warmup
    own = sum(n for f, n in by_file.items() if f"/{PACKAGE}/" in f)
    own_calls = sum(n for f, n in calls.items() if f"/{PACKAGE}/" in f)
    return sum(by_file.values()) / steps, own / steps, own_calls / steps


def table(rows: dict[str, tuple[str, dict[str, tuple[float, float, float]]]]) -> str:
    lines = [
        "| model | plain step: bytecodes | guard: added (in the package's files) | guard: calls into the package | "
        "floor: added |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (description, counts) in rows.items():
        plain = counts["baseline"][0]
        guard, own, calls = counts["numguard_default"]
        floor = counts["floor_default"][0]
        added = f"{guard - plain:.0f} ({own:.0f}) | {calls:.0f} | {floor - plain:.0f}"
        lines.append(f"| {name}: {description} | {plain:.0f} | {added} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_work", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--write", metavar="MARKDOWN", help="replace the host_work block of this file")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps must be more than --warmup ({args.warmup}), got {args.steps}")
    args.device, args.precision = "cpu", "32"
    torch.set_num_threads(1)
    quiet()
    specs = [tiny_mlp(args.steps + 2), bench_models.build("deep", args.steps + 2, "cpu")]
    rows = {spec.name: (spec.description, {v: bytecodes_per_step(spec, v, args) for v in VARIANTS}) for spec in specs}
    text = table(rows)
    print(text)
    if args.write:
        replace_block(args.write, "host_work", text)


if __name__ == "__main__":
    main()
