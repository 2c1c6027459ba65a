"""The picture of a run: loss and gradient norm over the steps, the spike threshold, and what the guard did.

One figure, drawn from the events and the trace (:mod:`~lightning_numguard.reporting.trace`): panels for the
loss, the gradient norm and (when the spike statistics ran) the z-scores with the spike threshold; on every
panel, a line at each incident's step, a shaded span for each rollback (from the snapshot's step to the step
rolled back) and markers along the top of the loss panel for incidents (labelled with the culprit), skips,
rollbacks, halts, spikes and overflow risks.

Two ways out: ``numguard plot PATH -o run.png`` (:func:`plot_run`, from the files alone) and, at the end of a fit
that had any event (or a halt), one image on every logger that takes one (:func:`send_figure`: TensorBoard's
``add_figure``, MLflow's ``log_figure``, W&B's ``log_image``). ``matplotlib`` is the optional ``plot`` extra
(``pip install 'lightning-numguard[plot]'``); it is imported only here, and only when a picture is drawn.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_numguard.errors import NumGuardError
from lightning_numguard.reporting.events import acting, counts_as_incident, read_events
from lightning_numguard.reporting.trace import TRACE_FILENAME, Trace, read_trace

__all__ = ["FIGURE_TAG", "MissingMatplotlib", "figure", "plot_run", "require_matplotlib", "send_figure"]

log = logging.getLogger(__name__)

#: The image's tag on the loggers.
FIGURE_TAG = "numguard/run"
#: Culprit labels drawn at most (the first incident of each culprit).
MAX_LABELS = 8
#: Marker rows along the top of the loss panel: category -> (y in axes fraction, marker, colour, legend label).
MARKERS: Mapping[str, tuple[float, str, str, str]] = {
    "incident": (0.93, "X", "tab:red", "incident"),
    "skip": (0.85, "v", "tab:orange", "skipped step"),
    "rollback": (0.77, "<", "tab:blue", "rollback (span rolled back shaded)"),
    "halt": (0.93, "s", "black", "halt"),
    "spike": (0.69, "^", "tab:purple", "spike"),
    "overflow_risk": (0.61, "D", "tab:green", "overflow risk"),
}


class MissingMatplotlib(NumGuardError):
    """The picture needs matplotlib, the ``plot`` extra."""


def require_matplotlib() -> Any:
    """``matplotlib`` (Agg backend, no window), or :class:`MissingMatplotlib` saying how to install it."""
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401 - the part used
    except ImportError:
        raise MissingMatplotlib(
            "NumGuard: the run's picture needs matplotlib, which is not installed: "
            "pip install 'lightning-numguard[plot]' (or pip install matplotlib)"
        ) from None
    return matplotlib


def _category(event: Mapping[str, Any]) -> list[str]:
    kind, action = str(event.get("kind", "")), str(event.get("action", ""))
    found = []
    if kind == "overflow_risk":
        found.append("overflow_risk")
    elif kind.endswith("_spike"):
        found.append("spike")
    elif counts_as_incident(event):
        found.append("incident")
    if acting(action):
        found.append(action)
    return found


def _culprit(event: Mapping[str, Any]) -> str:
    where = event.get("where") or []
    name = str(event.get("module") or event.get("op") or (where[0] if where else event.get("kind", "")))
    return name if len(name) <= 32 else "…" + name[-31:]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("s" if n != 1 else "")


def _summary(events: Sequence[Mapping[str, Any]]) -> str:
    """The title: incidents as the ``incidents`` counter counts them, then the steps of each marker."""
    steps = {c: len({int(e["step"]) for e in events if c in _category(e)}) for c in MARKERS}
    parts = [_plural(sum(counts_as_incident(e) for e in events), "incident")]
    parts += [f"{steps['skip']} skipped"] * bool(steps["skip"])
    parts += [_plural(steps[c], c.replace("_", " ")) for c in ("rollback", "spike", "overflow_risk") if steps[c]]
    return ", ".join(parts + ["halted"] * bool(steps["halt"]))


def figure(events: Sequence[Mapping[str, Any]], trace: Trace | None = None, title: str | None = None) -> Any:
    """The run's ``matplotlib.figure.Figure`` (not attached to pyplot: nothing global changes)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    rows = trace.rows() if trace is not None else []
    steps = [r[0] for r in rows]
    columns = list(zip(*[r[1:] for r in rows], strict=True)) if rows else [(), (), (), ()]
    sigma = trace.sigma if trace is not None and trace.sigma is not None else _sigma(events)
    has_z = any(math.isfinite(v) for col in columns[2:] for v in col)
    n = 3 if has_z else 2
    fig = Figure(figsize=(10, 2.6 * n + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(n, 1, sharex=True)
    for ax, values, label, colour in (
        (axes[0], columns[0], "loss", "tab:gray"),
        (axes[1], columns[1], "grad norm", "k"),
    ):
        if values:
            ax.plot(steps, values, color=colour, lw=1.0, label=label)
        finite = [v for v in values if math.isfinite(v) and v > 0]
        if finite and len(finite) == sum(math.isfinite(v) for v in values) and max(finite) / min(finite) > 50:
            ax.set_yscale("log")
        ax.set_ylabel(label)
    if has_z:
        ax = axes[2]
        ax.plot(steps, columns[2], color="tab:gray", lw=1.0, label="loss z-score")
        ax.plot(steps, columns[3], color="k", lw=1.0, label="grad norm z-score")
        if sigma is not None:
            ax.axhline(sigma, color="tab:red", ls="--", lw=1.0, label=f"spike threshold (sigma={sigma:g})")
        ax.set_yscale("symlog", linthresh=max(sigma or 1.0, 1.0))  # a spike's z of 100s and the threshold, both seen
        ax.set_ylabel("z-score")
        ax.legend(loc="upper left", fontsize=7)
    _events(axes, events)
    axes[-1].set_xlabel("step")
    fig.suptitle(title or f"NumGuard: {_summary(events)}", fontsize=11)
    return fig


def _sigma(events: Sequence[Mapping[str, Any]]) -> float | None:
    for e in events:
        sigma = (e.get("details") or {}).get("sigma")
        if isinstance(sigma, int | float):
            return float(sigma)
    return None


def _events(axes: Any, events: Sequence[Mapping[str, Any]]) -> None:
    """The markers, the incident lines, the rollback spans and the culprit labels."""
    top = axes[0]
    where = top.get_xaxis_transform()  # x in steps, y in axes fraction
    by_category, spans = _marks(events)
    _label_culprits(top, where, events)
    for ax in axes:
        for step in sorted(by_category["incident"] | by_category["halt"]):
            ax.axvline(step, color="tab:red", alpha=0.35, lw=1.0)
        for start, end in sorted(spans):
            ax.axvspan(start, end, color="tab:blue", alpha=0.12, lw=0)
    for category, (y, marker, colour, label) in MARKERS.items():
        xs = sorted(by_category[category])
        if xs:
            top.scatter(xs, [y] * len(xs), transform=where, marker=marker, color=colour, s=36, label=label, zorder=5)
    if any(by_category.values()) or axes[0].lines:
        top.legend(loc="lower left", fontsize=7, ncol=3)
    if not axes[0].lines and events:  # no trace: the events' steps set the range
        steps = [int(e["step"]) for e in events]
        top.set_xlim(min(steps) - 1, max(steps) + 1)


def _marks(events: Sequence[Mapping[str, Any]]) -> tuple[dict[str, set[int]], set[tuple[int, int]]]:
    """The steps of each marker category, and the spans the rollbacks gave up (snapshot step to the bad step)."""
    by_category: dict[str, set[int]] = {c: set() for c in MARKERS}
    spans: set[tuple[int, int]] = set()
    for e in events:
        step = int(e["step"])
        for category in _category(e):
            by_category[category].add(step)
        start = (e.get("details") or {}).get("snapshot_step")
        if e.get("action") == "rollback" and isinstance(start, int) and start <= step:
            spans.add((start, step))
    return by_category, spans


def _label_culprits(top: Any, where: Any, events: Sequence[Mapping[str, Any]]) -> None:
    """The culprit of each incident, at most :data:`MAX_LABELS` of them, each named once."""
    labelled: set[str] = set()
    for e in events:
        culprit = _culprit(e)
        if "incident" not in _category(e) or len(labelled) >= MAX_LABELS or culprit in labelled:
            continue
        labelled.add(culprit)
        top.annotate(
            culprit, (int(e["step"]), 0.93), xycoords=where, xytext=(4, -12), textcoords="offset points",
            fontsize=7, color="tab:red", clip_on=True,
        )  # fmt: skip


def _events_file(path: Path) -> Path:
    if path.is_dir():
        from lightning_numguard.reporting.explain import find_events_files

        found = find_events_files(path)
        if not found:
            raise NumGuardError(f"NumGuard: no events.jsonl under {path}")
        return found[0]
    if not path.is_file():
        raise NumGuardError(f"NumGuard: {path} does not exist")
    return path


def plot_run(path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Path:
    """Draw a run from its files: ``path`` is its ``events.jsonl`` or a folder holding one (the newest); the
    ``trace.csv`` beside it, when there is one, gives the curves. Writes ``output`` (default: ``run.png`` beside
    ``events.jsonl``; the format from its suffix) and returns it."""
    require_matplotlib()
    events_path = _events_file(Path(path))
    events, _ = read_events(events_path)
    trace_path = events_path.with_name(TRACE_FILENAME)
    trace = read_trace(trace_path) if trace_path.is_file() else None
    out = Path(output) if output is not None else events_path.with_name("run.png")
    fig = figure(events, trace)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def rgb_array(fig: Any) -> Any:
    """The figure drawn to an ``(H, W, 3)`` uint8 array."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def send_figure(loggers: Sequence[Any], fig: Any, step: int, is_tensorboard: Any) -> list[str]:
    """``fig`` to every logger that takes an image, under :data:`FIGURE_TAG`; the names of those that took it."""
    took: list[str] = []
    image = None
    for lg in loggers:
        try:
            if is_tensorboard(lg):
                lg.experiment.add_figure(FIGURE_TAG, fig, global_step=step, close=False)
                lg.experiment.flush()
            elif type(lg).__name__ == "MLFlowLogger" and hasattr(lg.experiment, "log_figure"):
                lg.experiment.log_figure(lg.run_id, fig, f"{FIGURE_TAG}.png")
            elif callable(getattr(lg, "log_image", None)):  # W&B, and loggers with the same call
                image = rgb_array(fig) if image is None else image
                lg.log_image(key=FIGURE_TAG, images=[image], step=step)
            else:
                continue
            took.append(type(lg).__name__)
        except Exception as err:  # a broken logger must not kill training
            log.warning("numguard could not send the run's picture to logger %s: %s", type(lg).__name__, err)
    return took
