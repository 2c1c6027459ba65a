"""Micro-measurements of the guard's building blocks, interleaved, median of many calls.

(a) the gradient check alone (``checks.TotalPlan.total``, what the read runs on the gradients
    every step) against the AdamW ``optimizer.step()`` on the same parameters, and the
    alternatives: ``_foreach_norm(ord=inf)``, per-tensor ``isfinite().all()`` (stacked, no sync;
    and with one ``bool()`` per tensor),
    ``torch._amp_foreach_non_finite_check_and_unscale_``;
(b) snapshot cost: ``core.snapshot.capture`` of model + AdamW state (time, host bytes), amortised
    over ``snapshot_every_n_steps`` in {10, 50, 100};
(c) rollback latency: ``core.snapshot.restore``, in step-times;
(d) op-guard cost: the LM forward (+ loss) with ``core.opguard.OpGuard`` active vs not (and the
    forward hooks of ``core.watch.OutputWatch``, which the ``outputs`` check installs).

"Interleaved" means: every round runs each candidate once, in an order rotated by one each round,
so that machine drift hits all candidates alike. Times are per call, in milliseconds; on CUDA each
call is bracketed by ``torch.cuda.synchronize()``.

Run alone, from the repository root:
``python -m benchmarks.micro [--device cpu|cuda] [--models mlp,cnn,lm] [--reps N]``;
``python -m benchmarks.overhead`` runs it too (unless ``--no-micro``) and passes the Lightning
baseline step time in, so the snapshot and rollback costs are expressed in real step-times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.tables import GRAD_CHECK_TARGET, SNAPSHOT_TARGET_INTERVAL, SNAPSHOT_TARGET_PCT, micro_tables
from instruments import bench_models
from lightning_numguard.detect import checks
from lightning_numguard.detect.opguard import OpGuard
from lightning_numguard.detect.watch import OutputWatch
from lightning_numguard.state.snapshot import capture, restore

__all__ = ["interleaved", "run_micro"]

SNAPSHOT_INTERVALS = tuple(sorted({10, SNAPSHOT_TARGET_INTERVAL, 100}))  # snapshot_every_n_steps amortised over


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(
    cands: dict[str, Callable[[], Any]],
    reps: int,
    device: str,
    warmup: int = 2,
    cpu_times: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per-call times (ms) of each candidate, ``reps`` rounds, candidate order rotated each round.

    ``cpu_times``: filled with each call's thread CPU time (ms) too, which leaves out the time a shared machine's
    other tenants take (on CUDA, the host side only).
    """
    names = list(cands)
    for name in names:
        for _ in range(warmup):
            cands[name]()
    _sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = cands[name]
            _sync(device)
            c0 = time.thread_time()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
            if cpu_times is not None:
                cpu_times.setdefault(name, []).append((time.thread_time() - c0) * 1e3)
    return times


def _summ(ts: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    return {"median_ms": statistics.median(ts), "q1_ms": q[0], "q3_ms": q[2], "n": len(ts)}


def _prepare(spec: bench_models.ModelSpec, device: str, precision: str) -> tuple[Any, torch.optim.Optimizer]:
    """The module on ``device`` with AdamW state populated by two real steps and fresh gradients."""
    spec.reset()
    module = spec.module.to(device)
    module.train()
    opt = module.configure_optimizers()
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16)
        if precision == "bf16-mixed"
        else contextlib.nullcontext()
    )
    for i in range(3):
        x, y = spec.batches[i % len(spec.batches)]
        batch = (x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = module.loss(batch)
        loss.backward()
        if i < 2:
            opt.step()
    return module, opt


def grad_check(
    params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, reps: int, device: str, warmup: int = 2
) -> dict[str, Any]:
    """(a): the gradient check against the AdamW step on the same parameters."""
    grads = [p.grad for p in params if p.grad is not None]
    tensors = list(params)
    found_inf = torch.zeros(1, device=grads[0].device)
    inv_scale = torch.ones(1, device=grads[0].device)

    plan = checks.TotalPlan(grads)  # built once per fit, as StepRead.grads does
    device_ = grads[0].device

    def numguard_grads() -> torch.Tensor:  # what the read does with the gradients every step
        return plan.total(grads, device_, rewritable=True)

    def numguard_params_and_grads() -> torch.Tensor:
        # what a snapshot step (and check=[..., "params"]) adds: the parameters, read-only
        return plan.total(grads, device_, rewritable=True) + checks.norm_total(tensors, device_)

    def foreach_norm_inf() -> torch.Tensor:
        return (~torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf"))))).any()

    def per_tensor_isfinite() -> torch.Tensor:
        return torch.stack([torch.isfinite(g).all() for g in grads]).all()

    def per_tensor_isfinite_bool() -> bool:  # one host read per tensor (the naive callback)
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def amp_check_and_unscale() -> torch.Tensor:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return found_inf

    cands: dict[str, Callable[[], Any]] = {
        "adamw_step": opt.step,
        "numguard_grads": numguard_grads,
        "numguard_params_and_grads": numguard_params_and_grads,
        "foreach_norm_inf": foreach_norm_inf,
        "per_tensor_isfinite_all": per_tensor_isfinite,
        "per_tensor_isfinite_bool": per_tensor_isfinite_bool,
        "amp_foreach_non_finite_check_and_unscale": amp_check_and_unscale,
    }
    times = interleaved(cands, reps, device, warmup)
    out: dict[str, Any] = {
        "n_tensors": len(grads),
        "n_values": sum(g.numel() for g in grads),
        "times": {k: _summ(v) for k, v in times.items()},
    }
    adamw = out["times"]["adamw_step"]["median_ms"]
    out["ratio_to_adamw"] = {k: v["median_ms"] / adamw for k, v in out["times"].items()}
    out["target"] = f"numguard_grads <= {GRAD_CHECK_TARGET} x adamw_step"
    out["raw_ms"] = times
    return out


def synthetic_grad_check(device: str, reps: int, warmup: int = 2) -> dict[str, Any]:
    """(a) on DESIGN.md's reference shape: 1M fp32 gradient values in 16 tensors."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, 256, generator=g).to(device)) for _ in range(16)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device) * 1e-3
    opt.step()
    return grad_check(params, opt, reps, device, warmup)


def snapshot_and_restore(
    module: torch.nn.Module, opt: torch.optim.Optimizer, reps: int, device: str, step_ms: float
) -> dict[str, Any]:
    """(b) and (c): capture into host memory (reusing storage, as the callback does) and restore."""
    t0 = time.perf_counter()
    snap = capture(module, [opt], {}, step=0, where="host")
    _sync(device)
    first_ms = (time.perf_counter() - t0) * 1e3
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    opt_state = [t for t in state if t.is_floating_point()]
    box = {"snap": snap}

    def do_capture() -> None:
        box["snap"] = capture(module, [opt], {}, step=0, where="host", reuse=box["snap"])

    def do_restore() -> None:
        restore(box["snap"], module, [opt], {}, restore_rng=False)

    def optimizer_state_check() -> torch.Tensor:
        # the callback verifies the optimizer state finite before each snapshot
        return (~torch.isfinite(checks.norm_candidates(opt_state))).any()

    times = interleaved(
        {"capture": do_capture, "optimizer_state_check": optimizer_state_check, "restore": do_restore},
        reps,
        device,
        warmup=1,
    )
    cap = statistics.median(times["capture"])
    chk = statistics.median(times["optimizer_state_check"])
    res = statistics.median(times["restore"])
    out: dict[str, Any] = {
        "host_bytes": box["snap"].nbytes,
        "first_capture_ms": first_ms,
        "times": {k: _summ(v) for k, v in times.items()},
        "step_ms": step_ms,
        "amortised_pct_of_step": {str(n): 100.0 * (cap + chk) / (n * step_ms) for n in SNAPSHOT_INTERVALS},
        "restore_in_steps": res / step_ms,
        "target": f"capture + optimizer-state check <= {SNAPSHOT_TARGET_PCT}% of a step "
        f"at snapshot_every_n_steps={SNAPSHOT_TARGET_INTERVAL}",
        "raw_ms": times,
    }
    return out


class _TimedGuard(OpGuard):
    """``OpGuard`` that adds up the thread CPU time of its own work inside a forward: entering and leaving, and each
    guarded call's dispatch, check, record and sanitising (the original op excluded; the wrapper that calls
    ``call``, a thread-local lookup, is not timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.spent_s = 0.0
        self.calls = 0

    def __enter__(self) -> OpGuard:
        t0 = time.thread_time()
        try:
            return super().__enter__()
        finally:
            self.spent_s += time.thread_time() - t0

    def __exit__(self, *exc: object) -> None:
        t0 = time.thread_time()
        try:
            super().__exit__(*exc)
        finally:
            self.spent_s += time.thread_time() - t0

    def call(self, func: Any, args: Any, kwargs: Any) -> Any:
        self.calls += 1
        t0 = time.thread_time()
        try:
            return super().call(func, args, kwargs)
        finally:
            self.spent_s += time.thread_time() - t0

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return super()._run(func, args, kwargs)
        finally:
            self.spent_s -= time.thread_time() - t0  # the op's own time is not the guard's


def opguard_cost(
    module: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    reps: int,
    device: str,
    precision: str,
    warmup: int = 2,
) -> dict[str, Any]:
    """(d): the LM forward + loss (grad enabled, as in training) with and without the op guard."""
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16)
        if precision == "bf16-mixed"
        else contextlib.nullcontext()
    )
    guard = _TimedGuard()
    guard.check_cpu_calls = False  # as NumGuardCallback guards
    idle = OpGuard()
    idle.enabled = False
    guard.hold()  # as the callback does for a fit: entering then only pushes the guard
    idle.hold()
    watch = OutputWatch(module.net, depth=1)  # the default: blocks (watch_depth=1)

    def plain() -> None:
        with autocast:
            module.loss(batch)

    in_situ_ms: list[float] = []  # per guarded forward: the guard's own thread CPU time
    guarded_calls: list[int] = []  # per guarded forward: the calls of guarded functions (on the CPU clean ones
    # leave no record)

    def with_guard() -> None:
        guard.reset()
        before, calls = guard.spent_s, guard.calls
        with guard, autocast:
            module.loss(batch)
        in_situ_ms.append((guard.spent_s - before) * 1e3)
        guarded_calls.append(guard.calls - calls)

    def with_idle_guard() -> None:
        with idle, autocast:
            module.loss(batch)

    def with_watch() -> None:
        watch.attach()  # only for this candidate: the others run without the hooks
        try:
            with autocast:
                module.loss(batch)
        finally:
            watch.detach()

    cpu: dict[str, list[float]] = {}
    times = interleaved(
        {
            "forward": plain,
            "forward_opguard": with_guard,
            "forward_opguard_disabled": with_idle_guard,
            "forward_output_watch": with_watch,
        },
        reps,
        device,
        warmup,
        cpu,
    )
    guard.release()
    idle.release()
    base = times["forward"]
    return {
        "times": {k: _summ(v) for k, v in times.items()},
        # paired: each candidate against the plain forward of the same round (adjacent in time), median over
        # rounds; on a shared machine this cancels the slow drift that a ratio of two medians keeps
        "ratio_to_forward": {k: statistics.median(a / b for a, b in zip(v, base)) for k, v in times.items()},
        "ratio_of_medians": {k: statistics.median(v) / statistics.median(base) for k, v in times.items()},
        # the same pairing on the thread's CPU time (information only: the verdict stays on the wall clock)
        "cpu_ratio_to_forward": {
            k: statistics.median(a / b for a, b in zip(v, cpu["forward"])) for k, v in cpu.items()
        },
        # in situ: the guard's own work inside each guarded forward (its wrappers' pass-through and the original ops
        # excluded), over the plain forward's thread CPU time of the same round: the cost itself, free of the noise
        # of timing two whole forwards on a shared machine (their paired ratio varies by a few % between runs)
        "in_situ_ms_per_forward": statistics.median(in_situ_ms[warmup:]),
        "in_situ_ratio": 1 + statistics.median(a / b for a, b in zip(in_situ_ms[warmup:], cpu["forward"])),
        "guarded_calls_per_forward": max(guarded_calls),
        "raw_ms": times,
    }


def plain_step_ms(module: Any, opt: torch.optim.Optimizer, batch: Any, device: str, precision: str, reps: int) -> float:
    """Median time of a plain PyTorch training step (used when no Lightning baseline is given)."""
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16)
        if precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = module.loss(batch)
        loss.backward()
        opt.step()

    return statistics.median(interleaved({"step": step}, reps, device)["step"])


def run_micro(
    specs: dict[str, bench_models.ModelSpec],
    device: str,
    precision: str,
    reps: int,
    step_ms: dict[str, float] | None = None,
    log: Callable[[str], None] = print,
    warmup: int = 2,
) -> dict[str, Any]:
    """All micro-measurements for ``specs``; ``step_ms`` gives each model's Lightning baseline step time."""
    out: dict[str, Any] = {"reps": reps, "grad_check": {}, "snapshot": {}, "opguard": {}}
    log(f"[micro] grad check on 1M fp32 values in 16 tensors (DESIGN.md's reference), {reps} reps")
    out["grad_check"]["synthetic_1M_16"] = synthetic_grad_check(device, reps, warmup)
    for name, spec in specs.items():
        module, opt = _prepare(spec, device, precision)
        params = [p for g in opt.param_groups for p in g["params"]]
        log(f"[micro] {name}: grad check")
        out["grad_check"][name] = grad_check(params, opt, reps, device, warmup)
        x, y = spec.batches[0]
        batch = (x.to(device), y.to(device))
        denom = (step_ms or {}).get(name)
        source = "lightning baseline median step (end-to-end section)"
        if denom is None:
            denom = plain_step_ms(module, opt, batch, device, precision, max(5, reps // 4))
            source = "plain PyTorch step measured here"
        log(f"[micro] {name}: snapshot capture / restore")
        snap_reps = max(min(5, reps), reps // 3)
        out["snapshot"][name] = snapshot_and_restore(module, opt, snap_reps, device, denom)
        out["snapshot"][name]["step_ms_source"] = source
        if name == "lm":
            log(f"[micro] {name}: op guard over the forward")
            # 5x the repetitions: a 1% target on a ~13 ms forward needs many paired rounds on a shared machine
            out["opguard"][name] = opguard_cost(module, batch, 5 * reps, device, precision, warmup)
        opt.zero_grad(set_to_none=True)
        del opt
        spec.module.cpu()
        spec.reset()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.micro", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    p.add_argument("--models", default="mlp,cnn,lm")
    p.add_argument("--lm-size", choices=tuple(bench_models.LM_SIZES), default="small")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write DIR/micro.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = {m: bench_models.build(m, 4, args.device, args.lm_size) for m in args.models.split(",")}
    res = run_micro(specs, args.device, args.precision, args.reps)
    print(micro_tables(res))  # the same tables (and yes/NO against the targets) as the full benchmark
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "micro.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
