"""The ``numguard`` command line (also ``python -m lightning_numguard``).

Subcommands:

- ``numguard explain PATH [--json]``: explain a failed run. ``PATH`` is a run's
  ``events.jsonl``, a folder holding one (searched recursively, newest first), or a text log /
  traceback of a run without the guard, matched against a catalogue of known NaN/Inf failures.
- ``numguard demo [--fault ...] [--action ...] [--steps N] [--dir DIR]``: train a tiny model with
  a fault injected and the guard on, and print its summary.

Exit codes:

- ``0``: a report was written, or a known cause was found;
- ``1``: the input was read but no known cause was recognised ("no known cause");
- ``2``: a usage error, or a path that is missing, unreadable, binary or holds nothing
  parseable (the message on stderr names the path and what was wrong).

This module is the only place in the package that prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from lightning_numguard.__about__ import __version__

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_NO_CAUSE = 1
EXIT_USAGE = 2

FAULTS = ("none", "input", "output", "loss", "grad", "param", "masked-fill")
ACTIONS = ("warn", "skip", "rollback", "halt")

_EPILOG = """\
exit codes:
  0  a report was written, or a known cause was found
  1  the input was read but no known cause was recognised ("no known cause")
  2  usage error, or PATH missing, unreadable, binary or with nothing parseable
"""

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
    commands = parser.add_subparsers(dest="command", metavar="{explain,demo}")

    explain = commands.add_parser(
        "explain",
        help="explain a run from its events.jsonl, its folder, or a plain log",
        description=_EXPLAIN_HELP,
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    explain.add_argument("path", metavar="PATH", help="events.jsonl, a folder holding one, or a text log")
    explain.add_argument("--json", action="store_true", help="print a machine-readable summary instead")
    explain.set_defaults(handler=_run_explain)

    demo = commands.add_parser(
        "demo",
        help="train a tiny model with an injected fault and the guard on",
        description=_DEMO_HELP,
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    demo.add_argument("--fault", choices=FAULTS, default="input", help="where to inject the fault (default: input)")
    demo.add_argument(
        "--action",
        choices=ACTIONS,
        default="rollback",
        help="what the guard does on an incident (default: rollback)",
    )
    demo.add_argument("--steps", type=_positive_int, default=30, metavar="N", help="training steps (default: 30)")
    demo.add_argument(
        "--dir", default="./numguard-demo", metavar="DIR", help="output folder (default: ./numguard-demo)"
    )
    demo.set_defaults(handler=_run_demo)
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
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_usage(sys.stderr)
        _emit("numguard: error: a subcommand is required (explain or demo)", sys.stderr)
        return EXIT_USAGE
    code: int = args.handler(args)
    return code


def _run_explain(args: argparse.Namespace) -> int:
    from lightning_numguard.reporting.explain import EXIT_ERROR, explain

    result = explain(Path(args.path))
    if result.exit_code == EXIT_ERROR:
        _emit(result.text, sys.stderr)
    elif args.json:
        _emit(json.dumps({**result.summary, "exit_code": result.exit_code}, indent=2, default=str), sys.stdout)
    else:
        _emit(result.text, sys.stdout)
    return result.exit_code


def _run_demo(args: argparse.Namespace) -> int:
    # Lazy: the demo imports torch and Lightning, which `explain` and `--help` never need.
    from lightning_numguard.demo import run_demo

    _emit(
        str(run_demo(fault=args.fault, action=args.action, steps=args.steps, out_dir=Path(args.dir))),
        sys.stdout,
    )
    return EXIT_OK


def _emit(text: str, stream: TextIO) -> None:
    try:
        print(text, file=stream)  # the CLI is the one place that prints
    except UnicodeEncodeError:  # a quoted log line the console's encoding cannot show
        encoding = getattr(stream, "encoding", None) or "ascii"
        print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)
