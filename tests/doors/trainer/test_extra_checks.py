"""A check of one's own, in one file (``tests/toy/loss_above.py``), passed as ``extra_checks``: packed into the step's
one read, read, judged, carried out, reported and documented like a built-in check, in both sync modes and from a
LightningCLI YAML file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from instruments.syncs import SyncCounter
from lightning_numguard import Check, CheckStep, NumGuardCallback, NumGuardConfigError
from lightning_numguard.detect import registry
from lightning_numguard.reporting.events import read_events
from lightning_numguard.reporting.hints import kind_hint
from tests.doors.trainer.test_zerosync import FusedModel
from tests.helpers import FaultData, SyncWindow, loader, trainer
from tests.toy.loss_above import LossAbove

THRESHOLD = 50.0
BAD_STEP = 3


class LossJump(FusedModel):
    """A clean model whose loss is multiplied by 1000 at step 3 (or only at batch ``at_batch``): finite, far above
    ``THRESHOLD``."""

    def __init__(self, at_batch: int | None = None) -> None:
        super().__init__()
        self.at_batch = at_batch

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        bad = batch_idx == self.at_batch if self.at_batch is not None else self.global_step == BAD_STEP
        return loss * 1000.0 if bad else loss


class Weights(pl.Callback):
    """The weights before and after step 3's batch."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == BAD_STEP:
            self.before = {k: v.clone() for k, v in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.after and self.before:
            self.after = {k: v.clone() for k, v in pl_module.named_parameters()}

    @property
    def trained(self) -> bool:
        return any(not torch.equal(self.before[k], self.after[k]) for k in self.before)


def fit(tmp_path: Path, check: Check, **kwargs: Any) -> tuple[NumGuardCallback, Weights]:
    torch.manual_seed(0)
    kwargs.setdefault("action", "skip")
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), extra_checks=[check], emit_warnings=False, **kwargs)
    weights = Weights()
    trainer(tmp_path, [weights, guard], max_steps=6).fit(LossJump(), loader(FaultData()))
    return guard, weights


def test_a_check_of_ones_own_is_packed_read_judged_reported_and_documented(tmp_path: Path) -> None:
    counter = SyncCounter(package="lightning_numguard")
    torch.manual_seed(0)
    guard = NumGuardCallback(
        action="skip", dirpath=str(tmp_path / "ng"), extra_checks=[LossAbove(THRESHOLD)], emit_warnings=False
    )
    weights = Weights()
    t = trainer(tmp_path, [SyncWindow(counter), weights, guard], max_steps=6)
    with counter:
        t.fit(LossJump(), loader(FaultData()))
    # packed: no host read of its own; the step's one read carries it (the hit's step reads more, after the hit)
    clean = [n for step, n in enumerate(counter.step_total) if step != BAD_STEP]
    assert clean and all(n == 1 for n in clean), counter.step_total
    # read and judged: one incident at the step whose loss jumped, skipped like any incident
    (event,) = guard.events
    assert (event["step"], event["kind"], event["where"], event["action"]) == (BAD_STEP, "loss_above", ["loss"], "skip")
    assert event["details"]["value"] > THRESHOLD and event["details"]["threshold"] == THRESHOLD
    assert event["details"]["check"] == "LossAbove"
    assert event["root_cause"] is True
    assert guard.counters["incidents"] == 1 and guard.counters["skipped_steps"] == 1
    assert weights.before and not weights.trained, "the skipped step changed the weights"
    # reported: its own sentence and its hint, in the events file too
    assert f"above the threshold {THRESHOLD:g} at step {BAD_STEP} on rank 0" in event["message"]
    assert event["message"].endswith(LossAbove.hint)
    written, bad_lines = read_events(guard.resolved_dirpath / "events.jsonl")
    assert [e["kind"] for e in written] == ["loss_above"] and not bad_lines
    # documented: its row in the table of kinds, right after the loss's; its arguments; its hint for explain
    rows = registry.kinds_table(registry.known()).splitlines()
    row = "| `loss_above` | the loss, finite but above `threshold` | look at this batch |"
    assert rows.index(row) == rows.index(next(r for r in rows if r.startswith("| `nonfinite_loss`"))) + 1
    assert "`threshold=50.0`" in registry.arguments_table(guard.extra_checks)
    assert kind_hint("loss_above") == LossAbove.hint


def test_the_same_check_declared_advisory_is_judged_and_reported_never_acted_on(tmp_path: Path) -> None:
    guard, weights = fit(tmp_path, LossAbove(THRESHOLD, advisory=True))
    (event,) = guard.events
    assert (event["step"], event["kind"], event["action"]) == (BAD_STEP, "loss_above", "none")
    assert guard.counters["incidents"] == 0 and guard.counters["skipped_steps"] == 0
    assert weights.trained, "an advisory check stopped the step"


def test_a_clean_run_with_the_check_has_no_event(tmp_path: Path) -> None:
    guard, weights = fit(tmp_path, LossAbove(1e9))
    assert guard.events == [] and weights.trained


def test_under_accumulation_the_micro_batches_values_are_combined_and_the_window_judged_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    guard = NumGuardCallback(
        action="skip", dirpath=str(tmp_path / "ng"), extra_checks=[LossAbove(THRESHOLD)], emit_warnings=False
    )
    # only the first micro-batch of step 3's window (batches 6 and 7) jumps: the second's clean value must not hide it
    trainer(tmp_path, [guard], max_steps=5, accumulate_grad_batches=2).fit(LossJump(at_batch=6), loader(FaultData()))
    assert [(e["step"], e["kind"], e["action"]) for e in guard.events] == [(BAD_STEP, "loss_above", "skip")]
    assert guard.counters["skipped_steps"] == 1


def test_read_late_the_step_is_skipped_on_the_device_and_the_check_named(tmp_path: Path) -> None:
    guard, weights = fit(tmp_path, LossAbove(THRESHOLD), sync_mode="deferred")
    (event,) = guard.events
    assert (event["step"], event["kind"], event["where"]) == (BAD_STEP, "loss_above", ["loss"])
    assert event["details"]["deferred"] is True and event["details"]["read_at_step"] == BAD_STEP + 1
    assert guard.counters["skipped_steps"] == 1
    assert not weights.trained, "the device did not skip the step"


def test_on_a_hugging_face_gpt2_one_batch_weighted_1000x_is_rolled_back(tmp_path: Path) -> None:
    """Model code nobody here wrote: a tiny random GPT-2 whose per-token loss weights come from the data; the weights of
    step 1's batch are 1000x (finite). The check names that step alone and the default action rolls it back."""
    from instruments.diagnosis.real.hf import BAD, BATCH, HFModule, gpt2, samples, tokens

    def weight(i: int) -> torch.Tensor:
        return torch.full((8,), 1000.0 if i // BATCH == BAD // BATCH else 1.0)

    torch.manual_seed(0)
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), extra_checks=[LossAbove(100.0)], emit_warnings=False)
    model = HFModule(gpt2(), loss="weighted")
    trainer(tmp_path, [guard], max_steps=4).fit(model, samples(input_ids=tokens, weight=weight))
    assert [(e["step"], e["kind"], e["action"]) for e in guard.events] == [(BAD // BATCH, "loss_above", "rollback")]
    assert guard.events[0]["details"]["value"] > 100.0
    assert guard.counters["rollbacks"] == 1 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_check_is_refused_with_the_argument_and_the_fix() -> None:
    with pytest.raises(NumGuardConfigError, match="`threshold` must be a positive number"):
        LossAbove(-1.0)
    with pytest.raises(NumGuardConfigError, match="`extra_checks` must be a list"):
        NumGuardCallback(extra_checks=LossAbove())  # type: ignore[arg-type]
    with pytest.raises(NumGuardConfigError, match="`extra_checks` takes instances"):
        NumGuardCallback(extra_checks=[object()])  # type: ignore[list-item]
    with pytest.raises(NumGuardConfigError, match="two checks of one kind"):
        NumGuardCallback(extra_checks=[LossAbove(), LossAbove(2.0)])

    class Clash(LossAbove):
        kind = "nonfinite_loss"

    with pytest.raises(NumGuardConfigError, match="is a built-in kind"):
        NumGuardCallback(extra_checks=[Clash()])

    class Nameless(LossAbove):
        hint = ""

    with pytest.raises(NumGuardConfigError, match=r"Nameless\.hint must be a non-empty string"):
        NumGuardCallback(extra_checks=[Nameless()])


def test_a_check_whose_record_returns_no_tensor_fails_the_fit_naming_it(tmp_path: Path) -> None:
    class Wrong(LossAbove):
        kind = "loss_above_wrong"

        def record(self, step: CheckStep) -> Any:
            return 1.0

    with pytest.raises(NumGuardConfigError, match=r"Wrong\.record must return a one-element tensor"):
        fit(tmp_path, Wrong())


def test_a_lightning_cli_yaml_file_configures_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.setattr(sys, "argv", ["numguard-cli-test"])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "trainer:\n  logger: false\n  callbacks:\n    - class_path: lightning_numguard.NumGuardCallback\n"
        "      init_args:\n        extra_checks:\n          - class_path: tests.toy.loss_above.LossAbove\n"
        "            init_args: {threshold: 3.0}\n"
    )
    cli = LightningCLI(
        BoringModel,
        BoringDataModule,
        args=["--config", str(cfg)],
        run=False,
        save_config_callback=None,
        seed_everything_default=False,
    )
    (guard,) = [c for c in cli.trainer.callbacks if isinstance(c, NumGuardCallback)]
    (check,) = guard.extra_checks
    assert isinstance(check, LossAbove) and check.threshold == 3.0


def test_a_check_of_ones_own_costs_its_own_ops_and_nothing_else() -> None:
    """Counted at the dispatcher (``benchmarks/op_count.py``): the toy check adds its one comparison per step (its bool
    rides the step's one stack as it is); the guard adds nothing else for it."""
    from instruments.op_count import FIRST, LAST, count_ops

    steps = LAST - FIRST
    plain = count_ops("mlp", {}, last=LAST)
    with_check = count_ops("mlp", {"extra_checks": [LossAbove(1e9)]}, last=LAST)
    assert with_check.total - plain.total == steps, (dict(plain.by_check), dict(with_check.by_check))
    assert with_check.by_check_op[("checks of one's own (extra_checks)", "gt")] == steps
