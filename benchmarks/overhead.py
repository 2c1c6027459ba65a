"""Is NumGuard cheap enough to leave on? Step-time overhead of the guard and its alternatives.

For each model (an MLP, a small CNN with BatchNorm, a small transformer LM) this trains the same
initial weights on the same in-process data with each *variant* (``benchmarks.variants``),
interleaved over rounds (round r runs every variant once, the order rotated by r, so drift on a
shared machine hits all variants alike), and reports the median over rounds of the per-round ratio
``median step time(variant) / median step time(baseline)`` with its spread, on one step clock
(``perf_counter`` on CPU, CUDA events on CUDA; ``benchmarks.harness``). The verdict against the
targets uses that same clock (``benchmarks.tables``). Host reads are counted in a separate, short
fit per variant; micro-measurements (``benchmarks.micro``) follow.

Usage, from the repository root:
  python -m benchmarks.overhead [--quick] [--rounds N] [--steps N] [--out DIR] [--models mlp,cnn,lm]
      [--device cpu|cuda] [--precision 32|bf16-mixed] [--lm-size small|100m] [--smoke] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import micro
from benchmarks.harness import count_syncs, environment, log, quiet, time_model
from benchmarks.profiling import profile_default
from benchmarks.tables import render, verdicts
from benchmarks.variants import DEFAULT_CHECKS, VARIANTS
from instruments import bench_models

# --quick / default / --smoke settings (explicit flags override them)
PRESETS: dict[str, dict[str, Any]] = {
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the preset (``--smoke`` / ``--quick`` / full) filled in where not given."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0], epilog="See benchmarks/README.md."
    )
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
    """Run the benchmark; print the report to stdout (progress to stderr); return the result."""
    args = parse_args(argv)
    quiet()
    if args.threads is None:
        # The project's CPU has 2 shared cores: with a second busy process, 2 OpenMP threads
        # spin and step times swing 3-4x; one thread measures far more repeatably.
        args.threads = 1 if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", __spec__.name if __spec__ else __name__]
            + (sys.argv[1:] if argv is None else argv)
        ),
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
        log(f"== {name}: {spec.description}")
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
                log(
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
            log(f"  {name}: cProfile of numguard_default")
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
            log=log,
            warmup=1 if args.smoke else 2,
        )
    result["wall_s"] = time.perf_counter() - t_start
    with contextlib.suppress(OSError):
        result["environment"]["loadavg_end"] = os.getloadavg()

    result["targets"] = [v.to_json() for v in verdicts(result)]
    report = render(result)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "overhead.md").write_text(report + "\n")
        log(f"wrote {out / 'overhead.json'} and {out / 'overhead.md'}")
    return result


if __name__ == "__main__":
    main()
