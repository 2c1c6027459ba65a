"""Sharded and untested strategies are said at setup; torch.compile runs clean without graph breaks."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.strategies import ModelParallelStrategy, SingleDeviceStrategy

from lightning_numguard import NumGuardCallback
from lightning_numguard.errors import NumGuardError, NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader, trainer


class ShardedModel(FaultModel):
    def configure_model(self) -> None:
        pass  # ModelParallelStrategy requires the hook; a real model would apply fully_shard here


def test_a_sharded_strategy_is_refused_at_setup_with_what_is_guarded(tmp_path):
    """ModelParallelStrategy runs on this CPU with gloo; FSDPStrategy needs a GPU (see docs/strategies.md)."""
    t = trainer(tmp_path, [NumGuardCallback(dirpath=str(tmp_path / "ng"))], strategy=ModelParallelStrategy())
    with pytest.raises(NumGuardError, match=r"action='rollback' is not supported under ModelParallelStrategy"):
        t.fit(ShardedModel(), loader(FaultData()))


def test_a_sharded_strategy_under_warn_says_nothing_is_restored(tmp_path):
    guard = NumGuardCallback(action="warn", dirpath=str(tmp_path / "ng"))
    t = trainer(tmp_path, [guard], strategy=ModelParallelStrategy(), max_steps=1)
    with pytest.warns(NumGuardWarning, match=r"under ModelParallelStrategy: .*nothing is skipped, restored"):
        t.fit(ShardedModel(), loader(FaultData()))


class CustomStrategy(SingleDeviceStrategy):
    pass


def test_a_known_strategy_subclass_is_not_warned_about(tmp_path, recwarn):
    t = trainer(tmp_path, [NumGuardCallback(dirpath=str(tmp_path / "ng"))], strategy=CustomStrategy("cpu"), max_steps=2)
    t.fit(FaultModel(), loader(FaultData()))
    assert not [w for w in recwarn if issubclass(w.category, NumGuardWarning)]


class CompiledModel(FaultModel):
    def configure_model(self) -> None:
        self.head = torch.compile(
            self.head, backend="eager"
        )  # dynamo (graph breaks) without codegen; after the guard's setup attached its hooks


def test_a_clean_compiled_run_has_no_alarm_and_no_graph_break(tmp_path, recwarn):
    dynamo = pytest.importorskip("torch._dynamo")
    dynamo.reset()
    dynamo.utils.counters.clear()
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"))
    t = trainer(tmp_path, [guard], max_steps=3)
    t.fit(CompiledModel(), loader(FaultData()))
    assert dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it really compiled
    assert not dynamo.utils.counters["graph_break"], dict(dynamo.utils.counters["graph_break"])
    assert not guard.events and guard.counters["incidents"] == 0
    assert not [w for w in recwarn if issubclass(w.category, NumGuardWarning)]
