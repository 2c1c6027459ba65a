"""The run told in one picture (issue 27): every event step a point of the series, the trace beside
``events.jsonl``, the image on TensorBoard (read back from the event file) and from ``numguard plot``.

Real ``Trainer`` fits with a ×1000 loss spike at step 12 and a NaN loss at step 17, logging every 5 steps
(Lightning writes at steps 4, 9, 14, 19): the event steps 12 and 17 are not Lightning's, and are points anyway.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import STORE_EVERYTHING_SIZE_GUIDANCE, EventAccumulator

from lightning_numguard import NumGuardCallback
from lightning_numguard.cli import main
from lightning_numguard.errors import NonFiniteError, NumGuardWarning
from lightning_numguard.reporting import plot
from lightning_numguard.reporting.events import read_events
from lightning_numguard.reporting.trace import MAX_POINTS, TRACE_FILENAME, Trace, read_trace
from tests.helpers import FaultData, FaultModel, loader, trainer

SPIKE, NAN, EVERY, STEPS = 12, 17, 5, 24
SERIES = ("numguard/grad_norm", "numguard/grad_norm_zscore", "numguard/loss_zscore", "numguard/spike_threshold")


class SpikeModel(FaultModel):
    """NaN loss at ``NAN`` (``site="loss"``) and the loss ×1000 at ``SPIKE``; logs its loss as a user would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.detach())
        return loss * 1000 if self.global_step == SPIKE else loss


def _guard(tmp_path: Path, **kw: Any) -> NumGuardCallback:
    kw = {
        "action": "skip",
        "spike_action": "warn",
        "spikes": {"window": 8, "warmup": 4},
        "recovery": {"replay": False},
        **kw,
    }
    return NumGuardCallback(dirpath=str(tmp_path / "ng"), **kw)


def _fit(tmp_path: Path, guard: NumGuardCallback, logger: Any, site: str | None = "loss") -> Any:
    t = trainer(tmp_path, [guard], max_steps=STEPS, logger=logger, log_every_n_steps=EVERY)
    with pytest.warns(NumGuardWarning):
        t.fit(SpikeModel(site=site, step=NAN), loader(FaultData(n=8 * STEPS)))
    return t


def _accumulator(log_dir: str) -> EventAccumulator:
    ea = EventAccumulator(log_dir, size_guidance=STORE_EVERYTHING_SIZE_GUIDANCE)
    ea.Reload()
    return ea


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[NumGuardCallback, EventAccumulator, Path]:
    tmp = tmp_path_factory.mktemp("picture")
    guard = _guard(tmp)
    logger = TensorBoardLogger(tmp, name="tb")
    _fit(tmp, guard, logger)
    return guard, _accumulator(logger.log_dir), tmp


def test_every_event_step_is_a_point_of_the_series_besides_lightnings_steps(tb_run: Any) -> None:
    guard, ea, _ = tb_run
    assert [(e["kind"], e["step"]) for e in guard.events] == [
        ("loss_spike", SPIKE),
        ("grad_norm_spike", SPIKE),
        ("nonfinite_loss", NAN),
    ]
    lightning = [e.step for e in ea.Scalars("train_loss")]
    assert lightning == [4, 9, 14, 19]
    for tag in SERIES:
        steps = [e.step for e in ea.Scalars(tag)]
        assert set(lightning) - {NAN} <= set(steps), (tag, steps)
        assert SPIKE in steps, (tag, steps)  # the spike's step, which Lightning does not log
        assert len(steps) == len(set(steps)), (tag, steps)  # each step once
    grad = dict((e.step, e.value) for e in ea.Scalars("numguard/grad_norm"))
    assert grad[SPIKE] > 20 * max(v for s, v in grad.items() if s != SPIKE)  # the spike is on the curve
    threshold = {e.value for e in ea.Scalars("numguard/spike_threshold")}
    assert threshold == {guard.spikes.sigma}  # the z-score that makes a spike


def test_counters_are_written_when_they_move_not_as_copies(tb_run: Any) -> None:
    _, ea, _ = tb_run
    points = {tag: [(e.step, e.value) for e in ea.Scalars(f"numguard/{tag}")] for tag in ("spikes", "skipped_steps")}
    assert points["spikes"] == [(4, 0.0), (9, 0.0), (SPIKE, 1.0), (14, 1.0), (19, 1.0)]
    assert points["skipped_steps"] == [(4, 0.0), (9, 0.0), (14, 0.0), (NAN, 1.0), (19, 1.0)]
    rollbacks = [(e.step, e.value) for e in ea.Scalars("numguard/rollbacks")]
    assert rollbacks == [(4, 0.0), (9, 0.0), (14, 0.0), (19, 0.0)]


def test_the_picture_is_one_image_on_tensorboard(tb_run: Any) -> None:
    _, ea, _ = tb_run
    assert ea.Tags()["images"] == [plot.FIGURE_TAG]
    (image,) = ea.Images(plot.FIGURE_TAG)
    assert image.step == STEPS
    assert image.width >= 600 and image.height >= 400
    assert image.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_trace_holds_every_step_read_beside_events_jsonl(tb_run: Any) -> None:
    guard, _, tmp = tb_run
    trace = read_trace(tmp / "ng" / TRACE_FILENAME)
    assert trace.sigma == guard.spikes.sigma
    rows = {row[0]: row[1:] for row in trace.rows()}
    assert sorted(rows) == list(range(STEPS))
    assert rows[SPIKE][1] > 100 * rows[SPIKE - 1][1]  # the gradient norm of the spike step
    assert math.isnan(rows[NAN][0])  # the NaN loss
    assert math.isnan(rows[0][2]) and math.isfinite(rows[SPIKE][2])  # not judged in warm-up; judged later


def test_numguard_plot_draws_the_run_from_its_files(tb_run: Any, capsys: pytest.CaptureFixture[str]) -> None:
    guard, _, tmp = tb_run
    out = tmp / "run.png"
    assert main(["plot", str(tmp), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out) in capsys.readouterr().out
    events, _ = read_events(tmp / "ng" / "events.jsonl")
    fig = plot.figure(events, read_trace(tmp / "ng" / TRACE_FILENAME))
    assert guard.counters["incidents"] == 2  # the loss and gradient-norm spikes of one step are one incident
    assert fig.texts[0].get_text() == "NumGuard: 2 incidents, 1 skipped, 1 spike"
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert labels == {"loss"}  # the NaN loss's culprit
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "grad norm", "z-score"]


def test_numguard_plot_without_matplotlib_says_how_to_install_it(
    tb_run: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, tmp = tb_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["plot", str(tmp), "-o", str(tmp / "never.png")]) == 2
    assert "pip install 'lightning-numguard[plot]'" in capsys.readouterr().err
    assert not (tmp / "never.png").exists()


def test_a_clean_run_writes_no_trace_and_no_image(tmp_path: Path) -> None:
    guard = _guard(tmp_path, spike_action=None)
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [guard], max_steps=10, logger=logger, log_every_n_steps=EVERY)
    t.fit(FaultModel(), loader(FaultData()))
    assert guard.events == []
    assert not (tmp_path / "ng" / TRACE_FILENAME).exists()
    assert _accumulator(logger.log_dir).Tags()["images"] == []


class ImageLogger(Logger):
    """A logger with W&B's ``log_image(key, images, step)`` call and nothing else (W&B itself is not installed)."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, Any, int | None]] = []

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_image(self, key: str, images: list[Any], step: int | None = None, **kwargs: Any) -> None:
        self.images.append((key, images, step))


def test_a_halt_sends_the_picture_to_a_logger_with_log_image(tmp_path: Path) -> None:
    guard = _guard(tmp_path, action="halt", spike_action=None)
    images = ImageLogger()
    t = trainer(tmp_path, [guard], max_steps=STEPS, logger=[images, CSVLogger(tmp_path)], log_every_n_steps=EVERY)
    with pytest.warns(NumGuardWarning), contextlib.suppress(NonFiniteError):  # a halt stops the fit, or raises
        t.fit(SpikeModel(site="loss", step=NAN), loader(FaultData(n=8 * STEPS)))
    assert t.global_step < STEPS
    ((key, (array,), step),) = images.images
    assert key == plot.FIGURE_TAG and step in (NAN, NAN + 1)
    assert array.ndim == 3 and array.shape[2] == 3 and array.dtype.name == "uint8"
    assert (tmp_path / "ng" / TRACE_FILENAME).exists()


def test_the_trace_is_bounded_and_keeps_every_event_step(tmp_path: Path) -> None:
    trace = Trace(tmp_path / TRACE_FILENAME, sigma=6.0)
    events = {7, 12_345, 999_999}
    for step in range(1_000_000):
        if step in events:
            trace.mark([step])
        trace.add(step, [1.0, 2.0, 0.5, float("nan")])
    rows = trace.rows()
    assert len(rows) <= MAX_POINTS + len(events)
    assert events <= {r[0] for r in rows}
    assert rows[0][0] == 0 and rows[-1][0] == 999_999
    path = trace.write()
    assert path is not None and path.stat().st_size < 200_000
    back = read_trace(path).rows()
    assert [r[0] for r in back] == [r[0] for r in rows]
    assert all(r[1:4] == (1.0, 2.0, 0.5) and math.isnan(r[4]) for r in back)
    assert io.StringIO(path.read_text()).readline() == "# sigma=6.0\n"


def test_mlflow_gets_the_figure_through_its_own_log_figure_call() -> None:
    """Structural (mlflow is not installed): a logger of MLflow's shape gets the figure with ``log_figure(run_id,
    figure, artifact_file)``, the one call its client has for a matplotlib figure; a logger with no image call
    gets nothing and no error."""

    class Client:
        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
            self.calls.append((run_id, figure, artifact_file))

    class MLFlowLogger:  # the name Lightning's logger has in both packages
        run_id = "run-1"

        def __init__(self) -> None:
            self.experiment = Client()

    class NoImages:
        pass

    mlflow, other = MLFlowLogger(), NoImages()
    fig = plot.figure([{"kind": "nonfinite_loss", "step": 3, "action": "skip", "where": ["loss"]}])
    assert plot.send_figure([mlflow, other], fig, 7, lambda lg: False) == ["MLFlowLogger"]
    assert mlflow.experiment.calls == [("run-1", fig, "numguard/run.png")]


def test_a_step_above_the_threshold_is_a_point_without_spike_action(tmp_path: Path) -> None:
    """``spike_action=None`` records no spike event; the step whose z-score crossed the threshold is still a point
    of the curves (the issue's ×1000 step had none), and nothing is drawn (no event)."""
    guard = _guard(tmp_path, spike_action=None)
    logger = TensorBoardLogger(tmp_path, name="tb")
    t = trainer(tmp_path, [guard], max_steps=16, logger=logger, log_every_n_steps=EVERY)
    t.fit(SpikeModel(), loader(FaultData(n=8 * 16)))
    assert guard.events == []
    ea = _accumulator(logger.log_dir)
    grad = {e.step: e.value for e in ea.Scalars("numguard/grad_norm")}
    assert sorted(grad) == [4, 9, SPIKE, 14]
    assert {e.step: e.value for e in ea.Scalars("numguard/grad_norm_zscore")}[SPIKE] > 6
    assert ea.Tags()["images"] == []


def test_numguard_plot_of_a_path_with_no_events_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    assert f"no events.jsonl under {tmp_path}" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
