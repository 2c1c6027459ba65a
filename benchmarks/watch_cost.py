"""What the block output watch costs each benchmark model's forward + backward.

``python -m benchmarks.watch_cost``: each model's forward + loss + backward with the watch's hooks
attached and detached, alternating in a 1-0-0-1 pattern (median of ``--rounds`` steps each), with
the default ``OutputWatch(depth=1)`` (blocks; long ``ModuleList``s capped at ``MAX_PER_LIST``
watched elements) or ``--every-module``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from instruments import bench_models
from lightning_numguard.detect.watch import OutputWatch

__all__ = ["main"]


def _step(watch: OutputWatch, module: Any, batch: Any) -> None:
    watch.reset()
    loss = module.loss(batch)
    watch.settle()  # as the guard does at the loss: the kept outputs reduced before the backward pass
    loss.backward()
    module.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--models", default=",".join(bench_models.MODELS))
    p.add_argument("--every-module", action="store_true", help="OutputWatch(depth=None): a hook on every module")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | hooks | forward+backward (ms) | watching (ms) | added |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        spec = bench_models.build(name, 1)
        batch, module = spec.batches[0], spec.module
        watch = OutputWatch(module, depth=None if args.every_module else 1)

        for _ in range(3):
            _step(watch, module, batch)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.rounds * 2):
            on = i % 4 in (0, 3)
            (watch.attach if on else watch.detach)()
            t0 = time.perf_counter()
            _step(watch, module, batch)
            times[on].append(time.perf_counter() - t0)
        watch.detach()
        off, on = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        print(f"| {name} | {len(watch.names)} | {off:.2f} | {on:.2f} | {(on / off - 1) * 100:+.1f}% |")


if __name__ == "__main__":
    main()
