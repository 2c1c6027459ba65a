"""The guard's host time per step, the device work taken out: the table of ``docs/performance.md``.

    python -m benchmarks.host_time [--rounds 5] [--steps 60] [--models tiny,mlp] [--parts] [--before REV]
                                   [--write docs/performance.md]

Two models of one shape, the benchmark MLP (512-768-768-768-10, 1.6M parameters, batch 128) and the same
four-``Linear`` network 8 wide (batch 4), whose kernels cost next to nothing: on the tiny one the step time added to
the plain step is the host time the guard adds, what a launch-bound GPU step pays. Interleaved rounds of whole
fits on one torch thread (``baseline``, ``numguard_default``, ``floor_default``), thread CPU time per step (a shared
machine's other tenants do not inflate it), median over the steps after the warm-up, then over rounds; the added
time is the median over rounds of each round's difference with its own baseline. The last column is the guard's
own hooks, timed inside them (``benchmarks.hook_profile``), in microseconds per step, and the largest parts.

``--parts`` times, in the same interleaved rounds, the defaults with one part left out each and the floor without
its output reads (``benchmarks.variants.PARTS``, ``FLOOR_PARTS``), and prints (and writes) what each part adds to a
step: the median over rounds of the defaults' step minus the step without the part (on the tiny model: on the
benchmark MLP a part's tens of microseconds drown in its step's noise). ``--write`` with ``--models`` naming one model
writes the parts table only.

``--before REV`` times the guard of git revision ``REV`` (``benchmarks.compare_revisions``: its package under another
name) in the same interleaved rounds, and prints (and writes) what this checkout's guard adds against what ``REV``'s
does: a change's effect measured in one run, where two runs of the same code differ by tens of microseconds here.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import quiet, time_model
from benchmarks.hook_profile import hook_times
from benchmarks.variants import FLOOR_PARTS, PARTS
from instruments import bench_models
from instruments.markdown import replace_block

VARIANTS = ["baseline", "numguard_default", "floor_default"]


def tiny_mlp(n_batches: int) -> bench_models.ModelSpec:
    """The benchmark MLP's four ``Linear`` layers and GELUs, 8 wide, batch 4: kernels that cost next to nothing."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = bench_models.MLP(d_in=8, hidden=8, classes=4)
    w = torch.randn(8, 4, generator=g)
    batches = []
    for _ in range(n_batches):
        x = torch.randn(4, 8, generator=g)
        batches.append((x, (x @ w).argmax(1)))
    module = bench_models.BenchModule(net)
    init = {k: v.detach().clone() for k, v in module.state_dict().items()}
    n = sum(p.numel() for p in module.parameters())
    return bench_models.ModelSpec("tiny", module, init, batches, n, "MLP 8-8-8-8-4 (GELU), batch 4")


def measure(spec: bench_models.ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    variants = VARIANTS + ([*PARTS, *FLOOR_PARTS] if args.parts else [])
    if args.before:  # the guard of that revision, in the same rounds
        variants.append("before_numguard_default")
    timed = time_model(spec, variants, args)
    base = timed["baseline"]["rounds"]
    out: dict[str, Any] = {"description": spec.description}
    for v in variants:
        rounds = timed[v]["rounds"]
        added = [1e3 * (x["median_cpu_step_ms"] - b["median_cpu_step_ms"]) for x, b in zip(rounds, base)]
        out[v] = {
            "cpu_step_ms": statistics.median(x["median_cpu_step_ms"] for x in rounds),
            "added_us": statistics.median(added),
            "ratio": timed[v]["cpu_ratio_median"],
        }
    if args.parts:  # what each part adds: the round's full step minus the round's step without it
        for v, whole in [*((v, "numguard_default") for v in PARTS), *((v, "floor_default") for v in FLOOR_PARTS)]:
            rounds = zip(timed[whole]["rounds"], timed[v]["rounds"])
            out[v]["part_us"] = statistics.median(
                1e3 * (a["median_cpu_step_ms"] - b["median_cpu_step_ms"]) for a, b in rounds
            )
    profile = hook_times(spec, "numguard_default", args)
    parts = sorted(((us, k.split(":", 1)[1]) for k, (us, _) in profile["rows"].items()), reverse=True)
    out["hooks_us"] = profile["hooks_us"]
    out["parts"] = [(name, us) for us, name in parts if "." in name and not name.startswith("NumGuardCallback.")][:4]
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | plain step (thread CPU) | guard: step, added, ratio | floor: step, added, ratio "
        "| the guard's hooks, timed inside (largest parts) |",
        "|---|---:|---|---|---|",
    ]
    for name, r in results.items():
        g, f = r["numguard_default"], r["floor_default"]
        parts = ", ".join(f"`{n}` {us:.0f}" for n, us in r["parts"])
        lines.append(
            f"| {name}: {r['description']} | {r['baseline']['cpu_step_ms']:.2f} ms "
            f"| {g['cpu_step_ms']:.2f} ms, +{g['added_us']:.0f} µs, {g['ratio']:.2f}× "
            f"| {f['cpu_step_ms']:.2f} ms, +{f['added_us']:.0f} µs, {f['ratio']:.2f}× "
            f"| {r['hooks_us']:.0f} µs ({parts}) |"
        )
    return "\n".join(lines)


def before_table(results: dict[str, dict[str, Any]], rev: str) -> str:
    """Per model, what this checkout's guard and revision ``rev``'s add to the plain step, in the same rounds."""
    lines = [f"| model | `{rev}`: added | this revision: added | difference |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        before, now = r["before_numguard_default"]["added_us"], r["numguard_default"]["added_us"]
        lines.append(f"| {name} | +{before:.0f} µs | +{now:.0f} µs | {now - before:+.0f} µs |")
    return "\n".join(lines)


def parts_table(results: dict[str, dict[str, Any]]) -> str:
    """Per model, what each part of the defaults (and the floor's output reads) adds to a step, in µs."""
    names = {**PARTS, **FLOOR_PARTS}
    lines = ["| model | " + " | ".join(names.values()) + " |", "|---|" + "---:|" * len(names)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[v]['part_us']:+.0f} µs" for v in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--models", default="tiny,mlp", help="of tiny (the host cost) and mlp (the benchmark MLP)")
    p.add_argument("--parts", action="store_true", help="also what each part of the defaults adds to a step")
    p.add_argument("--before", metavar="REV", help="also the guard of this git revision, in the same rounds")
    p.add_argument("--write", metavar="MARKDOWN", help="replace the host_time block(s) of this file")
    args = p.parse_args(argv)
    models = args.models.split(",")
    if not models or set(models) - {"tiny", "mlp"}:
        p.error(f"--models takes tiny and/or mlp, got {args.models!r}")
    args.device, args.precision = "cpu", "32"
    torch.set_num_threads(1)
    quiet()
    make = {"tiny": lambda: tiny_mlp(args.steps + 2), "mlp": lambda: bench_models.build("mlp", args.steps + 2, "cpu")}
    specs = [make[m]() for m in models]
    with tempfile.TemporaryDirectory(prefix="numguard-before-") as tmp:
        if args.before:  # that revision's package, importable under another name, as the variant before_*
            from benchmarks import compare_revisions  # (the timed fits of host_instructions import this module)

            compare_revisions.extract(args.before, Path(tmp))
            sys.path.insert(0, tmp)
            compare_revisions.register(importlib.import_module(compare_revisions.ALIAS))
        results = {spec.name: measure(spec, args) for spec in specs}
    text = table(results)
    print(text)
    if args.write and len(results) == len(make):  # the table holds every model: a subset leaves it as it is
        replace_block(args.write, "host_time", text)
    if args.parts:
        parts = parts_table(results)
        print(parts)
        if args.write:
            replace_block(args.write, "host_time_parts", parts)
    if args.before:
        before = before_table(results, args.before)
        print(before)
        if args.write:
            replace_block(args.write, "host_time_before", before)


if __name__ == "__main__":
    main()
