"""``--profile``: cProfile over the step windows, time inside ``lightning_numguard`` by entry point."""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
from typing import Any

from benchmarks.harness import StepClock, run_fit
from instruments import bench_models

__all__ = ["guard_breakdown", "profile_default"]


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
    those external calls (torch ops it runs included). The op guard's wrapper of a guarded function
    (``guarded`` in ``core/opguard/patch.py``; ``OpGuard.__torch_function__`` in older versions) is
    the one exception: its cumulative time includes the op it wraps, so only its own time and that
    of the guard functions it calls (the checks) are counted. Micro (d) measures the op guard on
    the whole forward.
    """
    torch_fn = [f for f in stats if _in_guard(f) and f[2] in ("__torch_function__", "guarded")]
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
