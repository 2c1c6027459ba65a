"""What the guard shows while training and after it: progress-bar counts and the end-of-fit summary.

Progress bar: once something has happened, ``nan_incidents``, ``rollbacks`` and ``spikes`` (each from its
first non-zero value on) go where the loop shows its progress (:meth:`Loop.show
<lightning_numguard.engine.loop.Loop.show>`: Lightning's progress bar, as integers). The keys are short so that
Rich does not crop them in an 80-column terminal (it cuts a word wider than its metrics column with "…"); the
loggers keep the ``numguard/<counter>`` tags. The counters are host integers: no device synchronisation, and
nothing is shown before the first incident.

Summary: at the end of ``fit`` (or when it raises), shown once. Without a Rich console: one report through
the ``lightning_numguard`` logger (WARNING when something happened, INFO otherwise). Under Rich's console
(:attr:`Loop.rich_console <lightning_numguard.engine.loop.Loop.rich_console>`: a ``RichProgressBar``): a table
printed through Rich's console (the one the bar draws on), with the path to
``events.jsonl`` on a line of its own (never folded by the table's width), and the text report at INFO
for log files. Text and table come from :mod:`lightning_numguard.reporting.summary`; only global rank 0
reports.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_numguard.engine.loop import Loop
from lightning_numguard.reporting.summary import FitSummary, rich_table, summarize, summary_text, where_lines

__all__ = ["PROGRESS_BAR_KEYS", "FitProgress"]

log = logging.getLogger(__name__)

#: Counters shown in the progress bar, each once it is non-zero: counter -> progress-bar key.
PROGRESS_BAR_KEYS: dict[str, str] = {"incidents": "nan_incidents", "rollbacks": "rollbacks", "spikes": "spikes"}


class FitProgress:
    """Per-fit tally the step records do not keep (steps lost to rollbacks), the bar entries and the summary."""

    def __init__(self) -> None:
        self.steps_lost_to_rollbacks = 0
        self.reported = False

    def after_step(self, loop: Loop, rec: Any, snapshot: Any, counters: dict[str, int], outcome: Any = None) -> None:
        """At batch end, after the step's action (``outcome``: what was done): count the steps a new rollback
        discarded; update the bar."""
        if rec.events and rec.action == "rollback" and snapshot is not None:  # the updates the restore discarded
            self.steps_lost_to_rollbacks += (outcome.steps_lost if outcome is not None else None) or 0
        if not any(map(counters.get, PROGRESS_BAR_KEYS)):  # the usual: nothing to show yet
            return
        shown = {key: int(counters[c]) for c, key in PROGRESS_BAR_KEYS.items() if counters.get(c, 0) > 0}
        if shown:
            loop.show(shown)

    def report(
        self,
        loop: Loop,
        events: list[dict[str, Any]],
        counters: dict[str, int],
        events_path: Any,
        ended: str = "finished",
        resumed_from: str | None = None,
        device_faults: dict[int, dict[str, Any]] | None = None,
        quarantined_steps: int = 0,
    ) -> FitSummary | None:
        """The end-of-fit summary once per fit (global rank 0): logged, or printed as a table under a Rich bar
        (``resumed_from``: the ``events.jsonl`` of the run this one resumed from, named after this run's)."""
        if self.reported:
            return None
        self.reported = True
        if not loop.is_zero:
            return None
        path = str(events_path) if events_path is not None and events_path.exists() else None
        found = resumed_from is not None and Path(resumed_from).exists()
        summary = summarize(
            events,
            counters,
            self.steps_lost_to_rollbacks,
            loop.step,
            path,
            ended,
            resumed_from,
            found,
            quarantined_steps=quarantined_steps,
            device_faults=device_faults,
        )
        table = summary.eventful and loop.rich_console
        level = logging.WARNING if summary.eventful and not table else logging.INFO  # the table shows it already
        log.log(level, "%s", summary_text(summary))
        if table:
            from rich import get_console  # RichProgressBar draws on Rich's global console (reconfigured by it)

            # one print (one redraw of a live bar); soft_wrap: the path is never folded mid-word at the console's width
            where = where_lines(summary) if summary.events_path or summary.resumed_from else []
            get_console().print(rich_table(summary), *where, sep="\n", soft_wrap=True, markup=False, highlight=False)
        return summary
