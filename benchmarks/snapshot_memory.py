"""Host memory of a snapshot per rank against the data-parallel world size, full copies vs sharded.

``python -m benchmarks.snapshot_memory [--out DIR]``: for each benchmark model, the bytes of one
snapshot (weights, buffers and AdamW state after a step) that every rank keeps today (a full copy)
and with ``lightning_numguard.core.sharding`` (this rank's slice; the largest rank is shown), for
world sizes 1, 2, 4 and 8, measured by sharding the real state (no processes are needed to shard);
plus the same arithmetic for a 7B-parameter model (12 bytes per parameter: float32 weights and two
Adam moments). Writes ``DIR/snapshot_memory.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import bench_models
from lightning_numguard.core.sharding import shard
from lightning_numguard.core.tree import nbytes

__all__ = ["main"]

WORLDS = (1, 2, 4, 8)


def _fmt(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="write DIR/snapshot_memory.md")
    args = p.parse_args(argv)
    head = "| model | parameters | full copy, every rank | " + " | ".join(f"sharded, world {w}" for w in WORLDS) + " |"
    lines = [
        "## Snapshot host memory per rank",
        "",
        "`python -m benchmarks.snapshot_memory`: bytes each rank keeps for one snapshot.",
        "",
        head,
        "|---|---:|---:|" + "---:|" * len(WORLDS),
    ]
    for name in bench_models.MODELS:
        spec = bench_models.build(name, 1)
        module = spec.module
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        module.loss(spec.batches[0]).backward()
        opt.step()
        state = {"model": module.state_dict(), "optimizers": [opt.state_dict()]}
        params = sum(q.numel() for q in module.parameters())
        per_world = [max(shard(state, r, w).nbytes for r in range(w)) for w in WORLDS]
        cells = " | ".join(_fmt(b) for b in per_world)
        lines.append(f"| {name} | {params:,} | {_fmt(nbytes(state))} | {cells} |")
    seven_b = 7e9 * 12
    cells = " | ".join(_fmt(seven_b / w) for w in WORLDS)
    lines.append(f"| 7B (arithmetic: 12 B/param) | 7,000,000,000 | {_fmt(seven_b)} | {cells} |")
    lines += [
        "",
        "Per node of 8 ranks, a 7B model: full copies "
        f"{_fmt(seven_b * 8)}, sharded {_fmt(seven_b)} (one copy split across the 8 ranks).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "snapshot_memory.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
