"""Timed fits: the step clock, one fit per (variant, round), interleaved rounds, host-read counts.

Step time is measured from the first callback's ``on_train_batch_start`` to the last callback's
``on_train_batch_end`` (so every guard hook, the forward, backward and optimizer step are inside)
by one *step clock*: ``time.perf_counter`` on CPU, CUDA events on CUDA (read once, after ``fit``);
the first ``warmup`` steps of every fit are discarded. The training thread's CPU time over the same
window is kept too, as secondary information (on CUDA it is the host side only); the verdict
against the targets uses the step clock alone (see ``benchmarks.tables``).

Host reads are counted with ``instruments.syncs.SyncCounter`` in a separate, short fit
per variant, so the counting wrappers never slow down a timed fit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from benchmarks.variants import incidents, make_variant
from instruments import bench_models
from instruments.bench_models import bench_trainer, quiet
from instruments.syncs import SyncCounter

__all__ = ["StepClock", "bench_trainer", "count_syncs", "environment", "log", "quiet", "run_fit", "time_model"]


def log(msg: str) -> None:
    """Progress goes to stderr; the tables alone go to stdout."""
    print(msg, file=sys.stderr, flush=True)


class StepClock:
    """Start/end stamps of every training step: ``perf_counter`` on CPU, CUDA events on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.starts: list[Any] = []
        self.ends: list[Any] = []
        # CPU time of the training thread: on a shared machine it leaves out the time other
        # processes took the core, so CPU-side costs are compared with far less noise than wall time.
        self.cpu_starts: list[float] = []
        self.cpu_ends: list[float] = []
        self.on_start: list[Callable[[], None]] = []
        self.on_end: list[Callable[[], None]] = []

    def _stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self.cpu_starts.append(time.thread_time())
        self.starts.append(self._stamp())
        for f in self.on_start:
            f()

    def end(self) -> None:
        for f in self.on_end:
            f()
        self.ends.append(self._stamp())
        self.cpu_ends.append(time.thread_time())

    def cpu_step_ms(self) -> list[float]:
        """Thread CPU time per step (on CUDA: the host side only, which is what the guard adds there)."""
        return [(e - s) * 1e3 for s, e in zip(self.cpu_starts, self.cpu_ends)]

    def step_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in zip(self.starts, self.ends)]
        return [(e - s) * 1e3 for s, e in zip(self.starts, self.ends)]

    def interval_ms(self) -> list[float]:
        """Start-to-next-start: the whole loop iteration (data loading and Lightning's own work too)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.starts, self.starts[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.starts, self.starts[1:])]


class _StartStamp(Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.clock.start()


class _EndStamp(Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.end()


def step_clock_name(device: str) -> str:
    """The name of the step clock printed with the tables: the one every verdict uses."""
    return "CUDA events" if device == "cuda" else "perf_counter wall time"


def run_fit(
    spec: bench_models.ModelSpec, variant: str, args: argparse.Namespace, steps: int, clock: StepClock
) -> dict[str, Any]:
    """One short ``trainer.fit`` of ``variant`` from the model's initial weights."""
    spec.reset()
    gc.collect()
    torch.manual_seed(1234)
    with tempfile.TemporaryDirectory(prefix="numguard-bench-") as tmp:
        kwargs, cbs = make_variant(variant, Path(tmp))
        trainer = bench_trainer(
            tmp,
            steps,
            [_StartStamp(clock), *cbs, _EndStamp(clock)],
            accelerator=args.device,
            precision=args.precision,
            **kwargs,
        )
        error = None
        t0 = time.perf_counter()
        try:
            trainer.fit(spec.module, train_dataloaders=bench_models.dataloader(spec))
        except Exception as err:  # e.g. SpikeDetection's TrainingSpikeException: report, don't hide
            error = f"{type(err).__name__}: {err}"
        if args.device == "cuda":
            torch.cuda.synchronize()
        fit_s = time.perf_counter() - t0
    hook_ms = [ms for cb in cbs for ms in getattr(cb, "step_hook_ms", [])]  # a floor's own hook time per step
    out = {"fit_s": fit_s, "incidents": incidents(cbs), "error": error, "steps_run": trainer.global_step}
    return out | ({"hook_ms": hook_ms} if hook_ms else {})


def time_model(
    spec: bench_models.ModelSpec, variants: list[str], args: argparse.Namespace, deadline: float | None = None
) -> dict[str, Any]:
    """Interleaved rounds of every variant; stops early (after >= 2 whole rounds) at ``deadline``."""
    # One untimed fit first: one-time costs (allocator growth, CUDA/cuBLAS init, lazy imports)
    # would otherwise land on whichever variant happens to run first.
    run_fit(spec, "baseline", args, args.warmup + 2, StepClock(args.device))
    rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    round_s = 0.0
    for r in range(args.rounds):
        if r >= 2 and deadline is not None and time.perf_counter() + round_s > deadline:
            log(f"  {spec.name}: time budget reached, stopping after {r} rounds")
            break
        t_round = time.perf_counter()
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        for v in order:
            clock = StepClock(args.device)
            info = run_fit(spec, v, args, args.steps, clock)
            steps = clock.step_ms()[args.warmup :]
            info["step_ms"] = steps
            info["interval_ms"] = clock.interval_ms()[args.warmup :]
            info["median_step_ms"] = statistics.median(steps) if steps else float("nan")
            cpu = clock.cpu_step_ms()[args.warmup :]
            info["cpu_step_ms"] = cpu
            info["median_cpu_step_ms"] = statistics.median(cpu) if cpu else float("nan")
            if "hook_ms" in info:
                info["hook_ms"] = info["hook_ms"][args.warmup :]
                info["median_hook_ms"] = statistics.median(info["hook_ms"]) if info["hook_ms"] else float("nan")
            rounds[v].append(info)
            log(
                f"  {spec.name} round {r + 1}/{args.rounds} {v:<29} {info['median_step_ms']:8.2f} ms/step"
                + (f"  ERROR {info['error']}" if info["error"] else "")
                + (f"  incidents={info['incidents']}" if info["incidents"] else "")
            )
        round_s = time.perf_counter() - t_round
    out: dict[str, Any] = {}
    for v in variants:
        meds = [x["median_step_ms"] for x in rounds[v]]
        ratios = [x["median_step_ms"] / b["median_step_ms"] for x, b in zip(rounds[v], rounds[variants[0]])]
        cpu_ratios = [x["median_cpu_step_ms"] / b["median_cpu_step_ms"] for x, b in zip(rounds[v], rounds[variants[0]])]
        out[v] = {
            "rounds": rounds[v],
            "median_step_ms": statistics.median(meds),
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_iqr": _iqr(ratios),
            "cpu_ratio_per_round": cpu_ratios,
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "cpu_ratio_iqr": _iqr(cpu_ratios),
            "incidents": sum(x["incidents"] for x in rounds[v]),
            "errors": [x["error"] for x in rounds[v] if x["error"]],
        }
        if all("median_hook_ms" in x for x in rounds[v]) and rounds[v]:
            # a floor's own hooks, in % of the baseline step's thread CPU time of the same round: a lower bound of
            # what its reads cost, free of the wall-clock noise of a shared machine
            pct = [100 * x["median_hook_ms"] / b["median_cpu_step_ms"] for x, b in zip(rounds[v], rounds[variants[0]])]
            out[v]["hook_pct_of_baseline_cpu"] = statistics.median(pct)
            out[v]["hook_pct_iqr"] = _iqr(pct)
            out[v]["median_hook_ms"] = statistics.median(x["median_hook_ms"] for x in rounds[v])
    return out


def _iqr(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def count_syncs(spec: bench_models.ModelSpec, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Host reads per step of ``variant`` in one short fit (``args.count_steps``), by call site.

    A read is guard-caused when a ``lightning_numguard`` frame is on the Python stack (the rule of
    ``SyncCounter``, shared with the tests); the first step is reported on its own.
    """
    counter = SyncCounter(package="lightning_numguard", count_outside=True)
    clock = StepClock("cpu")  # stamps are unused here; only the step window matters
    clock.on_start.append(counter.step_started)
    clock.on_end.append(counter.step_ended)
    cuda_warn: list[int] = []
    if args.device == "cuda":

        def debug_on() -> None:
            cuda_warn.append(len(caught))
            torch.cuda.set_sync_debug_mode("warn")

        def debug_off() -> None:
            torch.cuda.set_sync_debug_mode("default")
            cuda_warn[-1] = sum(1 for w in caught[cuda_warn[-1] :] if "synchroniz" in str(w.message))

        clock.on_start.append(debug_on)
        clock.on_end.insert(0, debug_off)
    counter.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = run_fit(spec, variant, args, args.count_steps, clock)
    finally:
        counter.uninstall()
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    later = slice(1, None) if len(counter.step_total) > 1 else slice(None)

    def per_step(xs: list[int]) -> float:
        return statistics.mean(xs[later]) if xs else float("nan")

    out = {
        "steps": len(counter.step_total),
        "per_step_total": per_step(counter.step_total),
        "per_step_guard": per_step(counter.step_caused),
        "per_step_on_device": per_step(counter.step_on_device),
        "first_step_total": counter.step_total[0] if counter.step_total else None,
        "first_step_guard": counter.step_caused[0] if counter.step_caused else None,
        "per_step_lists": {
            "total": counter.step_total,
            "guard": counter.step_caused,
            "on_device": counter.step_on_device,
        },
        "outside_steps_per_fit_total": counter.outside_total,
        "outside_steps_per_fit_guard": counter.outside_caused,
        "sites": dict(counter.sites.most_common()),
        "error": info["error"],
    }
    if args.device == "cuda":
        out["cuda_sync_warnings_per_step"] = per_step(cuda_warn)
        out["cuda_sync_warnings_lists"] = cuda_warn
    return out


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions, device, thread counts and the digest of the package sources measured."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "pytorch_lightning": pl.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": args.device,
        "precision": args.precision,
        "step_clock": step_clock_name(args.device),
    }
    try:
        import lightning_numguard

        env["lightning_numguard"] = lightning_numguard.__version__
        env["lightning_numguard_sources"] = _source_digest(Path(lightning_numguard.__file__).parent)
    except Exception:
        pass
    try:
        import torchmetrics

        env["torchmetrics"] = torchmetrics.__version__
    except Exception:
        pass
    if args.device == "cuda":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = _cpu_name()
    with contextlib.suppress(OSError):
        env["loadavg_start"] = os.getloadavg()
    return env


def _source_digest(root: Path) -> dict[str, Any]:
    """sha256 of the package's .py files as imported (the checkout may have no commit to name)."""
    import hashlib

    files = {}
    total = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        data = f.read_bytes()
        total.update(f.relative_to(root).as_posix().encode() + b"\0" + data)
        files[f.relative_to(root).as_posix()] = hashlib.sha256(data).hexdigest()[:12]
    return {"sha256": total.hexdigest()[:16], "files": files}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
