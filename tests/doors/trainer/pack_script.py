"""Run by the multi-process Trainer tests (``launches.py``): the fits of several scripts in one launch.

Usage: python pack_script.py OUT_DIR SCRIPT ARGS [SCRIPT ARGS ...]

Each SCRIPT is a script of this folder (``ddp_script``, ``trust_ddp_script``, ``sharded_script``,
``sharded_lib_script``), run in turn as ``SCRIPT.main([OUT_DIR/SCRIPT, *ARGS.split()])`` in the same processes:
one process group for them all (Lightning relaunches this script, with these arguments, for the other ranks at the
first fit). A script that raises ends the launch: a halting fit goes last.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> None:
    root, rest = Path(sys.argv[1]), sys.argv[2:]
    for script, args in zip(rest[::2], rest[1::2]):
        out = root / script
        out.mkdir(parents=True, exist_ok=True)
        importlib.import_module(f"tests.doors.trainer.{script}").main([str(out), *args.split()])


if __name__ == "__main__":
    main()
    # gloo's worker threads can outlive the interpreter's finalisation and abort a successful run (see ddp_script.py)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
