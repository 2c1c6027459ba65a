"""Host memory of a snapshot per rank against the data-parallel world size, full copies vs sharded.

``python -m benchmarks.snapshot_memory [--out DIR]``: for each benchmark model, the bytes of one
snapshot (weights, buffers and AdamW state after a step) that each rank's ``Recovery`` holds with
``snapshot_sharding="off"`` (a full copy on every rank) and with the default ``"auto"`` under DDP
(this rank's slice of the parameters and optimizer state, plus its whole buffers; the largest rank
is shown), for world sizes 1, 2, 4 and 8. Measured with ``core.snapshot.capture``, the call
``Recovery.take`` makes, with the ``shard_among=(rank, world)`` it passes under DDP (sharding needs
no communication, so no processes are started; world 1 is not sharded);
plus the same arithmetic for a 7B-parameter model (12 bytes per parameter: float32 weights and two
Adam moments). Writes ``DIR/snapshot_memory.md`` with ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from instruments import bench_models
from lightning_numguard.state.snapshot import capture

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
    head = (
        "| model | parameters | `off`: full copy, every rank | "
        + " | ".join(f"`auto`, world {w}" for w in WORLDS)
        + " |"
    )
    lines = [
        "## Snapshot host memory per rank",
        "",
        "`python -m benchmarks.snapshot_memory`: bytes of one snapshot held by each rank's `Recovery`",
        '(`snapshot_sharding="off"`: a full copy; the default `"auto"` under DDP: the rank\'s slice of the',
        "parameters and AdamW state plus its own buffers; world 1 is not sharded).",
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
        full = capture(module, [opt], step=1).nbytes
        params = sum(q.numel() for q in module.parameters())
        per_world = [
            max(capture(module, [opt], step=1, shard_among=(r, w) if w > 1 else None).nbytes for r in range(w))
            for w in WORLDS
        ]
        cells = " | ".join(_fmt(b) for b in per_world)
        lines.append(f"| {name} | {params:,} | {_fmt(full)} | {cells} |")
    seven_b = 7e9 * 12
    cells = " | ".join(_fmt(seven_b / w) for w in WORLDS)
    lines.append(f"| 7B (arithmetic: 12 B/param) | 7,000,000,000 | {_fmt(seven_b)} | {cells} |")
    lines += [
        "",
        "Per node of 8 ranks, a 7B model: full copies "
        f"{_fmt(seven_b * 8)}, sharded {_fmt(seven_b)} (one copy split across the 8 ranks).",
        "",
        'Each figure is one snapshot. Two are held at times, each sharded the same way under `"auto"`: with',
        "`snapshot_async` on (the default on CUDA), the verified snapshot and the buffer the next one is copied into",
        'during its step; with `sync_mode="deferred"`, the verified snapshot and at most one candidate waiting',
        "for its step's flags.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "snapshot_memory.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
