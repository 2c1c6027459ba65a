"""Verified-finite copies of the training state, restored in place, bitwise.

A :class:`Snapshot` holds deep copies (never aliases) of

* a module's ``state_dict`` (parameters and buffers),
* every optimizer's ``state_dict``,
* any number of *stateful* objects (LR schedulers, the AMP scaler, metric states, numpy's
  RNG…) given as :class:`Stateful` adapters,
* the torch (CPU and CUDA) and Python RNG states.

Copies go to the host by default (pinned memory and non-blocking copies when the source is on
CUDA, so the copy is ordered on the stream before the optimizer step that follows) or stay on
the device (``where="device"``). A new capture reuses the previous snapshot's storage when the
shapes match, so taking one costs a copy, not an allocation.

:func:`restore` copies back in place: parameters keep their identity (the optimizer still
points to them), optimizer state is loaded from a *fresh* clone each time (``load_state_dict``
keeps same-device tensors by reference, so restoring the same snapshot twice would otherwise
share storage with the live state).

Sharded (``capture(..., shard_among=(rank, world))``, data parallelism): the parameters and
optimizer states, identical on every rank, go into a :class:`~.sharding.ShardedState` holding only
this rank's ``1/world`` of them; buffers, stateful objects and RNG states (which may differ per
rank) stay whole. :func:`unsharded` rebuilds the whole snapshot from every rank's slices.

Already sharded (``DTensor`` parameters and optimizer state: FSDP2, tensor parallel): each rank copies only
its local shards (:func:`.dtensor.localize`: no collective, per-rank memory ``~ 1/world`` of the state under
FSDP2) and keeps their specs; :func:`restore` wraps the copies back into DTensors of the same placements
(:func:`.dtensor.globalize`), so ``load_state_dict`` copies shard to shard, in place.

Asynchronous (:func:`start_capture`, then :func:`finish_capture`): the first half plans the
destinations of the parameters and optimizer states (reusing a spare snapshot's storage) and starts
copying them with :mod:`.async_copy` (a CUDA side stream, or a worker thread on the CPU), overlapped
with whatever the caller does next; the second half copies the rest (buffers, stateful objects, RNG)
synchronously and returns a :class:`Snapshot` whose copies may still be in flight: its holder calls
:meth:`PendingCapture.wait` before anything writes the sources, and every reader of the snapshot
(:func:`restore`, :func:`unsharded`, :meth:`Snapshot.ready`) blocks until the copies are done.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from lightning_numguard.dtensor import globalize, localize
from lightning_numguard.state.async_copy import Backend, Copies, plan_tree, start
from lightning_numguard.state.rng import copy_rng, rng_state, set_rng_state
from lightning_numguard.state.sharding import ShardedState, shard, unshard
from lightning_numguard.tree import clone_tree, map_tree, nbytes

__all__ = [
    "PendingCapture",
    "Snapshot",
    "Stateful",
    "capture",
    "clone_tree",
    "copy_rng",
    "finish_capture",
    "restore",
    "rng_state",
    "set_rng_state",
    "start_capture",
    "unsharded",
]


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any: ...  # pragma: no cover

    def load_state_dict(self, state: Any) -> Any: ...  # pragma: no cover


@dataclass
class Snapshot:
    """A verified-finite copy of the training state at the end of global step ``step - 1``."""

    step: int
    model: dict[str, Any]
    optimizers: list[Any]
    stateful: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    sharded: ShardedState | None = None  # this rank's slice of the parameters and optimizer states
    copies: Copies | None = field(default=None, repr=False, compare=False)  # still in flight (asynchronous)
    # the DTensor specs of the local shards held in ``model`` and ``optimizers`` (see core.dtensor.localize)
    specs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def ready(self) -> Snapshot:
        """Block until an asynchronous capture's copies are done (no-op otherwise); returns ``self``."""
        if self.copies is not None:
            self.copies.synchronize()
            self.copies = None
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this snapshot holds."""
        own = self.sharded.nbytes if self.sharded is not None else 0
        return nbytes(self.model) + nbytes(self.optimizers) + nbytes(self.stateful) + own


def capture(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    stateful: Mapping[str, Stateful] | None = None,
    *,
    step: int,
    where: Literal["host", "device"] = "host",
    rng: dict[str, Any] | None = None,
    model_state: Mapping[str, Any] | None = None,
    stateful_state: Mapping[str, Any] | None = None,
    reuse: Snapshot | None = None,
    shard_among: tuple[int, int] | None = None,
    dtensors: bool = True,
) -> Snapshot:
    """Copy the training state (no verification: the caller checks the live tensors first).

    Args:
        model: the module whose ``state_dict`` is copied.
        optimizers: the optimizers whose ``state_dict`` is copied.
        stateful: named objects (schedulers, scaler, metric adapters) copied via ``state_dict``.
        step: the global step the state belongs to.
        where: ``"host"`` (pinned when CUDA is used) or ``"device"``.
        rng: an RNG state captured earlier (:func:`rng_state`); ``None`` captures it now.
        model_state: entries overriding ``model.state_dict()`` (e.g. buffers copied at the
            start of the step, before the forward pass changed them).
        stateful_state: states overriding ``stateful[name].state_dict()``, likewise.
        reuse: an older snapshot whose storage may be overwritten.
        shard_among: ``(rank, world)``: keep only this rank's ``1/world`` of the parameters and
            optimizer states (every rank must hold the same ones); see :func:`unsharded`.
        dtensors: whether the state may hold ``DTensor`` local shards (``False``: the caller knows it holds none,
            from an earlier capture of the same fit, and the states are not walked for them).
    """
    device = "cpu" if where == "host" else None
    pin = where == "host" and torch.cuda.is_available()
    sd, states = _live_states(model, model_state, stateful, stateful_state)
    opt_states: Any = [o.state_dict() for o in optimizers]
    model_specs = opt_specs = None
    if dtensors:
        sd, model_specs = localize(sd)
        opt_states, opt_specs = localize(opt_states)
    sharded = None
    if shard_among is not None:
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        tree = {"keys": list(sd), "model": {k: v for k, v in sd.items() if k in names}, "optimizers": opt_states}
        old = reuse.sharded if reuse is not None else None
        sharded = shard(tree, *shard_among, device if device else tree_device(sd), pin=pin, reuse=old)
        sd = {k: v for k, v in sd.items() if k not in names}
        opt_states = []
    return Snapshot(
        step=step,
        model=clone_tree(sd, device, pin, reuse.model if reuse else None),
        optimizers=clone_tree(opt_states, device, pin, reuse.optimizers if reuse else None),
        stateful=clone_tree(states, device, pin, reuse.stateful if reuse else None),
        rng=copy_rng(rng) if rng is not None else rng_state(),
        sharded=sharded,
        specs=_specs(model_specs, opt_specs),
    )


def _specs(model: Any, optimizers: Any) -> dict[str, Any]:
    """The ``Snapshot.specs`` entry of what :func:`.dtensor.localize` found (empty without DTensors)."""
    return {k: v for k, v in (("model", model), ("optimizers", optimizers)) if v is not None}


def _live_states(
    model: nn.Module,
    model_state: Mapping[str, Any] | None,
    stateful: Mapping[str, Stateful] | None,
    stateful_state: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's ``state_dict`` and each stateful object's, with the given overrides (no copies)."""
    sd = dict(model.state_dict())
    if model_state:
        sd.update(model_state)
    states = {name: obj.state_dict() for name, obj in (stateful or {}).items()}
    if stateful_state:
        states.update({k: v for k, v in stateful_state.items() if k in states})
    return sd, states


def tree_device(state: Mapping[str, Any]) -> torch.device:
    """The device of the first tensor of ``state`` (the CPU when it holds none)."""
    return next((v.device for v in state.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))


def unsharded(snapshot: Snapshot, slices: Sequence[dict[torch.dtype, torch.Tensor]]) -> Snapshot:
    """The whole snapshot from every rank's slices of a sharded one, in rank order (no communication)."""
    snapshot.ready()
    if snapshot.sharded is None:
        return snapshot
    tree = unshard(snapshot.sharded, slices)
    model = {k: tree["model"][k] if k in tree["model"] else snapshot.model[k] for k in tree["keys"]}
    return dataclasses.replace(snapshot, model=model, optimizers=tree["optimizers"], sharded=None)


def restore(
    snapshot: Snapshot,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    stateful: Mapping[str, Stateful] | None = None,
    *,
    restore_rng: bool = True,
) -> None:
    """Put ``snapshot`` back in place; afterwards every tensor equals the snapshot bitwise."""
    if snapshot.ready().sharded is not None:
        raise ValueError("a sharded snapshot holds only this rank's slice: rebuild it with `unsharded` first")
    # copies into the live tensors in place (DTensor entries shard to shard: same specs, no collective)
    model.load_state_dict(globalize(snapshot.model, snapshot.specs.get("model")), strict=True)
    if len(optimizers) != len(snapshot.optimizers):
        raise ValueError(
            f"the snapshot holds {len(snapshot.optimizers)} optimizer states but {len(optimizers)} "
            "optimizers are live; were optimizers re-created after the snapshot?"
        )
    opt_specs = snapshot.specs.get("optimizers") or [None] * len(optimizers)
    for opt, state, specs in zip(optimizers, snapshot.optimizers, opt_specs):
        # a key added to a parameter group since the snapshot (StochasticWeightAveraging's ``swa_lr``, put there with
        # the scheduler that reads it) is kept: the snapshot's group cannot say it, and its reader would fail
        added = [{k: v for k, v in g.items() if k not in s} for g, s in zip(opt.param_groups, state["param_groups"])]
        opt.load_state_dict(globalize(clone_tree(state), specs))
        for group, keys in zip(opt.param_groups, added):
            group.update(keys)
    for name, obj in (stateful or {}).items():
        if name in snapshot.stateful:
            obj.load_state_dict(clone_tree(snapshot.stateful[name]))
    if restore_rng and snapshot.rng is not None:
        set_rng_state(snapshot.rng)


@dataclass
class PendingCapture:
    """The first half of an asynchronous capture: parameters and optimizer states being copied.

    Attributes:
        step: the global step the state belongs to.
        params: the destination of each parameter (by ``state_dict`` key); empty when sharded.
        optimizers: the destination trees of the optimizer states; empty when sharded.
        copies: the copies in flight.
    """

    step: int
    device: str | None
    pin: bool
    params: dict[str, Any]
    optimizers: list[Any]
    planned: list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) of each optimizer-state tensor
    sharded: ShardedState | None
    reuse: Snapshot | None
    copies: Copies
    specs: dict[str, Any] = field(default_factory=dict)  # DTensor specs of the local shards copied

    def wait(self) -> None:
        """Order what comes next (the optimizer step writing the sources) after the copies (no host stall)."""
        self.copies.wait()


def start_capture(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    step: int,
    where: Literal["host", "device"] = "host",
    reuse: Snapshot | None = None,
    shard_among: tuple[int, int] | None = None,
    backend: Backend = "sync",
) -> PendingCapture:
    """Start copying the parameters and optimizer states into ``reuse``'s storage (or new storage).

    ``reuse`` must not be a snapshot anyone still relies on (keep a spare: double buffering). Nothing
    may write the parameters or optimizer states until :meth:`PendingCapture.wait`; the forward and
    backward passes do not. Other arguments as in :func:`capture`.
    """
    device = "cpu" if where == "host" else None
    pin = where == "host" and torch.cuda.is_available()
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    sd, model_specs = localize(dict(model.state_dict()))
    params = {k: v for k, v in sd.items() if k in names}
    states, opt_specs = localize([o.state_dict() for o in optimizers])
    specs = _specs(model_specs, opt_specs)
    pairs: tuple[list[Any], list[Any]] = ([], [])
    if shard_among is not None:
        tree = {"keys": list(sd), "model": params, "optimizers": states}
        old = reuse.sharded if reuse is not None else None
        target = device if device else tree_device(sd)
        sharded = shard(tree, *shard_among, target, pin=pin, reuse=old, copies=pairs)
        return PendingCapture(step, device, pin, {}, [], [], sharded, reuse, start(*pairs, backend=backend), specs)
    dst_params = plan_tree(params, device, pin, reuse.model if reuse else None, pairs)
    n = len(pairs[0])
    dst_opts = plan_tree(states, device, pin, reuse.optimizers if reuse else None, pairs)
    planned = list(zip(pairs[0][n:], pairs[1][n:]))
    return PendingCapture(
        step, device, pin, dst_params, dst_opts, planned, None, reuse, start(*pairs, backend=backend), specs
    )


def finish_capture(
    pending: PendingCapture,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    stateful: Mapping[str, Stateful] | None = None,
    *,
    rng: dict[str, Any] | None = None,
    model_state: Mapping[str, Any] | None = None,
    stateful_state: Mapping[str, Any] | None = None,
) -> Snapshot:
    """The snapshot: ``pending``'s copies plus buffers, stateful objects and RNG, copied now (as :func:`capture`).

    The optimizer states' non-tensor entries (``param_groups``, counters) are read now; a tensor
    that is not the one planned (the optimizer state changed shape since) is copied now. The
    returned snapshot's copies may be in flight: call :meth:`PendingCapture.wait` before the sources
    are written; readers block on them (:meth:`Snapshot.ready`).
    """
    device, pin, reuse = pending.device, pending.pin, pending.reuse
    sd, states = _live_states(model, model_state, stateful, stateful_state)
    sd = localize(sd)[0]
    if pending.sharded is not None:
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        rest = clone_tree({k: v for k, v in sd.items() if k not in names}, device, pin, reuse.model if reuse else None)
        opts: list[Any] = []
    else:
        rest = clone_tree(
            {k: v for k, v in sd.items() if k not in pending.params}, device, pin, reuse.model if reuse else None
        )
        rest = {k: pending.params[k] if k in pending.params else rest[k] for k in sd}
        planned = iter(pending.planned)

        def leaf(x: Any, _: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return copy.deepcopy(x)
            dst, src = next(planned, (None, None))
            if dst is not None and src is not None and _same(src, x):
                return dst
            return clone_tree(x, device, pin)

        opts = [map_tree(leaf, localize(o.state_dict())[0]) for o in optimizers]
    return Snapshot(
        step=pending.step,
        model=rest,
        optimizers=opts,
        stateful=clone_tree(states, device, pin, reuse.stateful if reuse else None),
        rng=copy_rng(rng) if rng is not None else rng_state(),
        sharded=pending.sharded,
        copies=pending.copies,
        specs=pending.specs,
    )


def _same(planned: torch.Tensor, live: torch.Tensor) -> bool:
    return (planned.data_ptr(), planned.shape, planned.dtype) == (live.data_ptr(), live.shape, live.dtype)
