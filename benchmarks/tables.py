"""Markdown tables of a ``benchmarks.overhead`` result, and its verdict against the targets.

Every verdict is computed from a number the tables print, measured by the clock the tables name:
the step-time target from the "ratio vs baseline" column (the step clock: ``perf_counter`` wall
time on CPU, CUDA events on CUDA), never from the thread-CPU-time column, which is printed as
secondary information only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ALL_CHECKS_TARGET",
    "GRAD_CHECK_TARGET",
    "OPGUARD_TARGET",
    "SNAPSHOT_TARGET_INTERVAL",
    "SNAPSHOT_TARGET_PCT",
    "STEP_TARGET",
    "SYNC_TARGET",
    "Verdict",
    "micro_tables",
    "model_table",
    "profile_table",
    "render",
    "verdicts",
]

STEP_TARGET = 1.02  # numguard_default step time vs the plain Trainer, on the step clock (CPU)
ALL_CHECKS_TARGET = 1.05  # numguard_all (every check every step), likewise
SYNC_TARGET = 1.0  # guard-caused host reads per step (0 under sync_mode="deferred")
GRAD_CHECK_TARGET = 0.25  # x the AdamW step
OPGUARD_TARGET = 1.01  # the LM forward (+ loss) inside the op guard vs without it (micro d)
SNAPSHOT_TARGET_PCT = 1.0  # % of a step, amortised at the default interval
SNAPSHOT_TARGET_INTERVAL = 50  # NumGuardCallback's default snapshot_every_n_steps
#: The variant of ``instruments.floor`` under each judged guard variant: the same reads and nothing else.
FLOORS = {"numguard_default": "floor_default", "numguard_all": "floor_all"}


@dataclass(frozen=True)
class Verdict:
    """One target: the measured ``value`` (as printed in a table), the ``target`` and whether it is met."""

    what: str
    value: float | None
    target: float
    unit: str
    clock: str
    note: str = ""

    @property
    def met(self) -> bool | None:
        """``None`` when not measured (an error, or NaN)."""
        if self.value is None or self.value != self.value:
            return None
        return self.value <= self.target

    def line(self) -> str:
        """The markdown bullet of ``## Targets``."""
        fmt = {"×": ".3f", "reads/step": ".1f", "%": ".2f"}.get(self.unit, ".2f")
        if self.value is None or self.met is None:
            return f"- {self.what}: not measured{': ' + self.note if self.note else ''}"
        unit = self.unit if self.unit in ("×", "%") else f" {self.unit}"
        verdict = "met" if self.met else f"**MISSED** by {self.value - self.target:{fmt}}{unit}"
        note = f" ({self.note})" if self.note else ""
        return (
            f"- {self.what}: {self.value:{fmt}}{unit} [{self.clock}] — target ≤ {self.target:g}{unit}: {verdict}{note}"
        )

    def to_json(self) -> dict[str, Any]:
        """The verdict as stored in ``overhead.json`` (``met`` included)."""
        return asdict(self) | {"met": self.met}


def grad_check_ratio(g: dict[str, Any]) -> float:
    """Micro (a): the guard's gradient check, in AdamW steps (the number printed in the table)."""
    return float(g["ratio_to_adamw"]["numguard_grads"])


def snapshot_pct(s: dict[str, Any]) -> float:
    """Micro (b): snapshot amortised at the default interval, % of a step (printed in the table)."""
    return float(s["amortised_pct_of_step"][str(SNAPSHOT_TARGET_INTERVAL)])


def verdicts(result: dict[str, Any]) -> list[Verdict]:
    """Every target of ``result``, each from the printed number of the clock the tables name."""
    clock = result["environment"]["step_clock"]
    out: list[Verdict] = []
    for name, entry in result["models"].items():
        for variant, target in (("numguard_default", STEP_TARGET), ("numguard_all", ALL_CHECKS_TARGET)):
            d = entry["variants"].get(variant)
            if d is not None:
                note = f"thread CPU time, not judged: {d['cpu_ratio_median']:.3f}×"
                floor = entry["variants"].get(FLOORS[variant])
                if floor is not None:  # what only reading the same values costs, in the same rounds
                    note += f"; floor ({FLOORS[variant]}): {floor['ratio_median']:.3f}×"
                    if "hook_pct_of_baseline_cpu" in floor:
                        note += f", its own hooks {floor['hook_pct_of_baseline_cpu']:.1f} % of a step's CPU time"
                title = f"{name} / {variant} step time vs baseline"
                out.append(Verdict(title, d["ratio_median"], target, "×", clock, note))
    for name, entry in result["models"].items():
        for v, hr in entry["host_reads"].items():
            if v.startswith("numguard"):
                value = None if hr.get("error") else hr["per_step_guard"]
                out.append(
                    Verdict(
                        f"{name} / {v}: guard-caused host reads",
                        value,
                        0.0 if v == "numguard_deferred" else SYNC_TARGET,
                        "reads/step",
                        "SyncCounter",
                        hr.get("error") or "",
                    )
                )
    if "micro" in result:
        out += _micro_verdicts(result["micro"])
    return out


def _micro_verdicts(m: dict[str, Any]) -> list[Verdict]:
    """The micro-benchmarks' targets: the gradient check, the op guard, the snapshots."""
    out: list[Verdict] = []
    for name, g in m["grad_check"].items():
        out.append(
            Verdict(
                f"{name}: gradient check vs the AdamW step",
                grad_check_ratio(g),
                GRAD_CHECK_TARGET,
                "×",
                "perf_counter (micro)",
            )
        )
    for name, d in m.get("opguard", {}).items():
        paired = float(d["ratio_to_forward"]["forward_opguard"])
        calls = f"{d['guarded_calls_per_forward']} guarded call(s) per forward"
        if "in_situ_ratio" in d:  # judged on the guard's own time; the paired whole-forward ratios for reference
            cpu = d["cpu_ratio_to_forward"]["forward_opguard"]
            value, clock = float(d["in_situ_ratio"]), "thread CPU time of the guard's own work, in situ (micro)"
            note = f"{calls}; two whole forwards paired, not judged: wall {paired:.3f}×, thread CPU {cpu:.3f}×"
        else:
            value, clock, note = paired, "perf_counter (micro)", calls
        what = f"{name}: forward with the op guard vs without it"
        out.append(Verdict(what, value, OPGUARD_TARGET, "×", clock, note))
    for name, s in m["snapshot"].items():
        out.append(
            Verdict(
                f"{name}: snapshot amortised at every {SNAPSHOT_TARGET_INTERVAL} steps, of a step",
                snapshot_pct(s),
                SNAPSHOT_TARGET_PCT,
                "%",
                f"perf_counter (micro) / {s.get('step_ms_source', 'step clock')}",
            )
        )
    return out


def model_table(name: str, desc: str, res: dict[str, Any], syncs: dict[str, Any], clock: str) -> str:
    """One model: every variant's step time on the step clock ``clock``, ratios, host reads."""
    cuda = clock == "CUDA events"
    head = (
        f"| variant | median step (ms, {clock}) | ratio vs baseline (median of rounds) | ratio min–max | ratio IQR "
        "| thread-CPU-time ratio (median, IQR; not judged) | host reads / step (all) | of which guard-caused |"
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
        if "hook_pct_of_baseline_cpu" in r:
            lo, hi = r["hook_pct_iqr"]
            notes.append(
                f"{v}: its own hooks take {r['median_hook_ms']:.3f} ms of thread CPU time per step, "
                f"{r['hook_pct_of_baseline_cpu']:.2f} % (IQR {lo:.2f}–{hi:.2f}) of the baseline step's: "
                "the floor's reads, without their indirect costs"
            )
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
    """Micro (a)-(d) of ``benchmarks.micro.run_micro``'s result."""
    out = ["### (a) gradient check vs the AdamW step (median ms per call; ratio to AdamW step)", ""]
    cols = [
        "adamw_step",
        "numguard_grads",
        "numguard_params_and_grads",
        "foreach_norm_inf",
        "per_tensor_isfinite_all",
        "per_tensor_isfinite_bool",
        "amp_foreach_non_finite_check_and_unscale",
    ]
    out.append("| params | tensors / values | " + " | ".join(cols) + f" | target ≤ {GRAD_CHECK_TARGET}× met |")
    out.append("|---|---:|" + "---:|" * len(cols) + "---|")
    for name, g in m["grad_check"].items():
        cells = [f"{g['times'][c]['median_ms']:.3f} ({g['ratio_to_adamw'][c]:.2f}×)" for c in cols]
        out.append(
            f"| {name} | {g['n_tensors']} / {g['n_values'] / 1e6:.2f}M | "
            + " | ".join(cells)
            + f" | {'yes' if grad_check_ratio(g) <= GRAD_CHECK_TARGET else 'NO'} |"
        )
    out += [
        "",
        "### (b) snapshot and (c) rollback",
        "",
        "| model | host bytes / snapshot | capture (ms) | + optimizer-state check (ms) | first capture (ms) "
        "| step (ms) | amortised % of a step @10 / @50 / @100 "
        f"| target ≤ {SNAPSHOT_TARGET_PCT:g}% @{SNAPSHOT_TARGET_INTERVAL} met | restore (ms) "
        "| restore in steps |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, s in m["snapshot"].items():
        a = s["amortised_pct_of_step"]
        out.append(
            f"| {name} | {s['host_bytes'] / 2**20:.1f} MiB | {s['times']['capture']['median_ms']:.2f} | "
            f"{s['times']['optimizer_state_check']['median_ms']:.2f} | {s['first_capture_ms']:.1f} | "
            f"{s['step_ms']:.2f} | {a['10']:.2f} / {a['50']:.2f} / {a['100']:.2f} | "
            f"{'yes' if snapshot_pct(s) <= SNAPSHOT_TARGET_PCT else 'NO'} | {s['times']['restore']['median_ms']:.2f} | "
            f"{s['restore_in_steps']:.2f} |"
        )
    if m["opguard"]:
        out += [
            "",
            "### (d) op guard and forward hooks over the LM forward + loss "
            "(median ms; median of the per-round ratios to the plain forward of the same round)",
            "",
            "| model | forward | OpGuard active | OpGuard entered but disabled | OutputWatch hooks | guarded calls "
            "| OpGuard active, thread CPU time | the guard's own work in situ (ms, × the forward) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, o in m["opguard"].items():
            t, rr = o["times"], o["ratio_to_forward"]
            cells = [
                f"{t[k]['median_ms']:.2f} ({rr[k]:.3f}×)"
                for k in ("forward", "forward_opguard", "forward_opguard_disabled", "forward_output_watch")
            ]
            cpu = o.get("cpu_ratio_to_forward", {}).get("forward_opguard")
            cpu_cell = f"{cpu:.3f}×" if cpu is not None else "–"
            situ = f"{o['in_situ_ms_per_forward']:.3f} ({o['in_situ_ratio']:.4f}×)" if "in_situ_ratio" in o else "–"
            out.append(
                f"| {name} | " + " | ".join(cells) + f" | {o['guarded_calls_per_forward']} | {cpu_cell} | {situ} |"
            )
    return "\n".join(out)


def profile_table(name: str, prof: dict[str, Any]) -> str:
    """``--profile``: guard time per step by entry point, and the guard functions with most self time."""
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


def render(result: dict[str, Any]) -> str:
    """The whole report: header, a table per model, micro, profiles, and ``## Targets``."""
    env = result["environment"]
    cfg = result["config"]
    parts = [
        "## NumGuard overhead",
        "",
        f"`{result['command']}` — {env['device_name']} ({env['device']}, precision {env['precision']}), "
        f"torch {env['torch']}, pytorch_lightning {env['pytorch_lightning']}, {env['torch_threads']} torch "
        f"thread(s); up to {cfg['rounds']} interleaved rounds × {cfg['steps']} steps per fit, "
        f"first {cfg['warmup']} discarded; step clock: {env['step_clock']}; host reads counted over "
        f"{cfg['count_steps']} steps (first step excluded); wall {result['wall_s']:.0f} s; lightning_numguard "
        f"{env.get('lightning_numguard', '?')} sources sha256 "
        f"{env.get('lightning_numguard_sources', {}).get('sha256', '?')}.",
        "",
    ]
    for name, entry in result["models"].items():
        desc = f"{entry['description']} — {entry['rounds_run']} round(s)"
        parts += [model_table(name, desc, entry["variants"], entry["host_reads"], env["step_clock"]), ""]
    if "micro" in result:
        parts += ["## Micro-measurements", "", micro_tables(result["micro"]), ""]
    for name, entry in result["models"].items():
        if "profile" in entry:
            parts += [profile_table(name, entry["profile"]), ""]
    targets = verdicts(result)
    if targets:
        parts += ["## Targets", "", *(t.line() for t in targets), ""]
    return "\n".join(parts)
