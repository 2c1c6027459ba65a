"""Every access to a private name of Lightning, torch or torchmetrics, and every frame walk, in one place.

Each function says why no public API serves and what happens when the name is missing. None of
them changes behaviour silently: a missing name either has an exact public equivalent, is only
used to *describe* something, or raises :class:`~lightning_numguard.errors.NumGuardError` naming
the version to pin. This module imports only torch and the standard library (Lightning objects
are reached through the trainer passed in), so ``core/`` may use it too.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import torch

# the dispatcher-level mode the replay's provenance trace subclasses: documented (``torch.utils._python_dispatch``,
# "extending PyTorch: TorchDispatchMode") but in a private module since torch 1.13
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_numguard.errors import NumGuardError

# fmt: off
__all__ = [
    "TorchDispatchMode", "averaged_model", "averaging_counters", "callbacks_of_fabric_being_built",
    "callbacks_of_trainer_being_built", "caller_frame", "calling_owner", "clear_found_inf", "compiled",
    "dtensor_local", "fabric_setup_optimizers", "first_frame", "foreach_copy_", "foreach_max_abs",
    "foreach_nonfinite_", "foreach_norm_f32", "graph_task_id", "lightning_will_stop",
    "logger_metric_dicts", "logging_step", "logs_due", "metric_counters", "metric_state", "nn_bindings",
    "require_accumulation_api", "result_metric_state", "scaler_tensors", "set_averaging_counters", "set_found_inf",
    "set_grad_enabled", "set_metric_counters", "set_result_metric_state", "should_accumulate", "step_honours_found_inf",
    "sync_scheduler_last_lr", "to_target_device", "tracing_a_subgraph", "train_results", "uncompiled",
]
# fmt: on

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------- Lightning


def should_accumulate(trainer: Any) -> bool:
    """Whether the current batch is a gradient-accumulation micro-batch (its optimizer step comes later).

    Lightning has no public accessor for this; ``fit_loop.epoch_loop._should_accumulate()`` is what
    its own loop consults. With ``accumulate_grad_batches == 1`` (public) no private name is read.
    When the private name is missing, :func:`require_accumulation_api` has already refused the run
    at setup, so this never guesses.
    """
    if int(getattr(trainer, "accumulate_grad_batches", 1)) == 1:
        return False
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def require_accumulation_api(trainer: Any) -> None:
    """Raise at setup if accumulation is on and Lightning no longer exposes ``_should_accumulate`` (without it
    the guard cannot tell a micro-batch from an optimizer step: it would read once per micro-batch)."""
    if int(getattr(trainer, "accumulate_grad_batches", 1)) == 1:
        return
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if not callable(getattr(loop, "_should_accumulate", None)):
        raise NumGuardError(
            "NumGuard: this Lightning version has no `fit_loop.epoch_loop._should_accumulate()`, which the "
            "guard needs to find optimizer steps under `accumulate_grad_batches > 1`; use "
            "accumulate_grad_batches=1 or a Lightning version in 2.5-2.6."
        )


def lightning_will_stop(trainer: Any) -> bool:
    """Whether Lightning honours ``trainer.should_stop`` now (``min_steps``/``min_epochs`` are met): the property
    Lightning consults, ``fit_loop._can_stop_early``; missing, the same rule from the public attributes."""
    loop = getattr(trainer, "fit_loop", None)
    if loop is not None and hasattr(type(loop), "_can_stop_early"):
        return bool(loop._can_stop_early)
    min_steps, min_epochs = trainer.min_steps, trainer.min_epochs
    return (not min_steps or trainer.global_step >= min_steps) and (
        not min_epochs or trainer.current_epoch >= min_epochs
    )


def logs_due(trainer: Any) -> bool:
    """Whether Lightning writes its step metrics at this batch's end (``LearningRateMonitor``'s private test)."""
    return bool(trainer._logger_connector.should_update_logs)


def logging_step(trainer: Any) -> int:
    """The step number Lightning writes its own metrics at now (``fit_loop.epoch_loop._batches_that_stepped``,
    which ``LearningRateMonitor`` and Lightning's logger connector use; it counts batches, not optimizer steps).
    Missing: ``global_step`` (the same number with one optimizer)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step) if isinstance(step, int) else int(trainer.global_step)


def callbacks_of_trainer_being_built() -> list[Any] | None:
    """The callbacks a ``Trainer`` under construction already holds, seen from a callback factory.

    Lightning calls the ``*.callbacks_factory`` entry points with no arguments, from ``_CallbackConnector.
    on_trainer_init`` (both packages), after it set ``trainer.callbacks`` to the user's list and before it adds
    what the factories return; no public API shows that list to a factory. The connector is found as ``self`` in
    a calling frame (its class name, its ``trainer``). Missing: ``None``, and the zero-code attach adds its
    callback without looking, as Lightning's own factories do.
    """

    def is_connector(frame: FrameType) -> bool:
        owner: Any = frame.f_locals.get("self")
        return type(owner).__name__ == "_CallbackConnector" and hasattr(owner, "trainer")

    found = first_frame(caller_frame(0), is_connector)
    return list(getattr(found.f_locals["self"].trainer, "callbacks", None) or []) if found is not None else None


def callbacks_of_fabric_being_built() -> list[Any] | None:
    """The callbacks a ``Fabric`` under construction already holds, seen from a callback factory.

    Fabric calls the ``*.callbacks_factory`` entry points with no arguments from its static
    ``Fabric._configure_callbacks(callbacks)``, after it made ``callbacks`` the user's list and before it extends
    it with what the factories return; no public API shows that list to a factory. It is found as the local
    ``callbacks`` of that calling frame. Missing: ``None``, and the zero-code attach adds its guard without
    looking, as for a ``Trainer``.
    """

    def is_configure(frame: FrameType) -> bool:
        return frame.f_code.co_name == "_configure_callbacks" and isinstance(frame.f_locals.get("callbacks"), list)

    found = first_frame(caller_frame(0), is_configure)
    return list(found.f_locals["callbacks"]) if found is not None else None


def fabric_setup_optimizers(fabric: Any, module: Any) -> list[Any] | None:
    """The optimizers ``fabric.setup(module, *optimizers)`` set up, seen from the ``on_after_setup`` it calls.

    Fabric calls ``on_after_setup(fabric=, module=)`` from inside ``Fabric.setup`` once it wrapped the optimizers,
    and hands the callbacks the module only; no public attribute of the Fabric holds them. They are the local
    ``optimizers`` (a list of ``_FabricOptimizer``) of that calling ``setup`` frame of ``fabric``; for a
    ``LightningModule`` Fabric also keeps them as ``module._fabric_optimizers``. Missing both: ``None``, and the
    guard learns the optimizers at ``fabric.setup_optimizers``, or says at the first training step that it has none.
    """

    def is_setup(frame: FrameType) -> bool:
        return frame.f_code.co_name == "setup" and frame.f_locals.get("self") is fabric

    found = first_frame(caller_frame(0), is_setup)
    optimizers = found.f_locals.get("optimizers") if found is not None else None
    if not isinstance(optimizers, (list, tuple)):
        optimizers = getattr(module, "_fabric_optimizers", None)
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else None


def train_results(trainer: Any) -> dict[str, Any] | None:
    """The training loop's result collection (``fit_loop.epoch_loop._results``): what ``self.log`` accumulated.

    Lightning has no public way to withdraw a value a step logged; a step the guard discards must not leave
    its NaN in an epoch mean (``EarlyStopping.check_finite`` would stop the run, ``ModelCheckpoint`` would
    record ``inf``). Missing: ``None``, and the caller warns once that logged values are not withdrawn.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    results = getattr(loop, "_results", None)
    return results if isinstance(results, dict) else None


_METRIC_DICTS = ("_callback_metrics", "_progress_bar_metrics", "_logged_metrics")


def logger_metric_dicts(trainer: Any) -> list[dict[str, Any]] | None:
    """The logger connector's ``callback_metrics``, ``progress_bar_metrics`` and ``logged_metrics`` dicts.

    The public properties return these dicts after merging the current results into them; the guard must
    put back their contents as they were before a discarded step, so it needs the dicts themselves
    (``trainer._logger_connector._callback_metrics`` and its two siblings). Missing: ``None`` (not withdrawn).
    """
    connector = getattr(trainer, "_logger_connector", None)
    dicts = [getattr(connector, n, None) for n in _METRIC_DICTS]
    return dicts if all(map(isinstance, dicts, itertools.repeat(dict))) else None  # type: ignore[return-value]


_RESULT_FIELDS = ("value", "cumulated_batch_size", "_forward_cache", "has_reset")


def result_metric_state(metric: Any) -> dict[str, Any]:
    """References to a Lightning ``_ResultMetric``'s accumulators (no copy, no sync).

    ``_ResultMetric.update`` rebinds ``value`` and ``cumulated_batch_size`` to new tensors (``self.value =
    self.value + v * n``) and never writes them in place, so holding the references at a step's start is a
    verified copy of the epoch accumulators at no cost. ``_forward_cache`` is the step's ``on_step`` value.
    """
    return {name: getattr(metric, name) for name in _RESULT_FIELDS if hasattr(metric, name)}


def set_result_metric_state(metric: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`result_metric_state` read, drop the step's value and the cached ``compute()``."""
    for name, value in state.items():
        object.__setattr__(metric, name, value)
    object.__setattr__(metric, "_forward_cache", None)
    object.__setattr__(metric, "_computed", None)


def scaler_tensors(scaler: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A ``GradScaler``'s ``_scale`` and ``_growth_tracker`` tensors (``None`` before its first ``scale()``).

    ``GradScaler.state_dict()`` reads both with ``.item()`` (two host syncs per snapshot); copying the
    tensors on the device costs none. Missing names: ``(None, None)``, and the caller falls back to
    ``state_dict()``.
    """
    return getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)


# --------------------------------------------------------------------------------------- torch


def foreach_norm_f32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor float32 L2 norms in one fused call.

    ``torch._foreach_norm`` is the fused kernel the GradScaler and gradient clipping use; there is
    no public fused form. Older builds lack its ``dtype`` argument: the norms are then cast
    (same values for float32 inputs, a float16 overflow is still non-finite, as it should be).
    """
    try:
        return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))
    except (TypeError, RuntimeError):
        return [n.float() for n in torch._foreach_norm(list(tensors), 2)]


_flatten: Callable[[list[torch.Tensor]], torch.Tensor] | None = getattr(torch._utils, "_flatten_dense_tensors", None)


def flat_norm_f32(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d float32: the L2 norm of small tensors of one CPU device and dtype laid end to end (their global norm).

    On the CPU ``_foreach_norm`` is a loop of norm kernels, each paying a whole dispatch, where a few hundred small
    tensors cost one ``cat`` and one norm. ``torch._utils._flatten_dense_tensors`` is the C++ ``cat`` of their
    flattened views that DDP's bucketing uses (no Python loop over the tensors); a build without it takes the same
    views in Python.
    """
    flat = _flatten(list(tensors)) if _flatten is not None else torch.cat([t.reshape(-1) for t in tensors])
    if flat.dtype in (torch.float16, torch.bfloat16):  # accumulated in float32
        return torch.linalg.vector_norm(flat, dtype=torch.float32)
    norm = torch.linalg.vector_norm(flat)  # float64 (and complex) in their own precision, then as float32
    return norm if norm.dtype == torch.float32 else norm.float()


def foreach_max_abs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor max-|x| (the inf-norm: NaN propagates, on the CPU and on CUDA) of tensors of one device and dtype,
    in one call; float16 and bfloat16 come back in float32, other dtypes in their own real dtype.

    ``torch._foreach_norm(ord=inf)``: on an accelerator one multi-tensor kernel, on the CPU a loop of norm
    kernels (about ten times ``aminmax``'s time there, ``docs/performance.md``). There is no public fused form;
    a build whose ``_foreach_norm`` lacks the ``dtype`` argument casts the results (the same values: a max is
    exact in any floating dtype).
    """
    low = tensors[0].dtype in (torch.float16, torch.bfloat16) if tensors else False
    if not low:
        return list(torch._foreach_norm(list(tensors), math.inf))
    try:
        return list(torch._foreach_norm(list(tensors), math.inf, dtype=torch.float32))
    except (TypeError, RuntimeError):
        return [n.float() for n in torch._foreach_norm(list(tensors), math.inf)]


_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def _no_graph_task() -> int:
    return -1


#: The id of the autograd graph task running on this thread now, ``-1`` outside a backward pass: a forward hook that
#: runs where it is not ``-1`` runs in activation checkpointing's recompute (the forward's values again).
#: ``torch._C._current_graph_task_id`` itself, called with no wrapper (it runs at every watched call); there is no
#: public form. Missing: always ``-1`` (recomputed outputs are then recorded too: the same values again).
graph_task_id: Callable[[], int] = _graph_task if _graph_task is not None else _no_graph_task


#: Switch autograd's recording on or off on this thread: ``torch._C._set_grad_enabled``, the switch
#: ``torch.no_grad`` flips, without the context object it builds (the output watch turns it off around one reduction
#: a step). There is no public function form.
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled


def tracing_a_subgraph() -> bool:
    """Whether dynamo is tracing the body of a higher-order op now (``torch.utils.checkpoint`` under
    ``torch.compile``, ``torch.cond``...), where writing to an object from outside makes dynamo give up compiling
    the whole frame ("HOP: Unsafe side effect") and run it eagerly.

    Meant to run at trace time (under ``torch.compiler.assume_constant_result``). Dynamo's current tracer is
    internal (``InstructionTranslator.current_tx().output.current_tracer``, whose ``parent`` is set inside a
    higher-order op's body); missing or changed: ``False``, and such a frame runs eagerly as it did before.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return tx is not None and tx.output.current_tracer.parent is not None
    except Exception:  # the internal names moved
        return False


def foreach_nonfinite_(tensors: Sequence[torch.Tensor], found: torch.Tensor) -> bool:
    """Set ``found`` (a float32 0-d tensor on the tensors' device) to 1 when any of ``tensors`` holds NaN/Inf.

    ``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of exactly 1: the fused check the
    GradScaler runs on the gradients of every AMP step. It writes each element back multiplied by 1.0 (the
    same bits: finite values, signed zeros and subnormals are unchanged, and no version counter moves), so
    it suits tensors that no other thread reads or writes meanwhile: gradients, and parameters, buffers and
    optimizer state while no snapshot copies them. There is no public fused form. Returns ``False`` when the
    op is missing or refuses the tensors (the caller then uses another reduction).
    """
    op = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if op is None:  # pragma: no cover - every supported torch has it
        return False
    try:
        op(list(tensors), found, torch.ones((), dtype=torch.float32, device=found.device))
    except (TypeError, RuntimeError):  # pragma: no cover - a dtype or device this build's kernel lacks
        return False
    return True


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy ``src`` into ``dst`` in one fused call (``torch._foreach_copy_``), or one copy per tensor."""
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(list(dst), list(src))
        return
    for d, s in zip(dst, src):  # pragma: no cover - every supported torch has the fused form
        d.copy_(s)


def dtensor_local(t: Any) -> torch.Tensor:
    """The local shard of a ``DTensor``: the tensor this rank holds, sharing its storage.

    The public ``DTensor.to_local()`` is an autograd function under grad mode (a graph node per call, per
    tensor, per step on the hot path) and returns a fresh view for a parameter; ``_local_tensor`` is the
    shard itself, read for free. Missing: ``to_local()`` under ``no_grad`` (the same storage).
    """
    shard = getattr(t, "_local_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard
    with torch.no_grad():  # pragma: no cover - every supported torch has the attribute
        return t.to_local()


def nn_bindings() -> Any:
    """``torch._C._nn``, where the raw loss bindings that ``nn.*Loss`` reach live.

    The op guard matches these function objects to see calls that bypass ``torch.nn.functional``.
    If the namespace is gone, ``None`` is returned: those raw forms are then not guarded
    (``F.*`` and ``torch.*`` forms still are) and the op table's debug line says so.
    """
    return getattr(getattr(torch, "_C", None), "_nn", None)


def sync_scheduler_last_lr(scheduler: Any) -> None:
    """Make a scheduler's ``get_last_lr()`` agree with its optimizer after the rates were changed.

    ``get_last_lr()`` returns the private ``_last_lr``, which only ``step()`` updates; there is no
    public setter. Missing: nothing to update (``get_last_lr`` then computes it itself).
    """
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def to_target_device(*args: Any, **kwargs: Any) -> torch.device | None:
    """The device a ``Tensor.to(*args, **kwargs)`` call moves to; ``None`` when it keeps the tensor's.

    ``torch._C._nn._parse_to`` is the parser ``Tensor.to`` itself runs (every overload: a device, a
    dtype, another tensor, keywords); no public function parses those arguments. Missing: the device
    is read from a ``device=`` keyword, a first positional device (``str``, ``int``, ``torch.device``)
    or tensor, the same answer for every call ``Tensor.to`` accepts. Raises what the parser raises
    for arguments ``Tensor.to`` would refuse.
    """
    parse = getattr(getattr(getattr(torch, "_C", None), "_nn", None), "_parse_to", None)
    if parse is not None:
        device = parse(*args, **kwargs)[0]
        return None if device is None else torch.device(device)
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        return target.device
    if isinstance(target, (str, int, torch.device)):
        return torch.device(target)
    return None  # a dtype or nothing: the device stays


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``), else ``module`` itself.

    The wrapper's submodules are the original's under an ``_orig_mod.`` prefix, and no public attribute names the
    original: the guard names modules (and hooks them, before the first compiled call, so that the hooks are
    traced in) on the original. Missing: ``module``, whose names then carry the prefix.
    """
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


# The device-side skip: torch's fused optimizers (``_fused_adam``, ``_fused_adamw``, ``_fused_sgd``...) read
# ``found_inf`` and ``grad_scale`` off the optimizer object in ``step()``, set there by ``GradScaler.step``; the
# names are public attributes but the protocol between the two is private and undocumented.


def step_honours_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` skips its update on the device when ``found_inf`` is set.

    ``_step_supports_amp_scaling`` is what ``GradScaler.step`` consults before handing an optimizer
    the flag: torch's ``Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` set it on themselves when built
    with ``fused=True``, and only fused parameter groups read ``found_inf``. No public API says
    whether an optimizer honours it. Missing: ``False``, so the device-side skip is refused at fit
    start with the error naming the default sync mode, never armed on an optimizer that would step
    anyway.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def set_found_inf(optimizer: Any, flag: torch.Tensor) -> None:
    """Arm the skip: the next fused ``step()`` is a bitwise no-op where ``flag`` (0-d, on the device) is nonzero.

    Sets ``found_inf`` (float32, 0-d) and ``grad_scale = None`` (so nothing is unscaled), as
    ``GradScaler.step`` does for an optimizer that passes :func:`step_honours_found_inf`. The fused
    kernel then leaves weights, moments and ``step`` unchanged, with no host read. If a torch
    release renamed the attributes, ``step()`` would update as usual; ``tests/engine/test_pending.py``
    asserts the weights stay bitwise unchanged, so such a release fails the test suite rather than
    skipping silently.
    """
    optimizer.found_inf = flag.detach().to(torch.float32).reshape(())
    optimizer.grad_scale = None


def clear_found_inf(optimizer: Any) -> None:
    """Disarm what :func:`set_found_inf` set (``GradScaler`` deletes the attributes after its step the same way)."""
    for name in ("found_inf", "grad_scale"):
        if hasattr(optimizer, name):
            delattr(optimizer, name)


# -------------------------------------------------------------------------------------- frames
# ``sys._getframe`` is CPython's (documented as an implementation detail); ``inspect.currentframe()``
# is its public form and returns ``None`` where frames are unsupported. A frame walk reads the
# caller's stack: it lives here so that what is read, and the fallback, are in one place.

_getframe = getattr(sys, "_getframe", None)


def caller_frame(depth: int = 0) -> FrameType | None:
    """What ``sys._getframe(depth)`` would return in the caller: ``0`` is the caller's own frame, ``1`` its caller.

    Used on hot paths (a counted tensor read, an op of the replay), so it costs one C call. Missing ``sys._getframe``:
    ``inspect.currentframe()`` walked ``depth + 1`` frames out. ``None`` when the stack is shallower than ``depth``
    or the interpreter keeps no frames; every caller takes ``None`` as "no frame to name".
    """
    if _getframe is not None:
        try:
            return _getframe(depth + 1)
        except ValueError:  # the stack is not that deep
            return None
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        frame = frame.f_back if frame is not None else None
    return frame


def first_frame(frame: FrameType | None, predicate: Callable[[FrameType], bool]) -> FrameType | None:
    """The first frame from ``frame`` outwards (itself included) where ``predicate`` holds, else ``None``: the one
    walk over ``f_back`` (``core.syncs``, ``core.usercode``, ``core.replay``, the two walks above and below)."""
    while frame is not None and not predicate(frame):
        frame = frame.f_back
    return frame


def calling_owner(names: Mapping[int, str], skip: int) -> str | None:
    """The name of the innermost object whose method is running, among ``names`` (``id(obj) -> name``).

    Walks out from what ``sys._getframe(skip)`` is in the caller (see :func:`caller_frame`) and
    stops at the first frame whose local ``self`` is a key of ``names``; returns its name, ``None``
    for an empty name (the root module) or when no frame has a known ``self``. The op guard asks
    this at every guarded op call to name the module whose ``forward`` is running: walking the
    frames there replaces a pre-hook on every module's forward, so the loop stays minimal. Reading
    a frame's ``self`` needs ``f_locals`` (only read when ``self`` is one of the code's variables).
    Without frames (see :func:`caller_frame`): ``None``, and findings name no module.
    """
    try:
        frame = _getframe(skip + 1) if _getframe is not None else caller_frame(skip + 1)
    except ValueError:  # the stack is not that deep
        return None

    def owns(f: FrameType) -> bool:
        return "self" in f.f_code.co_varnames and id(f.f_locals.get("self")) in names

    found = first_frame(frame, owns)
    return names[id(found.f_locals["self"])] or None if found is not None else None


def averaged_model(callback: Any) -> torch.nn.Module | None:
    """The averaged model of Lightning's ``WeightAveraging`` (``EMAWeightAveraging``: an ``AveragedModel``) or
    ``StochasticWeightAveraging`` (a deep copy of the ``LightningModule``): ``callback._average_model``.

    Neither callback has a public accessor, and the average is training state: the callback folds the weights into
    it after every step (or at each epoch's start), before the guard's post-step check has read them, so a rollback
    must put it back with the weights. Missing (another Lightning version), ``None``: the average is not part of the
    snapshots, and the guard says so once in its log when the fit starts.
    """
    model = getattr(callback, "_average_model", None)
    return model if isinstance(model, torch.nn.Module) else None


#: the averaging callbacks' counters a rollback puts back with their average (``WeightAveraging``: the last step and
#: epoch folded in; ``StochasticWeightAveraging``: the last epoch)
_AVERAGING_COUNTERS = ("_latest_update_step", "_latest_update_epoch")


def averaging_counters(callback: Any) -> dict[str, int]:
    """When ``callback`` (``WeightAveraging``, ``StochasticWeightAveraging``) last folded the weights into its average:
    ``_latest_update_step`` / ``_latest_update_epoch``, which decide whether it folds them in again.

    ``WeightAveraging.state_dict`` holds only the step, ``StochasticWeightAveraging.state_dict`` reads its count with
    ``.item()`` (a host sync at every snapshot) and its ``load_state_dict`` does not reset a live count: neither
    serves a restore in place. A missing name is left out (nothing of it is put back)."""
    return {name: int(getattr(callback, name)) for name in _AVERAGING_COUNTERS if hasattr(callback, name)}


def set_averaging_counters(callback: Any, counters: Mapping[str, int]) -> None:
    """Put back what :func:`averaging_counters` read."""
    for name, value in counters.items():
        if name in _AVERAGING_COUNTERS:
            setattr(callback, name, int(value))


def compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule runs compiled: a ``torch.compile`` wrapper (``OptimizedModule``, reached by
    its class name) or ``nn.Module.compile()``'s ``_compiled_call_impl`` (private; no public test exists).

    The replay runs compiled regions eagerly, so a value they did not make again may be the compiler's, not the
    device's: the verdict says so instead of blaming the device. Missing names read as "not compiled"."""
    return any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


# -------------------------------------------------------------------------------- torchmetrics


def metric_state(metric: Any) -> dict[str, Any]:
    """The accumulated states of a torchmetrics ``Metric`` (public ``metric_state``, torchmetrics >= 1.0)."""
    state = getattr(metric, "metric_state", None)
    if isinstance(state, dict):
        return dict(state)
    return {name: getattr(metric, name) for name in metric._defaults}  # pragma: no cover - torchmetrics < 1.0


def metric_counters(metric: Any) -> tuple[int, Any]:
    """``(update_count, computed)``: the public ``update_count`` and the cached ``compute()`` result.

    The cache (``_computed``) has no public accessor; restoring the states without it would let
    ``compute()`` return a value computed from the discarded states.
    """
    return int(metric.update_count), getattr(metric, "_computed", None)


def set_metric_counters(metric: Any, update_count: int, computed: Any) -> None:
    """Set what :func:`metric_counters` read; torchmetrics has no public setter for either."""
    metric._update_count = update_count
    metric._computed = computed
