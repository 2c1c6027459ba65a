"""The argument groups: what to watch, how to snapshot, how spikes are scored, how a bad step is recovered.

Each group is a frozen dataclass, checked where it is built (``NumGuardConfigError`` naming the group's field,
the allowed values and the value received) and parsed by LightningCLI from YAML as a nested mapping::

    init_args:
      action: rollback
      spikes:
        sigma: 8.0
        window: 256

Each field's documentation is its ``metadata["doc"]`` (the reference table and ``--help`` read it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from lightning_numguard.config import validate
from lightning_numguard.config.argtypes import Headroom, NonNegativeInt, PositiveFloat, PositiveInt, plain_args

__all__ = ["GROUPS", "RecoveryConfig", "SnapshotConfig", "SpikeConfig", "WatchConfig", "documented", "field_docs"]


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


def field_docs(group: type) -> dict[str, str]:
    """Each field of ``group`` and its documentation."""
    return {f.name: str(f.metadata.get("doc", "")) for f in fields(group)}


def documented(group: type) -> type:
    """``group`` with an ``Args:`` section made from its fields' documentation (LightningCLI's ``--help`` reads it)."""
    lines = [f"        {name}: {doc}." for name, doc in field_docs(group).items()]
    group.__doc__ = plain_args(f"{(group.__doc__ or '').rstrip()}\n\n    Args:\n" + "\n".join(lines) + "\n    ")
    return group


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass normalising its own values in __post_init__


@documented
@dataclass(frozen=True)
class WatchConfig:
    """Which modules' outputs the ``outputs`` check watches (``NumGuardCallback(watch=...)``)."""

    modules: list[str] = field(
        default_factory=lambda: ["*"],
        metadata=_doc("glob patterns of module names whose outputs are watched"),
    )
    ignore: list[str] = field(
        default_factory=list,
        metadata=_doc("glob patterns of module names not watched"),
    )
    depth: PositiveInt | None = field(
        default=1,
        metadata=_doc(
            "the blocks watched: modules at most this many levels below the root module "
            "(``Sequential``/``ModuleList``/``ModuleDict`` do not count as a level), every element of a "
            "``ModuleList``/``ModuleDict`` (repeated blocks; of a list of more than 16, every ``ceil(n / 16)``-th and "
            "the last), and any module an explicit ``modules`` pattern names; ``None`` watches every module"
        ),
    )

    def __post_init__(self) -> None:
        _set(self, "modules", validate.patterns("watch.modules", self.modules))
        _set(self, "ignore", validate.patterns("watch.ignore", self.ignore))
        if self.depth is not None:
            validate.integer("watch.depth", self.depth, 1)
            _set(self, "depth", int(self.depth))  # plain, from a CLI's restricted int


@documented
@dataclass(frozen=True)
class SnapshotConfig:
    """Where verified-finite snapshots live and how they are copied (``NumGuardCallback(snapshot=...)``)."""

    device: Literal["host", "device"] = field(
        default="host",
        metadata=_doc('keep snapshots on the ``"host"`` (pinned when CUDA is used) or on the ``"device"``'),
    )
    sharding: Literal["auto", "off"] = field(
        default="auto",
        metadata=_doc(
            '``"auto"`` shards snapshots when every rank holds the same weights and optimizer state (data parallel): '
            "each rank keeps its ``1/world`` of the parameters and optimizer states (buffers, schedulers, the scaler, "
            "metrics and RNG states stay whole and per rank), gathered back (one all-gather) only to restore; "
            '``DTensor`` local shards (FSDP2, tensor parallel) are copied per rank, never re-sharded. ``"off"``: a '
            "full copy on every rank"
        ),
    )
    asynchronous: bool | None = field(
        default=None,
        metadata=_doc(
            "copy a due snapshot on a CUDA side stream (on the CPU a worker thread) overlapped with the step, kept "
            "only once the step's read verified it (a second snapshot buffer, twice the host memory); ``None``: on "
            'when the module is on CUDA and snapshots go to the host; ``sync_mode="deferred"`` keeps its own '
            "synchronous snapshots"
        ),
    )

    def __post_init__(self) -> None:
        validate.choice("snapshot.device", self.device, ("host", "device"))
        validate.choice("snapshot.sharding", self.sharding, ("auto", "off"))
        validate.flag_or_none("snapshot.asynchronous", self.asynchronous)


@documented
@dataclass(frozen=True)
class SpikeConfig:
    """How finite spikes of the loss and the global gradient norm are scored (``NumGuardCallback(spikes=...)``);
    what is done about one is ``spike_action``."""

    sigma: PositiveFloat = field(
        default=10.0,
        metadata=_doc(
            "a value spikes when its cube root is more than this many robust standard deviations (the 95th "
            "percentile's distance above the median over 1.645, at least 10 % of the centre for the loss and 25 % for "
            "the gradient norm: at 10, a spike is at least 8x the median loss or 43x the median gradient norm) above "
            "the median of the window's cube roots"
        ),
    )
    window: NonNegativeInt = field(
        default=128,
        metadata=_doc(
            "steps in the rolling window of the loss and the global gradient norm, kept on the device (0: no spike "
            "statistics, and the gradients are checked without computing their norm)"
        ),
    )
    warmup: PositiveInt | None = field(
        default=None,
        metadata=_doc(
            "valid values the window needs before it judges; ``None``: 16 (or half a shorter window); fit start says "
            "when detection arms, and warns when the run ends first"
        ),
    )
    rollback_after: NonNegativeInt = field(
        default=3,
        metadata=_doc(
            'under ``spike_action="skip"``, this many spikes within ``window`` steps make the last one a rollback '
            "(0: never)"
        ),
    )
    overflow_headroom: Headroom | None = field(
        default=8.0,
        metadata=_doc(
            "a watched block whose output peak comes within this factor of its dtype's largest finite value (float16 "
            "65504; bfloat16 and float32 3.4e38) is reported once as ``overflow_risk``; ``None`` turns it off (a "
            "collapsing fp16 loss scale is reported as ``overflow_risk`` too)"
        ),
    )

    def __post_init__(self) -> None:
        sigma, warmup, headroom = validate.spike_group(
            self.sigma, self.window, self.warmup, self.rollback_after, self.overflow_headroom
        )
        _set(self, "sigma", sigma)
        _set(self, "window", int(self.window))
        _set(self, "warmup", None if self.warmup is None else warmup)  # as given: ``judged_after`` resolves it
        _set(self, "rollback_after", int(self.rollback_after))
        _set(self, "overflow_headroom", headroom)

    @property
    def judged_after(self) -> int:
        """The values the window needs before it judges (``warmup``, or its default for this ``window``)."""
        return validate.spike_group(self.sigma, self.window, self.warmup, self.rollback_after, None)[1]


@documented
@dataclass(frozen=True)
class RecoveryConfig:
    """How a bad step is recovered, beyond the top-level ``action`` (``NumGuardCallback(recovery=...)``)."""

    halt_raises: bool = field(
        default=True,
        metadata=_doc(
            "a halt (asked for, or escalated) is a failure: once ``last_finite.ckpt`` is written, the events flushed "
            "and the loggers finalised, the loop raises ``NonFiniteError`` on every rank together, whose message says "
            "how to resume, so the process exits non-zero; ``False``: a graceful stop instead, except where the loop "
            "would go on (Lightning's ``min_steps``/``min_epochs``)"
        ),
    )
    retry_transient: bool = field(
        default=False,
        metadata=_doc(
            "after a rollback, run the same batch once more from the restored state (under the loop's autocast, "
            "stepping no optimizer and moving no counter) to judge the incident: finite again, it was transient "
            "(``retry: transient`` in the event; the batch is not trained on and not quarantined), otherwise it is "
            "quarantined at once"
        ),
    )
    quarantine: bool = field(
        default=True,
        metadata=_doc(
            "skip batch positions that failed twice (or failed a retry) in later epochs and after a resume, and save "
            "them under ``<dirpath>/bad_batches/``"
        ),
    )
    replay: bool = field(
        default=True,
        metadata=_doc(
            "after an incident under ``skip``/``rollback``/``halt``, replay the step under the provenance trace to "
            "name the op, module and line that made the first non-finite value"
        ),
    )

    max_bad_steps: NonNegativeInt = field(
        default=10,
        metadata=_doc(
            'under ``action="skip"`` and ``"warn"``, a budget as ``max_rollbacks`` is for ``"rollback"``: this many '
            "consecutive steps that went bad (an incident, or a quarantined batch skipped) halt the run "
            "(``NonFiniteError`` saying how many steps went bad in a row), as no step has trained since the first of "
            "them; a clean step starts the count again, a batch skipped in the window after a rollback neither "
            "counts nor breaks it (0: never)"
        ),
    )
    max_device_faults: NonNegativeInt = field(
        default=3,
        metadata=_doc(
            "device faults on one rank before the guard halts with ``SuspectedHardwareError`` (a ``NonFiniteError``) "
            "naming its rank, host and device, so that a scheduler can exclude the node; a device fault is a "
            "non-finite value that did not come back when the step was replayed with the same weights, inputs and "
            "RNG, or (under data parallelism) that came back on its own rank but not when a neighbour rank re-ran "
            "the same micro-batch. Counted per rank over the run (kept in checkpoints; 0: never halt for them)"
        ),
    )
    restore_callbacks: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "glob patterns of the class names of other callbacks whose state a rollback restores with the rest: "
            "their ``state_dict``/``load_state_dict`` and the ``nn.Module`` held in their public attributes (a "
            "callback keeping its own average or teacher). Lightning's ``WeightAveraging`` (``EMAWeightAveraging``) "
            "and ``StochasticWeightAveraging`` are always restored: their averaged model and counters are in every "
            "snapshot"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("halt_raises", "retry_transient", "quarantine", "replay"):
            validate.flag(f"recovery.{name}", getattr(self, name))
        for name in ("max_bad_steps", "max_device_faults"):
            validate.integer(f"recovery.{name}", getattr(self, name), 0)
            _set(self, name, int(getattr(self, name)))
        _set(self, "restore_callbacks", validate.patterns("recovery.restore_callbacks", self.restore_callbacks))


#: the groups, by the argument that holds each
GROUPS: dict[str, type] = {
    "watch": WatchConfig,
    "snapshot": SnapshotConfig,
    "spikes": SpikeConfig,
    "recovery": RecoveryConfig,
}
