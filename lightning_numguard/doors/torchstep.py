"""A training step seen from torch alone: what the Fabric door and the plain-PyTorch door share.

Neither door drives its loop; each learns the moments of a step from torch's own hooks and hands them to the
engine's :class:`~lightning_numguard.engine.flow.StepFlow`, in the step's order:

====================================  =======================================================================
the top module's forward pre-hook     a training micro-batch starts (``module.training`` and gradients on;
(with kwargs)                         evaluation calls are left alone). Its inputs, bound to the forward's
                                      parameter names, are the batch (``batch['input_ids']``, as a Trainer
                                      batch dict). The fit starts at the first one (``at_fit_start``,
                                      ``at_train_start``: the first snapshot); then ``batch_start``
the top module's forward hook         the compiled embeddings' index checks join the step's op records
the loss, before its backward         ``before_backward`` (each door says where it sees the loss)
the decision point                    ``before_optimizer_step``, once per step, over every optimizer at once:
                                      the one read; a skipped step's gradients are dropped
an optimizer's step post-hook (or     the step is over: ``batch_end`` carries the decision out (rollback,
Fabric's ``on_after_optimizer_step``) quarantine, halt)
====================================  =======================================================================

The step count is the loop's optimizer steps, a skipped one included (the Trainer's ``global_step``); a
micro-batch's ``batch_idx`` counts the training forward passes since the fit started. The post-step check of the
parameters rides the next step's read, and the fit's end (:meth:`TorchStep.finish`) checks the last one.

torch and the standard library only (the doors add Lightning Fabric where they need it).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_numguard import _compat
from lightning_numguard.doors.embeddings import EmbeddingChecks
from lightning_numguard.dtensor import has_dtensor
from lightning_numguard.engine.flow import StepFlow
from lightning_numguard.engine.loop import Loop
from lightning_numguard.errors import NumGuardConfigError
from lightning_numguard.state.snapshot import Stateful
from lightning_numguard.state.stateful import module_states
from lightning_numguard.tree import tensor_leaves

__all__ = ["AllOptimizers", "ForwardInputs", "KeptLearningRates", "TorchLoop", "TorchStep", "forward_inputs"]


class ForwardInputs(dict):
    """A forward call's inputs by parameter name: the step's batch (a dict, named like a Trainer batch), and the
    call itself (``module`` called with ``call``'s positional and keyword arguments), for a quiet re-run."""

    module: nn.Module | None = None
    call: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})


def forward_inputs(
    module: nn.Module, signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ForwardInputs:
    """``module``'s call with ``args`` and ``kwargs``, bound to ``signature``'s parameter names (``**kwargs`` spread
    out, ``*args`` a tuple under its name); unbound (``args`` as ``"args"``, then the keywords) when they do not fit."""
    named: dict[str, Any] = {}
    bound = None
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            bound = None
    if bound is None:
        if args:
            named["args"] = args
        named.update(kwargs)
    else:
        for name, value in bound.arguments.items():
            if signature is not None and signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
    out = ForwardInputs(named)
    out.module, out.call = module, (args, dict(kwargs))
    return out


def signature_of(module: nn.Module) -> inspect.Signature | None:
    """The signature of ``module.forward`` (``None`` when it has none a binding can use)."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


class AllOptimizers:
    """Every optimizer of a loop as one, for the step's one read: their param groups, and dropping the gradients of
    all of them (so that every ``step()`` of a skipped step is a no-op)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class KeptLearningRates:
    """The loop's own learning rates kept through a restore (the loop sets them; a rollback restores the weights,
    the optimizer state and the RNG). :meth:`keep` notes them before a step's decision is carried out; a restore
    (``load_state_dict``, after the optimizers') puts them back; the back-off of a rollback applies after."""

    def __init__(self, loop: Loop) -> None:
        self._loop = weakref.ref(loop)
        self.rates: list[list[Any]] | None = None

    def keep(self) -> None:
        loop = self._loop()
        self.rates = [[g.get("lr") for g in o.param_groups] for o in loop.optimizers] if loop is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loop = self._loop()
        if loop is None or self.rates is None:
            return
        for opt, rates in zip(loop.optimizers, self.rates):
            for group, lr in zip(opt.param_groups, rates):
                if isinstance(group.get("lr"), torch.Tensor) and isinstance(lr, torch.Tensor):
                    group["lr"].copy_(lr)
                elif lr is not None:
                    group["lr"] = lr


class TorchLoop(Loop):
    """A loop known from torch's hooks: the module (hooks and names), the top modules the loop calls (the first one
    starts a micro-batch), the optimizers the door learned, and the step count the door keeps."""

    def __init__(self, module: nn.Module, tops: list[nn.Module]) -> None:
        super().__init__(module)
        self.tops = tops
        self.steps = 0
        self.optimizer_list: list[torch.optim.Optimizer] = []
        self.learning_rates = KeptLearningRates(self)
        self.quiet = False  # a re-run in progress: the hooks stand aside

    @property
    def step(self) -> int:
        return self.steps

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizer_list)

    def stateful(self) -> dict[str, Stateful]:
        """The loop's own learning rates (kept, not restored), the module's metrics and numpy's RNG."""
        return {"learning_rates": self.learning_rates, **module_states(self.module)}

    @contextlib.contextmanager
    def rerun(self, batch: Any, batch_idx: int) -> Iterator[Callable[[], Any]]:
        """The top module's forward pass again with the micro-batch's recorded arguments, quietly (the hooks stand
        aside). The loss is computed outside the module, so the closure returns a surrogate: the sum of the floating
        outputs that require grad, whose backward walks the same graph (a ``sqrt(0)``'s ``SqrtBackward0``)."""
        args, kwargs = batch.call if isinstance(batch, ForwardInputs) else ((), {})
        top = batch.module if isinstance(batch, ForwardInputs) and batch.module is not None else self.tops[0]

        def run_step() -> torch.Tensor | None:
            out = top(*args, **kwargs)
            graph = [t.float().sum() for _, t in tensor_leaves(out) if t.is_floating_point() and t.requires_grad]
            return torch.stack(graph).sum() if graph else None

        with self.quieted(), self.autocast():
            yield run_step

    @contextlib.contextmanager
    def quieted(self) -> Iterator[None]:
        was, self.quiet = self.quiet, True
        try:
            yield
        finally:
            self.quiet = was


#: optimizer -> the step of the guard watching it: one guard per optimizer
_WATCHED: weakref.WeakKeyDictionary[torch.optim.Optimizer, TorchStep] = weakref.WeakKeyDictionary()
#: top module -> the step of the guard guarding it: one guard per model
_GUARDED: weakref.WeakKeyDictionary[nn.Module, TorchStep] = weakref.WeakKeyDictionary()


class TorchStep:
    """The hooks of one fit of a loop known from torch alone, and the step's moments they hand to ``flow``.

    Args:
        flow: the fit's flow (``StepFlow.setup`` ran: the module's own hooks are on).
        loop: the loop in the engine's terms.
        door: how the door is named in errors (``"NumGuard"``, ``"attach()"``).
        end_at_step: whether an optimizer's step post-hook ends the step (the plain door); Fabric's
            ``on_after_optimizer_step`` does it for the Fabric door.
        missing_optimizer: the sentence of the error when the first training forward pass comes with no optimizer.
    """

    def __init__(self, flow: StepFlow, loop: TorchLoop, door: str, end_at_step: bool, missing_optimizer: str) -> None:
        self.flow = flow
        self.loop = loop
        self.door = door
        self.end_at_step = end_at_step
        self.missing_optimizer = missing_optimizer
        self.started = False
        self.finished = False
        self.decided = False  # the step in progress has been read and judged
        self.batch_idx = 0
        self.thread: int | None = None  # the thread of the step in progress (a backward elsewhere is not its)
        self.signatures = {id(top): signature_of(inner_module(top)) for top in loop.tops}
        self.embeddings = EmbeddingChecks(loop.module) if "ops" in flow.settings.check else None
        self._handles: list[Any] = []
        self._step_handles: list[Any] = []
        #: what the door undoes when the fit ends, however it ends (its own wrappers)
        self.on_detach: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ hooks

    def attach(self) -> None:
        """The top modules' forward hooks and the embeddings' index checks (before any compiled call).

        Raises:
            NumGuardConfigError: another open guard guards one of the modules already, or its parameters are
                sharded.
        """
        if has_dtensor(self.loop.module.parameters()):
            raise NumGuardConfigError(
                f"NumGuard: {self.door} got a model whose parameters are DTensor shards (FSDP2, tensor parallel): "
                "this door guards one device and DDP; sharded training is guarded through the Trainer door "
                "(ModelParallelStrategy), see docs/strategies.md."
            )
        for top in self.loop.tops:
            other = _GUARDED.get(top)
            if other is not None and other is not self and not other.finished:
                raise NumGuardConfigError(
                    f"NumGuard: this {type(top).__name__} is already guarded ({other.door}); one guard per model: "
                    "close() the other one first."
                )
        for top in self.loop.tops:
            _GUARDED[top] = self
            self._handles += [
                top.register_forward_pre_hook(_eager(self._forward_pre), with_kwargs=True),
                top.register_forward_hook(_eager(self._forward_post)),
            ]
        if self.embeddings is not None:
            self.embeddings.attach()

    def watch(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Guard ``optimizers`` too: a step pre-hook (the decision, when it has not been taken), and a post-hook when
        it ends the step.

        Raises:
            NumGuardConfigError: one is not an optimizer, another guard watches it, or it holds parameters of no
                guarded module (the guard could neither check, restore nor name them).
        """
        known = {id(p) for p in self.loop.module.parameters()}
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise NumGuardConfigError(
                    f"NumGuard: {self.door} got {type(opt).__name__!r} where an optimizer was expected "
                    "(a torch.optim.Optimizer)."
                )
            if opt in self.loop.optimizer_list:
                continue
            other = _WATCHED.get(opt)
            if other is not None and other is not self and not other.finished:
                raise NumGuardConfigError(
                    f"NumGuard: this {type(opt).__name__} is already guarded by another guard ({other.door}); one "
                    "guard per optimizer: close() the other one first, or attach the models together in one call."
                )
            foreign = [i for g in opt.param_groups for i, p in enumerate(g["params"]) if id(p) not in known]
            if foreign:
                raise NumGuardConfigError(
                    f"NumGuard: {self.door}: the {type(opt).__name__} holds {len(foreign)} parameter(s) of no guarded "
                    f"module (the guarded model has {len(known)}): guard every model whose parameters it steps (pass "
                    "them all, e.g. attach([net_g, net_d], optimizer)), or build it over the guarded model's weights."
                )
            _WATCHED[opt] = self
            self.loop.optimizer_list.append(opt)
            self._step_handles.append(opt.register_step_pre_hook(self._step_pre))
            if self.end_at_step:
                self._step_handles.append(opt.register_step_post_hook(self._step_post))

    def detach(self) -> None:
        """Remove every hook of the fit (idempotent): the door's, and the engine's on the module."""
        for handle in self._handles + self._step_handles:
            handle.remove()
        self._handles, self._step_handles = [], []
        if self.embeddings is not None:
            self.embeddings.detach()
        for opt in self.loop.optimizer_list:
            if _WATCHED.get(opt) is self:
                del _WATCHED[opt]
        for top in self.loop.tops:
            if _GUARDED.get(top) is self:
                del _GUARDED[top]
        for undo in self.on_detach:
            undo()
        self.on_detach = []
        self.flow.close()

    # ------------------------------------------------------------------ the moments

    def training_call(self, module: nn.Module) -> bool:
        """Whether a forward call of the top module is a training micro-batch of this fit."""
        return not self.loop.quiet and not self.finished and module.training and torch.is_grad_enabled()

    def _forward_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.embeddings is not None:
            self.embeddings.records()  # forget what an evaluation or quiet pass left
        if not self.training_call(module):
            return
        with self._ending_on_error():
            if not self.started:
                self._start()
            rec = self.flow.pipeline.recorder.record
            if rec is not None and (self.decided or rec.read_done):
                self.end_step(counted=False)  # its optimizer never stepped (a GradScaler skip, or the loop's choice)
                rec = None
            if rec is not None and module is not self.loop.tops[0]:
                return  # a further model's forward pass in the micro-batch in progress (a GAN's discriminator)
            batch = forward_inputs(module, self.signatures.get(id(module)), args, kwargs)
            self.thread = threading.get_ident()
            self.flow.batch_start(self.loop, batch, self.batch_idx)
            self.batch_idx += 1

    def _forward_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        found = self.embeddings.records() if self.embeddings is not None else []
        opguard = self.flow.pipeline.recorder.opguard
        recording = self.flow.pipeline.recorder.record is not None
        if found and opguard is not None and recording and self.training_call(module):
            opguard.records.extend(found)

    def before_backward(self, loss: torch.Tensor) -> None:
        """The loss of the micro-batch in progress, before its backward pass."""
        if self.finished or self.loop.quiet or self.flow.pipeline.recorder.record is None or self.decided:
            return
        self.flow.before_backward(loss)

    def decide(self) -> None:
        """The step's one read and its judgement, over every optimizer at once (once per step); a skipped step's
        gradients are dropped here, before the loop reads them (clipping, the optimizers)."""
        if self.finished or self.loop.quiet or self.decided or self.flow.pipeline.recorder.record is None:
            return
        optimizers = self.loop.optimizer_list
        if not optimizers:
            return
        self.decided = True
        view: Any = optimizers[0] if len(optimizers) == 1 else AllOptimizers(list(optimizers))
        with self._ending_on_error():
            self.flow.before_optimizer_step(self.loop, view)

    def end_step(self, counted: bool = True) -> None:
        """The step is over (``counted``: an optimizer stepped): carry its decision out."""
        if self.finished or self.loop.quiet or self.flow.pipeline.recorder.record is None:
            return
        if counted:
            self.loop.steps += 1
        self.decided = False
        with self._ending_on_error():
            if self.flow.settings.acting:
                self.loop.learning_rates.keep()
            self.flow.batch_end(self.loop)

    def _step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.started:
            self.decide()

    def _step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.started and self.decided:
            self.end_step()

    # ------------------------------------------------------------------ the fit

    def _start(self) -> None:
        """The fit starts at its first training forward pass: coverage, names, the first snapshot."""
        if not self.loop.optimizer_list:
            raise NumGuardConfigError(f"NumGuard: {self.missing_optimizer}")
        self.started = True
        self.flow.at_fit_start(self.loop)
        self.flow.at_train_start(self.loop)

    def finish(self, exception: BaseException | None = None, check_last: bool = True) -> None:
        """The fit's end (idempotent): the last step's update checked (when it ended well and ``check_last``: one
        read, collective), the summary, hooks off."""
        if self.finished:
            return
        if self.started and exception is None and check_last:
            with self._ending_on_error():
                if self.flow.pipeline.recorder.record is not None and self.decided:
                    self.end_step()
                if self.flow.settings.acting:
                    self.loop.learning_rates.keep()
                self.flow.at_train_end(self.loop)
        self._close(exception)

    def _close(self, exception: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        try:
            self.flow.at_end(self.loop, self.started, exception)
        finally:
            self.detach()

    @contextlib.contextmanager
    def _ending_on_error(self) -> Iterator[None]:
        """A halt (``NonFiniteError``) or any error out of the guard ends the fit before it propagates."""
        try:
            yield
        except BaseException as err:
            self._close(err)
            raise


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly when the top module is itself compiled after the guard attached (a graph break at the
    top module's edge, rather than the step's bookkeeping traced into the graph)."""
    disable = getattr(torch.compiler, "disable", None)
    return disable(hook) if callable(disable) else hook


def inner_module(module: nn.Module) -> nn.Module:
    """The user's module under the wrappers a loop may call instead: ``torch.compile``'s, DDP's (``.module``) and
    Fabric's (``.module``), outermost first."""
    seen = 0
    while seen < 8:
        seen += 1
        unwrapped = _compat.uncompiled(module)
        if unwrapped is not module:
            module = unwrapped
            continue
        inner = getattr(module, "module", None)
        if isinstance(inner, nn.Module) and type(module).__name__ in _WRAPPERS:
            module = inner
            continue
        break
    return module


#: wrappers whose ``.module`` is the user's module
_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "_FabricModule"})
