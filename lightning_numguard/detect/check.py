"""What a check is: :class:`Check`, the step it sees (:class:`CheckStep`) and where it records (:data:`HOOKS`).

Every check of the guard is a :class:`Check`. The fused ones (parameters, gradients, outputs, inputs, the loss, the
op guard, the spikes) are plain declarations in :data:`~lightning_numguard.detect.registry.CHECKS`: their recording
and reduction are the step's fused parts. Every other check, built in or a user's, is a subclass in one file, with
two ways to look at a fit:

* per step, on the device: it names the hook it records at (:attr:`Check.records_at`), returns a 0-d device value
  from :meth:`Check.record` (folded into the step's one packed read) and builds its findings after a hit
  (:meth:`Check.findings`);
* once per fit, on the host (no device value, no read): :meth:`Check.at_fit_start` and
  :meth:`Check.at_first_optimizer_step` return findings that become events at once (the built-in optimizer
  coverage, :class:`~lightning_numguard.detect.coverage_check.OptimizerCoverage`, is such a check).

torch is imported for type annotations only (``numguard explain`` reads the declarations without it).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

    from lightning_numguard.diagnose.findings import Finding

__all__ = ["HOOKS", "HOST_HOOKS", "Check", "CheckStep", "Hook"]

#: Where a check records, in the step's order: batch start, the loss before backward, before the optimizer step.
Hook = Literal["batch_start", "loss", "optimizer_step"]
HOOKS: tuple[str, ...] = ("batch_start", "loss", "optimizer_step")
#: The host-side moments a check may look at, once per fit (no device value, no read): the methods of those names.
HOST_HOOKS: tuple[str, ...] = ("at_fit_start", "at_first_optimizer_step")


@dataclass(frozen=True)
class CheckStep:
    """What a check sees of the step it records or explains (``loss``, detached, from the ``"loss"`` hook on;
    ``optimizer`` at the ``"optimizer_step"`` hook; ``None`` before).

    ``loop`` is the guarded loop in torch terms (:class:`~lightning_numguard.engine.loop.Loop`): ``module`` is
    its root module (the ``LightningModule`` under a ``Trainer``), ``trainer`` the ``Trainer`` when there is one.
    """

    loop: Any
    batch: Any
    batch_idx: int
    step: int
    loss: torch.Tensor | None = None
    optimizer: Any = None

    @property
    def module(self) -> torch.nn.Module:
        """The root module of the step (the ``LightningModule``, the model handed to Fabric or ``attach``)."""
        return self.loop.module

    @property
    def trainer(self) -> Any:
        """The Lightning ``Trainer`` running the step, or ``None`` (a Fabric or plain loop)."""
        return getattr(self.loop, "trainer", None)

    @property
    def pl_module(self) -> torch.nn.Module:
        """The root module (the ``LightningModule`` under a ``Trainer``): the same as :attr:`module`."""
        return self.module


class Check:
    """One check of a training step, and the event kind its findings carry.

    The fused built-in checks (:data:`~lightning_numguard.detect.registry.CHECKS`) are plain declarations: their
    recording and reduction are the step's fused parts (one ``_foreach_norm`` covers parameters, buffers, optimizer
    state and gradients at once, one input value serves both input checks), so :attr:`records_at` is ``None``. Any
    other check, built in or not, subclasses this class and sets the class attributes below; it records per step
    (:attr:`records_at`, :meth:`record`, :meth:`findings`), looks at the fit on the host (:meth:`at_fit_start`,
    :meth:`at_first_optimizer_step`), or both. Its arguments are its constructor's, validated there (raise
    ``NumGuardConfigError`` naming the argument).

    Example:
        >>> import torch
        >>> from lightning_numguard.diagnose.findings import Finding
        >>> class LossAbove(Check):
        ...     name, kind, records_at, after = "loss above a threshold", "loss_above", "loss", "nonfinite_loss"
        ...     what, short_hint = "the loss above `threshold`", "look at this batch"
        ...     hint = "the loss left its expected range: look at this batch"
        ...     def __init__(self, threshold: float = 10.0) -> None:
        ...         self.threshold = threshold
        ...     def record(self, step):
        ...         return step.loss.detach().float() > self.threshold
        ...     def findings(self, step):
        ...         return [Finding(self.kind, ["loss"], {"value": float(step.loss), "threshold": self.threshold})]
        >>> LossAbove(2.0).arguments()
        {'threshold': 2.0}
    """

    #: what is checked, in words
    name: str = ""
    #: the event kind of its findings
    kind: str = ""
    #: what went bad when it fires (one cell of the README's table)
    what: str = ""
    #: the hint, in short (one cell of the README's table)
    short_hint: str = ""
    #: the one sentence of advice every event of this kind carries (``reporting/hints``)
    hint: str = ""
    #: advisory: it warns ahead of trouble, is never counted as an incident nor acted on
    advisory: bool = False
    #: where it records (:data:`HOOKS`); ``None``: no per-step value (a fused declaration, recorded by the step's
    #: fused parts, or a check that only looks at the fit on the host)
    records_at: ClassVar[Hook | None] = None
    #: its value is "seen" when ``"positive"`` (a 0/1 flag, a count) or ``"nonfinite"`` (a total NaN/Inf propagates)
    seen_when: ClassVar[Literal["positive", "nonfinite"]] = "positive"
    #: its findings come after this kind's in a step's causal order (``None``: after every built-in kind)
    after: ClassVar[str | None] = None
    #: what a finding names when the step is read one step late (``sync_mode="deferred"``) and its records are gone
    placeholder: str = ""
    #: its host-side findings end the fit: ``NumGuardError`` (their sentences) is raised once they are recorded
    fatal: bool = False
    #: the guard's own check (set by the classes of ``registry.DEFAULTS``; read :attr:`builtin`)
    _builtin: ClassVar[bool] = False

    def __init__(
        self,
        name: str | None = None,
        kind: str | None = None,
        what: str | None = None,
        short_hint: str | None = None,
        hint: str | None = None,
        advisory: bool | None = None,
        placeholder: str | None = None,
    ) -> None:
        declared: dict[str, str | bool | None] = {"name": name, "kind": kind, "what": what, "hint": hint}
        declared |= {"short_hint": short_hint, "advisory": advisory, "placeholder": placeholder}
        for key, value in declared.items():
            if value is not None:
                setattr(self, key, value)

    def __repr__(self) -> str:
        if type(self) is Check:
            return f"Check({self.kind!r})"
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments().items())
        return f"{type(self).__name__}({args})"

    # ------------------------------------------------------------------ per step, on the device (no fused check)

    def record(self, step: CheckStep) -> torch.Tensor | None:
        """The check's 0-d device value for this step, folded into the step's one read; no host read here.

        Called at :attr:`records_at` (once per micro-batch under gradient accumulation: the values are combined,
        ``max`` for ``"positive"``, a sum for ``"nonfinite"``). ``None``: nothing to record this time.
        """
        raise NotImplementedError(f"{type(self).__name__}.record: a check that is not built in records a value")

    def findings(self, step: CheckStep) -> list[Finding]:
        """After its value was seen: what went bad, exactly (host reads allowed, after a hit only).

        Default: one finding naming :attr:`placeholder` (or :attr:`name`).
        """
        from lightning_numguard.diagnose.findings import Finding

        return [Finding(self.kind, [self.placeholder or self.name], {})]

    def message(self, where: str, details: Mapping[str, Any], at: str) -> str:
        """The event's sentence, without its hint (``where``: the names, quoted; ``at``: "at step N on rank R")."""
        return f"{self.name}: {where} {at}"

    def arguments(self) -> dict[str, Any]:
        """The check's arguments (its constructor's parameters) and their values, for its ``repr`` and the docs."""
        if type(self) is Check:
            return {}
        params = inspect.signature(type(self).__init__).parameters
        return {
            n: getattr(self, n, p.default)
            for n, p in params.items()
            if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }

    # ------------------------------------------------------------------ once per fit, on the host

    def at_fit_start(self, step: CheckStep) -> Sequence[Finding]:
        """Once per fit, before its first step: what the host alone can tell (``step.module``,
        ``step.loop.optimizers``, their attributes; ``step.batch`` is ``None``); no device value and no read. Each
        finding becomes an event at once. Default: none."""
        return ()

    def at_first_optimizer_step(self, step: CheckStep) -> Sequence[Finding]:
        """Once per fit, just before its first optimizer step runs (``step.optimizer``; the gradients are in place):
        host-side findings, as :meth:`at_fit_start`. Default: none."""
        return ()

    @property
    def looks_at_fit(self) -> bool:
        """Whether the check overrides a host-side hook (:data:`HOST_HOOKS`)."""
        return any(getattr(type(self), name) is not getattr(Check, name) for name in HOST_HOOKS)

    @classmethod
    def for_fit(cls, config: Any) -> Check | None:
        """A built-in check enabled by default (:data:`~lightning_numguard.detect.registry.DEFAULTS`): its instance
        for a fit of ``config`` (the guard's :class:`~lightning_numguard.config.GuardConfig`), ``None`` when the
        config turns it off. Default: the check with its constructor's defaults."""
        return cls()

    @property
    def builtin(self) -> bool:
        """Whether the check is the guard's own: a fused declaration, or a class of
        :data:`~lightning_numguard.detect.registry.DEFAULTS`."""
        return type(self) is Check or self._builtin

    @property
    def fused(self) -> bool:
        """Whether the step's fused parts record it: a plain declaration (``records_at`` is ``None``)."""
        return type(self) is Check
