"""Where the guard's own time per step goes: thread CPU time inside its hooks and their parts, by function.

    python -m benchmarks.hook_profile [--models mlp,lm] [--variants numguard_default,floor_default] [--steps 60]

Each named function below is wrapped with ``time.thread_time`` (inclusive times: a part is also counted in its
caller) for one fit per model and variant on one torch thread, the steps after ``--warmup`` only. Unlike cProfile,
which multiplies the cost of every Python call, the wrappers cost about a microsecond per call, so the hook totals
compare with :class:`instruments.floor.FloorGuard`'s ``step_hook_ms``. On a shared machine a tiny op's time varies
several-fold between runs: compare variants of the same run, and totals rather than single small rows.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import StepClock, quiet, run_fit
from instruments import bench_models

__all__ = ["TARGETS", "hook_times"]

#: ``module:qualified name`` of every function timed (missing ones are skipped: other revisions lack some).
TARGETS = (
    "lightning_numguard.doors.trainer.callback:NumGuardCallback.on_train_batch_start",
    "lightning_numguard.doors.trainer.callback:NumGuardCallback.on_before_backward",
    "lightning_numguard.doors.trainer.callback:NumGuardCallback.on_after_backward",
    "lightning_numguard.doors.trainer.callback:NumGuardCallback.on_before_optimizer_step",
    "lightning_numguard.doors.trainer.callback:NumGuardCallback.on_train_batch_end",
    "lightning_numguard.engine.pipeline:StepPipeline.read",
    "lightning_numguard.engine.pipeline:StepPipeline.judge",
    "lightning_numguard.engine.pipeline:StepPipeline.finish",
    "lightning_numguard.engine.record:StepRecorder.begin",
    "lightning_numguard.engine.record:StepRecorder.end",
    "lightning_numguard.engine.read:StepRead.read",
    "lightning_numguard.engine.read:StepRead.pack",
    "lightning_numguard.engine.read:StepRead._read_here",
    "lightning_numguard.engine.read:StepRead._norms_here",
    "lightning_numguard.engine.read:StepRead.slot_values",
    "lightning_numguard.engine.read:StepRead.norm_total",
    "lightning_numguard.engine.read:StepRead.grads",
    "lightning_numguard.engine.deferred:Deferred.at_optimizer_step",
    "lightning_numguard.engine.deferred:Deferred.after_step",
    "lightning_numguard.engine.deferred:Deferred._late",
    "lightning_numguard.engine.pending:PendingFlags.push",
    "lightning_numguard.engine.pending:arm_device_skip",
    "lightning_numguard.detect.flags:pack",
    "lightning_numguard.detect.watch:OutputWatch.keep",
    "lightning_numguard.state.recovery:Recovery.at_read",
    "lightning_numguard.state.recovery:Recovery.carry_out",
    "lightning_numguard.engine.deferred:DeviceSkip.arm",
    "lightning_numguard.state.snapshots:Snapshots.take",
    "lightning_numguard.doors.trainer.logged:LoggedValues.mark",
    "lightning_numguard.detect.spike_guard:SpikeGuard.extras",
    "lightning_numguard.detect.spike_guard:SpikeGuard.push",
    "lightning_numguard.reporting.progress:FitProgress.after_step",
    "lightning_numguard.reporting.series:RunSeries.after_step",
    "lightning_numguard.detect.checks:input_maxima",
    "lightning_numguard.detect.spike:global_norm",
    "lightning_numguard.detect.spike:SpikeWindow.scores",
    "lightning_numguard.detect.spike:SpikeWindow.push",
    "lightning_numguard.state.snapshot:rng_state",
    "lightning_numguard.detect.watch:_Hook.__call__",
    "lightning_numguard.detect.watch:OutputWatch.total",
    "lightning_numguard.detect.watch:OutputWatch.reset",
    "lightning_numguard.detect.watch:OutputWatch.settle",
    "lightning_numguard.detect.flags:stack_raw",
    "instruments.floor:FloorGuard.on_train_batch_start",
    "instruments.floor:FloorGuard.on_before_backward",
    "instruments.floor:FloorGuard.on_before_optimizer_step",
    "instruments.floor:_SumHook.__call__",
)
#: The guard's entry points: their sum is its time per step (the op guard's wrappers time the op they wrap too).
HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
HOOKS += ("on_train_batch_end", "_Hook.__call__", "_SumHook.__call__")


class _Timer:
    def __init__(self) -> None:
        self.on = False
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, key: str, func: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return func(*args, **kwargs)
            t0 = clock()
            try:
                return func(*args, **kwargs)
            finally:
                self.seconds[key] += clock() - t0
                self.calls[key] += 1

        return timed

    def install(self) -> None:
        for target in TARGETS:
            module_name, path = target.split(":")
            owner: Any = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part, None)
            if owner is None or not hasattr(owner, name):
                continue
            self._undo.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, self.wrap(f"{module_name.rsplit('.', 1)[-1]}:{path}", getattr(owner, name)))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:  # inherited: drop the wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()


def hook_times(spec: bench_models.ModelSpec, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fit of ``variant``: per step, the median thread CPU time and the mean time in each timed function."""
    timer = _Timer()
    clock = StepClock(args.device)
    started = [0]

    def on_start() -> None:
        started[0] += 1
        timer.on = started[0] > args.warmup

    clock.on_start.insert(0, on_start)
    timer.install()
    try:
        run_fit(spec, variant, args, args.steps, clock)
    finally:
        timer.uninstall()
    steps = max(started[0] - args.warmup, 1)
    rows = {k: (1e6 * s / steps, timer.calls[k] / steps) for k, s in timer.seconds.items()}
    paths = {k: k.split(":", 1)[1] for k in rows}
    hooks = sum(us for k, (us, _) in rows.items() if paths[k] in HOOKS or paths[k].split(".", 1)[-1] in HOOKS)
    cpu = clock.cpu_step_ms()[args.warmup :]
    return {"step_cpu_ms": statistics.median(cpu) if cpu else None, "hooks_us": hooks, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hook_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,lm")
    p.add_argument("--variants", default="numguard_default,floor_default")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args(argv)
    args.device, args.precision, args.lm_size, args.float_causal_mask = "cpu", "32", "small", False
    torch.set_num_threads(1)
    quiet()
    for model in args.models.split(","):
        spec = bench_models.build(model, args.steps + 2, "cpu", "small", float_mask=False)
        for variant in args.variants.split(","):
            out = hook_times(spec, variant, args)
            print(f"{model} {variant}: step {out['step_cpu_ms']:.2f} ms thread CPU, hooks {out['hooks_us']:.0f} us")
            for key, (us, calls) in sorted(out["rows"].items(), key=lambda kv: -kv[1][0]):
                print(f"  {us:8.1f} us/step  {calls:5.2f} calls/step  {key}")


if __name__ == "__main__":
    main()
