"""The ``numguard`` command line (also ``python -m lightning_numguard``).

Subcommands:

- ``numguard explain PATH [--json]``: explain a failed run. ``PATH`` is a run's
  ``events.jsonl``, a folder holding one (searched recursively, newest first), or a text log /
  traceback of a run without the guard, matched against a catalogue of known NaN/Inf failures.
- ``numguard demo [--fault ...] [--action ...] [--steps N] [--dir DIR]``: train a tiny model with
  a fault injected and the guard on, and print its summary.
- ``numguard plot PATH [-o OUT]``: draw a run (loss, gradient norm, spike threshold, what the guard
  did) from its ``events.jsonl`` and the ``trace.csv`` beside it; needs the ``plot`` extra (matplotlib).

Exit codes: :class:`~lightning_numguard.reporting.explain.ExitCode` (0: a report was written or a
known cause found; 1: no known cause; 2: a usage error, or a path that is missing, unreadable,
binary or holds nothing parseable, named on stderr with what was wrong).

This module is the only place in the package that prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TextIO, get_args

from lightning_numguard.__about__ import __version__
from lightning_numguard.reporting.events import Action
from lightning_numguard.reporting.explain import EXIT_CODE_HELP, ExitCode

__all__ = ["DEMO_DIR", "FAULTS", "build_parser", "fault_step", "main"]

#: Where ``numguard demo`` writes by default (``.gitignore`` lists it).
DEMO_DIR = "./numguard-demo"


def fault_step(steps: int) -> int:
    """The global step at which ``numguard demo --steps steps`` injects its fault: 10, or half of a shorter run."""
    return min(10, max(steps // 2, 1))


FAULTS: Mapping[str, str] = MappingProxyType(
    {
        "none": "no fault: a clean run",
        "input": "NaN in one batch of images",
        "output": "a constant feature, so the model's std normalisation divides 0 by 0",
        "loss": "the loss multiplied by inf",
        "grad": "a NaN gradient for the head's weight",
        "param": "NaN written into the first convolution's weights",
        "masked-fill": "numpy's masked-array fill value 1e20 in one batch of images",
    }
)
"""The faults ``numguard demo --fault`` can inject, with what each does (the demo's one table)."""

_EPILOG = "exit codes:\n" + "".join(f"  {int(code)}  {text}\n" for code, text in EXIT_CODE_HELP.items())

_DEMO_EPILOG = "exit codes:\n  0  the demo ran (whatever the guard found)\n  2  a usage error\n"

_EXPLAIN_HELP = """\
Explain a failed run. PATH is a run's events.jsonl (written by NumGuardCallback), a folder
holding one (searched recursively; the newest is used and named), or a text log / traceback
of a run without the guard, which is matched against a catalogue of known NaN/Inf failures
(BCE range asserts, class or embedding index out of range, anomaly-mode NaN ops, numpy
overflow, AMP/GradScaler errors, cuBLAS/cuDNN errors after a device-side assert, ...).
"""


_DEMO_HELP = """\
Train a tiny model with a fault injected at one step and NumGuardCallback on, then print
the demo's summary (what went bad, what the guard did, where events.jsonl was written).
The fault is injected once, at global step 10 (at step N // 2 when --steps N is below 20).

faults:
""" + "".join(f"  {name:<12} {text}\n" for name, text in FAULTS.items())


_PLOT_HELP = """\
Draw a run in one picture: the loss and the gradient norm over the steps, their z-scores and the
spike threshold, and markers for incidents (labelled with the culprit), skipped steps, rollbacks
(the span rolled back shaded), spikes and overflow risks. Reads events.jsonl and the trace.csv the
guard writes beside it (without trace.csv, the markers alone). Needs matplotlib:
pip install 'lightning-numguard[plot]'.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``numguard`` argument parser, with one sub-parser per subcommand."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="numguard",
        description="Guard, explain and demonstrate NaN/Inf failures in PyTorch Lightning training.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{explain,demo,plot}")

    explain = commands.add_parser(
        "explain",
        help="explain a run from its events.jsonl, its folder, or a plain log",
        description=_EXPLAIN_HELP,
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    explain.add_argument(
        "path", metavar="PATH", help="events.jsonl, a folder holding one, or a text log; - reads a log from stdin"
    )
    explain.add_argument("--json", action="store_true", help="print a machine-readable summary instead")
    explain.set_defaults(handler=_run_explain)

    demo = commands.add_parser(
        "demo",
        help="train a tiny model with an injected fault and the guard on",
        description=_DEMO_HELP,
        epilog=_DEMO_EPILOG,
        formatter_class=formatter,
    )
    demo.add_argument(
        "--fault", choices=list(FAULTS), default="input", help="where to inject the fault (default: input)"
    )
    demo.add_argument(
        "--action",
        choices=get_args(Action),
        default="rollback",
        help="what the guard does on an incident (default: rollback)",
    )
    demo.add_argument("--steps", type=_positive_int, default=30, metavar="N", help="training steps (default: 30)")
    demo.add_argument("--dir", default=DEMO_DIR, metavar="DIR", help=f"output folder (default: {DEMO_DIR})")
    demo.set_defaults(handler=_run_demo)

    plot = commands.add_parser(
        "plot",
        help="draw a run's loss, gradient norm and incidents to an image",
        description=_PLOT_HELP,
        formatter_class=formatter,
    )
    plot.add_argument("path", metavar="PATH", help="events.jsonl, or a folder holding one (the newest is used)")
    plot.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="image file, format from its suffix (default: run.png beside events.jsonl)",
    )
    plot.set_defaults(handler=_run_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``numguard`` command line.

    Args:
        argv: the arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit code (see the module docstring). ``--help`` and ``--version`` return 0 and usage
        errors 2, instead of raising ``SystemExit``.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else int(ExitCode.ERROR)
    if args.command is None:
        parser.print_usage(sys.stderr)
        _emit("numguard: error: a subcommand is required (explain, demo or plot)", sys.stderr)
        return int(ExitCode.ERROR)
    try:
        return int(args.handler(args))
    except BrokenPipeError:  # `numguard explain ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail too
        return int(ExitCode.OK)


def _run_explain(args: argparse.Namespace) -> int:
    from lightning_numguard.reporting.explain import explain

    if args.path == "-":  # a log piped in: explain it from a temporary copy
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "stdin.log"
            path.write_bytes(sys.stdin.buffer.read())
            found = explain(path)
            result = dataclasses.replace(found, text=found.text.replace(str(path), "<stdin>"))
    else:
        result = explain(Path(args.path))
    if result.exit_code == ExitCode.ERROR:
        _emit(result.text, sys.stderr)
    elif args.json:
        _emit(json.dumps({**result.summary, "exit_code": result.exit_code}, indent=2, default=str), sys.stdout)
    else:
        _emit(result.text, sys.stdout)
    return result.exit_code


def _run_demo(args: argparse.Namespace) -> int:
    # Lazy: the demo imports torch and Lightning, which `explain` and `--help` never need.
    from lightning_numguard.doors.trainer.demo import run_demo

    _emit(
        str(run_demo(fault=args.fault, action=args.action, steps=args.steps, out_dir=Path(args.dir))),
        sys.stdout,
    )
    return ExitCode.OK


def _run_plot(args: argparse.Namespace) -> int:
    from lightning_numguard.errors import NumGuardError
    from lightning_numguard.reporting.plot import plot_run

    try:
        out = plot_run(Path(args.path), args.output)
    except NumGuardError as err:
        _emit(f"numguard plot: error: {err}", sys.stderr)
        return int(ExitCode.ERROR)
    _emit(str(out), sys.stdout)
    return int(ExitCode.OK)


def _emit(text: str, stream: TextIO) -> None:
    try:
        print(text, file=stream)  # the CLI is the one place that prints
    except UnicodeEncodeError:  # a quoted log line the console's encoding cannot show
        encoding = getattr(stream, "encoding", None) or "ascii"
        print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)
