"""Sharded and untested strategies are said at setup; torch.compile runs clean without graph breaks."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_numguard import NumGuardCallback
from lightning_numguard.doors.trainer.strategies import check_strategy
from lightning_numguard.errors import NumGuardError, NumGuardWarning
from tests.helpers import FaultData, FaultModel, loader, trainer


class ShardedModel(FaultModel):
    def configure_model(self) -> None:
        pass  # ModelParallelStrategy requires the hook (sharded layouts run in test_sharded_lib.py)


def test_model_parallel_strategy_is_guarded_with_every_action(tmp_path, recwarn):
    """ModelParallelStrategy is no longer refused: the guard acts on each rank's local shards."""
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), emit_warnings=False)  # the events are read instead
    t = trainer(tmp_path, [guard], strategy=ModelParallelStrategy(), max_steps=4)
    t.fit(ShardedModel(site="param", step=2), loader(FaultData()))
    assert guard.counters["rollbacks"] == 1 and t.global_step == 4
    assert guard.events[0]["kind"] == "nonfinite_param" and guard.events[0]["where"] == ["body.0.weight"]
    assert not [w for w in recwarn if "ModelParallelStrategy" in str(w.message)]  # neither refused nor warned about


def test_fsdp1_is_refused_naming_what_is_untested():
    """Lightning 2.6 builds FSDPStrategy only for a GPU, so the check is called on the strategy object itself."""
    from pytorch_lightning.strategies import FSDPStrategy

    with pytest.raises(
        NumGuardError,
        match=r"under FSDPStrategy: Lightning 2.6 runs FSDPStrategy only on a GPU.*"
        r"untested.*Use ModelParallelStrategy with torch.distributed.fsdp.fully_shard",
    ):
        check_strategy(FSDPStrategy(), "rollback")
    with pytest.warns(NumGuardWarning, match=r"under FSDPStrategy: .*nothing is skipped, restored"):
        check_strategy(FSDPStrategy(), "warn")


def test_deepspeed_is_refused_naming_what_to_use_instead():
    """Matched by class name (DeepSpeed itself is not installed): a DDPStrategy subclass named like Lightning's."""
    deepspeed_like = type("DeepSpeedStrategy", (DDPStrategy,), {})
    with pytest.raises(NumGuardError, match=r"not supported under DeepSpeedStrategy: .*Use ModelParallelStrategy"):
        check_strategy(deepspeed_like(), "skip")


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
