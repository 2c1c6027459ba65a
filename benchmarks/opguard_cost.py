"""What the op guard costs each benchmark model's forward + loss.

``python -m benchmarks.opguard_cost``: the per-call cost of an op the guard does not guard (a tiny
``torch.add``) and of one it does (``F.cross_entropy``, run first as ``NumGuardCallback`` guards CPU calls, and
checked first as on an accelerator), with and without ``OpGuard`` entered (best of 5 runs), then each model's
forward + loss timed with and without the guard, interleaved
(median of ``--rounds`` pairs). As in the callback, the guard is held for the whole run
(``OpGuard.hold``) and entered once per forward. The guard only wraps the guarded functions
(``core.opguard.patch``): every other op runs untouched. "plain" runs with the functions still
wrapped but no guard entered (their wrapper passes straight through).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from instruments import bench_models
from lightning_numguard.detect.opguard import OpGuard

__all__ = ["main"]


def _per_call_us(call: Callable[[], object], n: int = 20000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e6


def _pair(call: Callable[[], object], n: int, check_cpu_calls: bool) -> tuple[float, float]:
    plain = min(_per_call_us(call, n) for _ in range(5))
    with OpGuard(check_cpu_calls=check_cpu_calls):
        guarded = min(_per_call_us(call, n) for _ in range(5))
    return plain, guarded


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=30, help="interleaved (plain, guarded) forward pairs per model")
    p.add_argument("--models", default=",".join(bench_models.MODELS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    a, b = torch.randn(4), torch.randn(4)
    logits, target = torch.randn(8, 10), torch.randint(0, 10, (8,))
    extra: dict[str, float] = {}
    for label, call, n, check_first in (
        ("torch.add (not guarded)", lambda: torch.add(a, b), 20000, False),
        ("F.cross_entropy (guarded)", lambda: F.cross_entropy(logits, target), 5000, False),
        (
            "F.cross_entropy (guarded, checked first as on an accelerator)",
            lambda: F.cross_entropy(logits, target),
            5000,
            True,
        ),
    ):
        plain, guarded = _pair(call, n, check_first)
        extra[label] = guarded - plain
        print(f"{label}: {plain:.2f} us plain, {guarded:.2f} us under OpGuard: {guarded - plain:+.2f} us per call")
    held = OpGuard(check_cpu_calls=False)
    held.hold()
    t0 = time.perf_counter()
    for _ in range(20000):
        with held:
            pass
    enter_us = (time.perf_counter() - t0) / 20000 * 1e6
    held.release()
    print(f"entering and leaving a held guard: {enter_us:.2f} us")
    print()
    print(
        "| model | forward+loss (ms) | with the op guard (ms) | measured | guarded calls | "
        "computed: enter + calls x guarded-call cost | computed share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        spec = bench_models.build(name, 1)
        batch = spec.batches[0]
        module = spec.module
        held = OpGuard(check_cpu_calls=False)  # as the callback guards: a clean CPU call runs unchecked
        held.hold()  # as the callback does for the whole fit
        with torch.no_grad():
            for _ in range(3):
                module.loss(batch)
            plain: list[float] = []
            guarded: list[float] = []
            for i in range(args.rounds):
                for on in (False, True) if i % 2 else (True, False):
                    guard = held
                    t0 = time.perf_counter()
                    if on:
                        with guard:
                            module.loss(batch)
                    else:
                        module.loss(batch)
                    (guarded if on else plain).append(time.perf_counter() - t0)
        counter = OpGuard()
        with torch.no_grad(), counter:
            module.loss(batch)
        calls = len({id(r.checked) for r in counter.records})  # binary_cross_entropy leaves two records
        held.release()
        fwd, with_guard = statistics.median(plain) * 1e3, statistics.median(guarded) * 1e3
        added = with_guard - fwd
        computed = enter_us + calls * extra["F.cross_entropy (guarded)"]
        print(
            f"| {name} | {fwd:.3f} | {with_guard:.3f} | {added / fwd * 100:+.2f}% | {calls} | "
            f"{computed:.1f} us | {computed / (fwd * 1e3) * 100:.2f}% |"
        )


if __name__ == "__main__":
    main()
