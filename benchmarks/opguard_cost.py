"""What the op guard's ``TorchFunctionMode`` costs an op it does not guard, and so each model's forward.

``python -m benchmarks.opguard_cost``: the per-call cost of a tiny ``torch.add`` with and without
``OpGuard`` active (best of 5 runs of 20,000 calls), times the number of torch-function calls a
mode sees in each benchmark model's forward + loss, against that forward's time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from benchmarks import bench_models
from lightning_numguard.core.opguard import OpGuard

__all__ = ["main"]


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _per_call_us(n: int = 20000) -> float:
    a, b = torch.randn(4), torch.randn(4)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.add(a, b)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    plain = min(_per_call_us() for _ in range(5))
    with OpGuard():
        guarded = min(_per_call_us() for _ in range(5))
    extra = guarded - plain
    print(f"torch.add: {plain:.2f} us plain, {guarded:.2f} us under OpGuard: {extra:.2f} us per unguarded op")
    print("| model | torch-function calls per forward+loss | forward+loss (ms) | mode cost (ms) | share |")
    print("|---|---:|---:|---:|---:|")
    for name in bench_models.MODELS:
        spec = bench_models.build(name, 1)
        batch = spec.batches[0]
        counter = _Count()
        with counter:
            spec.module.loss(batch)
        spec.module.loss(batch)
        t0 = time.perf_counter()
        for _ in range(5):
            spec.module.loss(batch)
        fwd = (time.perf_counter() - t0) / 5 * 1e3
        cost = counter.n * extra / 1e3
        print(f"| {name} | {counter.n} | {fwd:.2f} | {cost:.3f} | {cost / fwd * 100:.2f}% |")


if __name__ == "__main__":
    main()
