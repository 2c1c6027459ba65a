"""Is NumGuard cheap enough to leave on? Step-time overhead of the guard and its alternatives.

For each model (an MLP, a small CNN with BatchNorm, a small transformer LM) this trains the same
initial weights on the same in-process data with each *variant* below, interleaved over rounds
(round r runs every variant once, the order rotated by r, so drift on a shared machine hits all
variants alike), and reports the median over rounds of the per-round ratio
``median step time(variant) / median step time(baseline)`` with its spread.

Variants:
  baseline                      plain ``pl.Trainer`` (logger=False, no checkpointing, progress bar, summary)
  numguard_default              ``NumGuardCallback()`` (default checks, snapshot every 50 steps)
  numguard_all                  every check every step: output hooks, parameters, optimizer state
  numguard_all_no_outputs       every check but ``outputs`` (the forward hooks off)
  numguard_no_ops               defaults without ``ops`` (no TorchFunctionMode)
  numguard_snapshot_every_step  defaults with ``snapshot_every_n_steps=1``
  detect_anomaly                ``Trainer(detect_anomaly=True)``
  spike_detection               Lightning's ``SpikeDetection`` callback (loss spikes, ``mode="min"``)
  naive_isfinite                ``bool(torch.isfinite(p.grad).all())`` per parameter tensor,
                                in ``on_before_optimizer_step``

Step time is measured from the first callback's ``on_train_batch_start`` to the last callback's
``on_train_batch_end`` (so every guard hook, the forward, backward and optimizer step are inside),
with ``time.perf_counter`` on CPU and CUDA events on CUDA (read once, after ``fit``); the first
``--warmup`` steps of every fit are discarded.

Host reads are counted in a separate, short run per variant (see ``SyncCounter``), so the
counting wrappers never slow down a timed run. Micro-measurements (``micro.py``) follow.

Usage:
  python benchmarks/overhead.py [--quick] [--rounds N] [--steps N] [--out DIR] [--models mlp,cnn,lm]
      [--device cpu|cuda] [--precision 32|bf16-mixed] [--lm-size small|100m] [--smoke] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import inspect
import io
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # use the checkout, installed or not
    sys.path.insert(0, str(_HERE.parent))
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import bench_models  # noqa: E402
import micro  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import Callback, SpikeDetection  # noqa: E402

from lightning_numguard.callbacks import NumGuardCallback  # noqa: E402

VARIANTS = (
    "baseline",
    "numguard_default",
    "numguard_all",
    "numguard_all_no_outputs",
    "numguard_no_ops",
    "numguard_snapshot_every_step",
    "detect_anomaly",
    "spike_detection",
    "naive_isfinite",
)
ALL_CHECKS = ["inputs", "outputs", "ops", "loss", "grads", "buffers", "params", "optimizer_state"]
DEFAULT_CHECKS = list(inspect.signature(NumGuardCallback).parameters["check"].default)
STEP_TARGET = 1.03  # numguard_default step time vs the plain Trainer
SYNC_TARGET = 1.0  # guard-caused host reads per step

# --quick / default / --smoke settings (explicit flags override them)
PRESETS = {
    "quick": dict(rounds=3, steps=12, warmup=4, count_steps=4, micro_reps=15, variants=None, budget_s=105),
    "full": dict(rounds=14, steps=22, warmup=6, count_steps=6, micro_reps=40, variants=None, budget_s=560),
    # --smoke only proves the code paths run (e.g. the 100M LM on a CPU): tiny, two variants
    "smoke": {
        "rounds": 1,
        "steps": 3,
        "warmup": 1,
        "count_steps": 2,
        "micro_reps": 2,
        "variants": "baseline,numguard_default",
        "budget_s": None,
    },
}


# ----------------------------------------------------------------------------- variants


class NaiveIsFinite(Callback):
    """What people write first: one ``bool()`` (a host sync on GPU) per gradient tensor."""

    def __init__(self) -> None:
        self.bad_steps = 0

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for p in pl_module.parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                self.bad_steps += 1
                optimizer.zero_grad(set_to_none=True)
                return


def make_variant(name: str, tmp: Path) -> tuple[dict[str, Any], list[Callback]]:
    """``(extra Trainer kwargs, callbacks)`` for variant ``name``; fresh objects every call."""
    ng = str(tmp / "numguard")
    if name == "baseline":
        return {}, []
    if name == "numguard_default":
        return {}, [NumGuardCallback(dirpath=ng)]
    if name == "numguard_all":
        return {}, [NumGuardCallback(dirpath=ng, check=list(ALL_CHECKS))]
    if name == "numguard_snapshot_every_step":
        return {}, [NumGuardCallback(dirpath=ng, snapshot_every_n_steps=1)]
    if name == "numguard_all_no_outputs":
        return {}, [NumGuardCallback(dirpath=ng, check=[c for c in ALL_CHECKS if c != "outputs"])]
    if name == "numguard_no_ops":
        return {}, [NumGuardCallback(dirpath=ng, check=[c for c in DEFAULT_CHECKS if c != "ops"])]
    if name == "detect_anomaly":
        return {"detect_anomaly": True}, []
    if name == "spike_detection":
        return {}, [SpikeDetection(mode="min", exclude_batches_path=str(tmp / "spike"))]
    if name == "naive_isfinite":
        return {}, [NaiveIsFinite()]
    raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")


# ----------------------------------------------------------------------------- timing


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


def _quiet() -> None:
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=r".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*Tensor Cores.*")
    warnings.filterwarnings("ignore", message=r".*anomaly detection.*")


def run_fit(
    spec: bench_models.ModelSpec, variant: str, args: argparse.Namespace, steps: int, clock: StepClock
) -> dict[str, Any]:
    """One short ``trainer.fit`` of ``variant`` from the model's initial weights."""
    spec.reset()
    gc.collect()
    torch.manual_seed(1234)
    with tempfile.TemporaryDirectory(prefix="numguard-bench-") as tmp:
        kwargs, cbs = make_variant(variant, Path(tmp))
        trainer = pl.Trainer(
            accelerator=args.device,
            devices=1,
            precision=args.precision,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=tmp,
            callbacks=[_StartStamp(clock), *cbs, _EndStamp(clock)],
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
    incidents = 0
    for cb in cbs:
        if isinstance(cb, NumGuardCallback):
            incidents += sum(1 for e in cb.events if e["kind"] != "optimizer_coverage")
        if isinstance(cb, NaiveIsFinite):
            incidents += cb.bad_steps
    return {"fit_s": fit_s, "incidents": incidents, "error": error, "steps_run": trainer.global_step}


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
            _log(f"  {spec.name}: time budget reached, stopping after {r} rounds")
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
            rounds[v].append(info)
            _log(
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
    return out


def _iqr(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


# ----------------------------------------------------------------------------- host reads


_MISSING = object()


class SyncCounter:
    """Counts the host reads and device-to-host copies made while a training step runs.

    Patched on ``torch.Tensor`` for the duration of one counted ``fit``:

    * reads: ``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``numpy`` -- counted on
      tensors of *any* device (on a CPU run every tensor is on the CPU, so this counts what
      would be a sync if the tensor lived on a GPU; on a CUDA run ``on_device`` says how many were
      on the GPU, i.e. real syncs);
    * copies: ``cpu`` and ``to(<a cpu device>)`` -- counted only when the source tensor is *not*
      on the CPU (so they never count on a CPU-only run, where they are no-ops).

    A call made while another counted call is running (nested) is not counted again. A call is
    "in a step" between the first callback's ``on_train_batch_start`` and the last callback's
    ``on_train_batch_end``; other calls (fit start/end) are totalled separately. A call is
    *guard-caused* when a ``lightning_numguard`` frame is on the Python stack. Calls are not
    filtered by origin (Lightning's own logging/progress code is off in these runs anyway):
    every counted call is attributed to a call site, listed in the JSON.
    On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` is also switched on inside steps and its
    warnings counted (``cuda_sync_warnings``): the synchronising CUDA calls seen by the driver layer.
    """

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
    COPIES = ("cpu", "to")

    def __init__(self) -> None:
        self.recording = False
        self.in_step = False
        self.busy = False
        self.step_total: list[int] = []
        self.step_guard: list[int] = []
        self.step_device: list[int] = []
        self.outside_total = 0
        self.outside_guard = 0
        self.sites: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    # patching
    def install(self) -> None:
        for name in self.READS + self.COPIES:
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def uninstall(self) -> None:
        for name, orig in self._saved.items():
            if orig is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)
        self._saved.clear()

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.busy or not counter.recording:
                return orig(self, *args, **kwargs)
            counter.busy = True
            try:
                if counter._counts(name, self, args, kwargs):
                    counter._hit(name, self, sys._getframe(1))
                return orig(self, *args, **kwargs)
            finally:
                counter.busy = False

        wrapper.__name__ = name
        return wrapper

    @staticmethod
    def _counts(name: str, t: torch.Tensor, args: Any, kwargs: Any) -> bool:
        if name in SyncCounter.READS:
            return True
        if t.device.type == "cpu":
            return False
        if name == "cpu":
            return True
        try:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
        except Exception:
            return False
        return device is not None and torch.device(device).type == "cpu"

    def _hit(self, name: str, t: torch.Tensor, frame: Any) -> None:
        guard = False
        site = None
        f = frame
        depth = 0
        while f is not None and depth < 80:
            fn = f.f_code.co_filename.replace("\\", "/")
            if "/lightning_numguard/" in fn:
                guard = True
                if site is None:
                    site = _site(f)
            f = f.f_back
            depth += 1
        if site is None:  # innermost frame outside torch itself (torch internals name their caller)
            f = frame
            while f is not None and "/torch/" in f.f_code.co_filename.replace("\\", "/"):
                f = f.f_back
            site = _site(f or frame) + ("" if f is frame else f" -> {_site(frame)}")
        where = "step" if self.in_step else "outside"
        self.sites[f"{where} | {name} | {'guard' if guard else 'other'} | {site}"] += 1
        if self.in_step:
            self.step_total[-1] += 1
            self.step_guard[-1] += guard
            self.step_device[-1] += t.device.type != "cpu"
        else:
            self.outside_total += 1
            self.outside_guard += guard

    # step window
    def begin_step(self) -> None:
        self.step_total.append(0)
        self.step_guard.append(0)
        self.step_device.append(0)
        self.in_step = True

    def end_step(self) -> None:
        self.in_step = False


def _site(frame: Any) -> str:
    fn = frame.f_code.co_filename.replace("\\", "/")
    for marker in (
        "/lightning_numguard/",
        "/pytorch_lightning/",
        "/lightning_fabric/",
        "/torchmetrics/",
        "/torch/",
    ):
        if marker in fn:
            fn = marker.strip("/") + "/" + fn.split(marker, 1)[1]
            break
    else:
        fn = os.path.basename(fn)
    return f"{fn}:{frame.f_lineno} {frame.f_code.co_name}"


def count_syncs(spec: bench_models.ModelSpec, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    counter = SyncCounter()
    clock = StepClock("cpu")  # stamps are unused here; only the step window matters
    clock.on_start.append(counter.begin_step)
    clock.on_end.append(counter.end_step)
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
    counter.recording = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = run_fit(spec, variant, args, args.count_steps, clock)
    finally:
        counter.recording = False
        counter.uninstall()
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    later = slice(1, None) if len(counter.step_total) > 1 else slice(None)

    def per_step(xs: list[int]) -> float:
        return statistics.mean(xs[later]) if xs else float("nan")

    out = {
        "steps": len(counter.step_total),
        "per_step_total": per_step(counter.step_total),
        "per_step_guard": per_step(counter.step_guard),
        "per_step_on_device": per_step(counter.step_device),
        "first_step_total": counter.step_total[0] if counter.step_total else None,
        "first_step_guard": counter.step_guard[0] if counter.step_guard else None,
        "per_step_lists": {
            "total": counter.step_total,
            "guard": counter.step_guard,
            "on_device": counter.step_device,
        },
        "outside_steps_per_fit_total": counter.outside_total,
        "outside_steps_per_fit_guard": counter.outside_guard,
        "sites": dict(counter.sites.most_common()),
        "error": info["error"],
    }
    if args.device == "cuda":
        out["cuda_sync_warnings_per_step"] = per_step(cuda_warn)
        out["cuda_sync_warnings_lists"] = cuda_warn
    return out


# ----------------------------------------------------------------------------- profile


def _in_guard(func: tuple[str, int, str]) -> bool:
    return "lightning_numguard" in func[0].replace("\\", "/")


def _fname(func: tuple[str, int, str]) -> str:
    fn = func[0].replace("\\", "/")
    fn = fn.split("lightning_numguard/", 1)[1] if "lightning_numguard/" in fn else os.path.basename(fn)
    return f"{fn}:{func[1]} {func[2]}"


def guard_breakdown(stats: dict[Any, Any], steps: int) -> list[dict[str, Any]]:
    """Time per step spent in ``lightning_numguard`` code, by the place it is entered from outside.

    Every guard function called from non-guard code (a Lightning hook call, a module forward
    hook, the torch-function-mode dispatch) is an entry point; its time is the cumulative time of
    those external calls (torch ops it runs included). ``OpGuard.__torch_function__`` is the one
    exception: its cumulative time includes the op it wraps, so only its own time and that of
    the guard functions it calls (the checks) are counted. What cProfile cannot see -- the C++
    cost of dispatching every op through a ``TorchFunctionMode`` -- is measured in micro (d).
    """
    torch_fn = [f for f in stats if _in_guard(f) and f[2] == "__torch_function__"]
    rows: dict[str, dict[str, Any]] = {}
    for func, (_, nc, tt, ct, callers) in stats.items():
        if not _in_guard(func):
            continue
        if func in torch_fn:
            own = tt + sum(
                edge[3] for g, (_, _, _, _, cl) in stats.items() if _in_guard(g) for c, edge in cl.items() if c == func
            )
            rows[_fname(func)] = {
                "ms_per_step": 1e3 * own / steps,
                "calls_per_step": nc / steps,
                "note": "own time + checks, without the wrapped op",
            }
            continue
        # Entered from outside: called by non-guard Python code, or with no recorded caller (the
        # hooks that run first after the profiler is switched on). Builtin callers ("~", e.g. a
        # generator consumed by list.extend) are the guard's own code.
        ext = [edge for caller, edge in callers.items() if not _in_guard(caller) and caller[0] != "~"]
        if not callers:
            ext = [(nc, nc, tt, ct)]
        if ext:
            rows[_fname(func)] = {
                "ms_per_step": 1e3 * sum(e[3] for e in ext) / steps,
                "calls_per_step": sum(e[1] for e in ext) / steps,
            }
    out = [{"entry": k, **v} for k, v in rows.items()]
    return sorted(out, key=lambda r: -r["ms_per_step"])


def profile_default(spec: bench_models.ModelSpec, args: argparse.Namespace, top: int = 12) -> dict[str, Any]:
    """cProfile the steps of one fit of ``numguard_default`` and of ``baseline``."""
    results: dict[str, Any] = {}
    for variant in ("baseline", "numguard_default"):
        clock = StepClock(args.device)
        prof = cProfile.Profile()
        clock.on_start.append(prof.enable)
        clock.on_end.insert(0, prof.disable)
        run_fit(spec, variant, args, args.steps, clock)
        steps = len(clock.starts)
        stats = pstats.Stats(prof, stream=io.StringIO()).stats  # type: ignore[attr-defined]
        total = sum(v[2] for v in stats.values())
        self_rows = [
            {
                "function": _fname(f),
                "calls_per_step": v[1] / steps,
                "self_ms_per_step": 1e3 * v[2] / steps,
                "cum_ms_per_step": 1e3 * v[3] / steps,
            }
            for f, v in stats.items()
            if _in_guard(f)
        ]
        breakdown = guard_breakdown(stats, steps)
        results[variant] = {
            "steps": steps,
            "profiled_ms_per_step": 1e3 * total / steps,
            "guard_ms_per_step": sum(r["ms_per_step"] for r in breakdown),
            "guard_entry_points": breakdown,
            "guard_top_self": sorted(self_rows, key=lambda r: -r["self_ms_per_step"])[:top],
        }
    return results


# ----------------------------------------------------------------------------- report


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_table(name: str, desc: str, res: dict[str, Any], syncs: dict[str, Any], cuda: bool) -> str:
    head = (
        "| variant | median step (ms) | ratio vs baseline (median of rounds) | ratio min–max | ratio IQR "
        "| CPU-time ratio (median, IQR) | host reads / step (all) | of which guard-caused |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"
    if cuda:
        head += " of which on GPU tensors | CUDA sync warnings / step |"
        rule += "---:|---:|"
    lines = [f"### {name}: {desc}", "", head, rule]
    notes = []
    for v, r in res.items():
        s = syncs.get(v, {})
        row = (
            f"| {v} | {r['median_step_ms']:.2f} | {r['ratio_median']:.3f} | "
            f"{r['ratio_min']:.3f}–{r['ratio_max']:.3f} | {r['ratio_iqr'][0]:.3f}–{r['ratio_iqr'][1]:.3f} | "
            f"{r['cpu_ratio_median']:.3f} ({r['cpu_ratio_iqr'][0]:.3f}–{r['cpu_ratio_iqr'][1]:.3f}) | "
            f"{_f(s.get('per_step_total'))} | {_f(s.get('per_step_guard'))} |"
        )
        if cuda:
            row += f" {_f(s.get('per_step_on_device'))} | {_f(s.get('cuda_sync_warnings_per_step'))} |"
        if r["incidents"] or r["errors"] or s.get("error"):
            row = row.replace(f"| {v} |", f"| {v} (!) |", 1)
            err = (r["errors"] or [s.get("error")])[0]
            notes.append(f"(!) {v}: {r['incidents']} incident(s) recorded" + (f"; error: {err}" if err else ""))
        lines.append(row)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def _f(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.1f}" if x == x else "–"
    return str(x)


def micro_tables(m: dict[str, Any]) -> str:
    out = ["### (a) gradient check vs the AdamW step (median ms per call; ratio to AdamW step)", ""]
    cols = [
        "adamw_step",
        "numguard_norm_candidates",
        "numguard_params_and_grads",
        "foreach_norm_inf",
        "per_tensor_isfinite_all",
        "per_tensor_isfinite_bool",
        "amp_foreach_non_finite_check_and_unscale",
    ]
    out.append("| params | tensors / values | " + " | ".join(cols) + " | target ≤ 0.25× met |")
    out.append("|---|---:|" + "---:|" * len(cols) + "---|")
    for name, g in m["grad_check"].items():
        cells = [f"{g['times'][c]['median_ms']:.3f} ({g['ratio_to_adamw'][c]:.2f}×)" for c in cols]
        out.append(
            f"| {name} | {g['n_tensors']} / {g['n_values'] / 1e6:.2f}M | "
            + " | ".join(cells)
            + f" | {'yes' if g['target_met'] else 'NO'} |"
        )
    out += [
        "",
        "### (b) snapshot and (c) rollback",
        "",
        "| model | host bytes / snapshot | capture (ms) | + optimizer-state check (ms) | first capture (ms) "
        "| step (ms) | amortised % of a step @10 / @50 / @100 | target ≤ 1% @50 met | restore (ms) "
        "| restore in steps |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, s in m["snapshot"].items():
        a = s["amortised_pct_of_step"]
        out.append(
            f"| {name} | {s['host_bytes'] / 2**20:.1f} MiB | {s['times']['capture']['median_ms']:.2f} | "
            f"{s['times']['optimizer_state_check']['median_ms']:.2f} | {s['first_capture_ms']:.1f} | "
            f"{s['step_ms']:.2f} | {a['10']:.2f} / {a['50']:.2f} / {a['100']:.2f} | "
            f"{'yes' if s['target_met'] else 'NO'} | {s['times']['restore']['median_ms']:.2f} | "
            f"{s['restore_in_steps']:.2f} |"
        )
    if m["opguard"]:
        out += [
            "",
            "### (d) op guard and forward hooks over the LM forward + loss (median ms; ratio to plain forward)",
            "",
            "| model | forward | OpGuard active | OpGuard entered but disabled | OutputWatch hooks | guarded calls |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, o in m["opguard"].items():
            t, rr = o["times"], o["ratio_to_forward"]
            cells = [
                f"{t[k]['median_ms']:.2f} ({rr[k]:.2f}×)"
                for k in ("forward", "forward_opguard", "forward_opguard_disabled", "forward_output_watch")
            ]
            out.append(f"| {name} | " + " | ".join(cells) + f" | {o['guarded_calls_per_forward']} |")
    return "\n".join(out)


def profile_table(name: str, prof: dict[str, Any]) -> str:
    d = prof["numguard_default"]
    lines = [
        f"### cProfile of numguard_default on {name}: time in lightning_numguard per step, by entry point",
        "",
        f"Profiled step: baseline {prof['baseline']['profiled_ms_per_step']:.1f} ms, numguard_default "
        f"{d['profiled_ms_per_step']:.1f} ms, of which {d['guard_ms_per_step']:.1f} ms inside lightning_numguard "
        "(cProfile inflates Python-heavy code; one fit each, so the two step totals carry the machine's noise).",
        "",
        "| entry point | calls / step | ms / step |",
        "|---|---:|---:|",
    ]
    for r in d["guard_entry_points"][:10]:
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"| `{r['entry']}`{note} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.2f} |")
    lines += ["", "Top guard functions by own (self) time:", "", "| function | calls / step | self ms / step |"]
    lines.append("|---|---:|---:|")
    for r in d["guard_top_self"][:8]:
        lines.append(f"| `{r['function']}` | {r['calls_per_step']:.0f} | {r['self_ms_per_step']:.2f} |")
    return "\n".join(lines)


def environment(args: argparse.Namespace) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See benchmarks/README.md.")
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps (about 2 minutes on 2 CPU cores)")
    p.add_argument("--smoke", action="store_true", help="tiny run that only exercises the code paths")
    p.add_argument("--rounds", type=int, help="interleaved rounds per model")
    p.add_argument("--steps", type=int, help="max_steps of each timed fit")
    p.add_argument("--warmup", type=int, help="steps discarded at the start of each timed fit")
    p.add_argument("--count-steps", type=int, help="max_steps of each host-read counting fit")
    p.add_argument("--micro-reps", type=int, help="interleaved repetitions of each micro-measurement")
    p.add_argument(
        "--budget-s",
        type=float,
        help="wall-clock budget: timed rounds stop early (keeping >= 2 whole rounds) so that the run, "
        "host-read counts and micro-measurements included, fits (default: 560 full, 105 --quick)",
    )
    p.add_argument("--out", help="write DIR/overhead.json")
    p.add_argument("--models", default=",".join(bench_models.MODELS))
    p.add_argument("--variants", help="comma-separated subset (default: all); baseline is always run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    p.add_argument("--lm-size", choices=tuple(bench_models.LM_SIZES), default="small")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: 1 on cpu)")
    p.add_argument(
        "--float-causal-mask",
        action="store_true",
        help="LM keeps its causal mask as a float buffer with -inf (instead of bool); see README",
    )
    p.add_argument("--no-micro", action="store_true")
    p.add_argument("--no-counts", action="store_true")
    p.add_argument("--profile", action="store_true", help="also cProfile numguard_default on every model")
    args = p.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "quick" if args.quick else "full"]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.variants is None:
        args.variants = ",".join(VARIANTS)
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    args.variant_list = ["baseline"] + [v for v in variants if v != "baseline"]
    args.model_list = [m for m in args.models.split(",") if m]
    bad = [m for m in args.model_list if m not in bench_models.MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {list(bench_models.MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _quiet()
    if args.threads is None:
        # The project's CPU has 2 shared cores: with a second busy process, 2 OpenMP threads
        # spin and step times swing 3-4x; one thread measures far more repeatably.
        args.threads = 1 if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "environment": environment(args),
        "config": {
            k: getattr(args, k)
            for k in (
                "rounds",
                "steps",
                "warmup",
                "count_steps",
                "micro_reps",
                "budget_s",
                "lm_size",
                "quick",
                "smoke",
                "threads",
            )
        }
        | {"variants": args.variant_list, "models": args.model_list, "default_checks": DEFAULT_CHECKS},
        "models": {},
    }
    specs: dict[str, bench_models.ModelSpec] = {}
    for name in args.model_list:
        n_batches = max(args.steps, args.count_steps) + 2
        spec = bench_models.build(name, n_batches, args.device, args.lm_size, float_mask=args.float_causal_mask)
        specs[name] = spec
        _log(f"== {name}: {spec.description}")
        deadline = None
        if args.budget_s:
            share = 0.7 if not (args.no_micro and args.no_counts) else 0.95
            i = args.model_list.index(name)
            deadline = t_start + share * args.budget_s * (i + 1) / len(args.model_list)
        timing = time_model(spec, args.variant_list, args, deadline)
        syncs: dict[str, Any] = {}
        if not args.no_counts:
            for v in args.variant_list:
                syncs[v] = count_syncs(spec, v, args)
                _log(
                    f"  {name} host reads {v:<29} {syncs[v]['per_step_total']:.1f}/step "
                    f"(guard-caused {syncs[v]['per_step_guard']:.1f}/step)"
                )
        entry: dict[str, Any] = {
            "description": spec.description,
            "rounds_run": len(timing["baseline"]["rounds"]),
            "n_params": spec.n_params,
            "variants": timing,
            "host_reads": syncs,
        }
        if args.profile:
            _log(f"  {name}: cProfile of numguard_default")
            entry["profile"] = profile_default(spec, args)
        result["models"][name] = entry
        spec.module.cpu()
    if not args.no_micro:
        step_ms = {n: e["variants"]["baseline"]["median_step_ms"] for n, e in result["models"].items()}
        result["micro"] = micro.run_micro(
            specs,
            args.device,
            args.precision,
            args.micro_reps,
            step_ms,
            log=_log,
            warmup=1 if args.smoke else 2,
        )
    result["wall_s"] = time.perf_counter() - t_start
    with contextlib.suppress(OSError):
        result["environment"]["loadavg_end"] = os.getloadavg()

    report = render(result, args)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "overhead.md").write_text(report + "\n")
        _log(f"wrote {out / 'overhead.json'} and {out / 'overhead.md'}")
    return result


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    env = result["environment"]
    cfg = result["config"]
    parts = [
        "## NumGuard overhead",
        "",
        f"`{result['command']}` — {env['device_name']} ({env['device']}, precision {env['precision']}), "
        f"torch {env['torch']}, pytorch_lightning {env['pytorch_lightning']}, {env['torch_threads']} torch "
        f"thread(s); up to {cfg['rounds']} interleaved rounds × {cfg['steps']} steps per fit, "
        f"first {cfg['warmup']} "
        f"discarded; host reads counted over {cfg['count_steps']} steps (first step excluded); "
        f"wall {result['wall_s']:.0f} s; lightning_numguard {env.get('lightning_numguard', '?')} sources "
        f"sha256 {env.get('lightning_numguard_sources', {}).get('sha256', '?')}.",
        "",
    ]
    for name, entry in result["models"].items():
        parts.append(
            model_table(
                name,
                f"{entry['description']} — {entry['rounds_run']} round(s)",
                entry["variants"],
                entry["host_reads"],
                args.device == "cuda",
            )
        )
        parts.append("")
    targets = []
    for name, entry in result["models"].items():
        d = entry["variants"].get("numguard_default")
        if d is not None:
            wall, cpu = d["ratio_median"], d["cpu_ratio_median"]
            targets.append(
                f"- {name} / numguard_default: step time {wall:.3f}× the baseline (wall clock), {cpu:.3f}× "
                f"(thread CPU time) — target ≤ {STEP_TARGET}×: "
                + ("met" if min(wall, cpu) <= STEP_TARGET else f"**MISSED** by {min(wall, cpu) - STEP_TARGET:.3f}×")
                + ("" if (wall <= STEP_TARGET) == (cpu <= STEP_TARGET) else " (the two clocks disagree: noise)")
            )
    for name, entry in result["models"].items():
        hr = entry["host_reads"]
        for v in VARIANTS:
            if not v.startswith("numguard"):
                continue
            if v in hr:
                g = hr[v]["per_step_guard"]
                if hr[v].get("error") or g != g:
                    targets.append(f"- {name} / {v}: host reads not measured: {hr[v].get('error')}")
                    continue
                targets.append(
                    f"- {name} / {v}: guard-caused host reads {g:.1f}/step — target ≤ {SYNC_TARGET:.0f}: "
                    + ("met" if g <= SYNC_TARGET else f"**MISSED** by {g - SYNC_TARGET:.1f}")
                )
    if "micro" in result:
        m = result["micro"]
        parts.append("## Micro-measurements")
        parts.append("")
        parts.append(micro_tables(m))
        parts.append("")
        for name, g in m["grad_check"].items():
            r = g["ratio_to_adamw"]["numguard_norm_candidates"]
            targets.append(
                f"- {name}: gradient check {r:.2f}× the AdamW step — target ≤ {micro.GRAD_CHECK_TARGET}×: "
                + ("met" if g["target_met"] else f"**MISSED** by {r - micro.GRAD_CHECK_TARGET:.2f}×")
            )
        for name, s in m["snapshot"].items():
            pct = s["amortised_pct_of_step"][str(micro.DEFAULT_SNAPSHOT_INTERVAL)]
            targets.append(
                f"- {name}: snapshot amortised at every {micro.DEFAULT_SNAPSHOT_INTERVAL} steps "
                f"{pct:.2f}% of a step "
                f"— target ≤ {micro.SNAPSHOT_TARGET_PCT:.0f}%: "
                + ("met" if s["target_met"] else f"**MISSED** by {pct - micro.SNAPSHOT_TARGET_PCT:.2f} points")
            )
    for name, entry in result["models"].items():
        if "profile" in entry:
            parts.append(profile_table(name, entry["profile"]))
            parts.append("")
    if targets:
        parts += ["## Targets", "", *targets, ""]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
