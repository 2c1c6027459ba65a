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
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from .sharding import ShardedState, shard, unshard
from .tree import clone_tree, nbytes

__all__ = ["Snapshot", "Stateful", "capture", "clone_tree", "restore", "rng_state", "set_rng_state", "unsharded"]


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> Any: ...  # pragma: no cover

    def load_state_dict(self, state: Any) -> Any: ...  # pragma: no cover


def rng_state() -> dict[str, Any]:
    """The torch CPU, CUDA (when initialised) and Python RNG states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Snapshot:
    """A verified-finite copy of the training state at the end of global step ``step - 1``."""

    step: int
    model: dict[str, Any]
    optimizers: list[Any]
    stateful: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    sharded: ShardedState | None = None  # this rank's slice of the parameters and optimizer states

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
    """
    device = "cpu" if where == "host" else None
    pin = where == "host" and torch.cuda.is_available()
    sd = dict(model.state_dict())
    if model_state:
        sd.update(model_state)
    states = {name: obj.state_dict() for name, obj in (stateful or {}).items()}
    if stateful_state:
        states.update({k: v for k, v in stateful_state.items() if k in states})
    sharded = None
    if shard_among is not None:
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        tree = {
            "keys": list(sd),
            "model": {k: v for k, v in sd.items() if k in names},
            "optimizers": [o.state_dict() for o in optimizers],
        }
        old = reuse.sharded if reuse is not None else None
        sharded = shard(tree, *shard_among, device if device else tree_device(sd), pin=pin, reuse=old)
        sd = {k: v for k, v in sd.items() if k not in names}
        optimizers = []
    return Snapshot(
        step=step,
        model=clone_tree(sd, device, pin, reuse.model if reuse else None),
        optimizers=clone_tree([o.state_dict() for o in optimizers], device, pin, reuse.optimizers if reuse else None),
        stateful=clone_tree(states, device, pin, reuse.stateful if reuse else None),
        rng=copy.deepcopy(rng) if rng is not None else rng_state(),
        sharded=sharded,
    )


def tree_device(state: Mapping[str, Any]) -> torch.device:
    """The device of the first tensor of ``state`` (the CPU when it holds none)."""
    return next((v.device for v in state.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))


def unsharded(snapshot: Snapshot, slices: Sequence[dict[torch.dtype, torch.Tensor]]) -> Snapshot:
    """The whole snapshot from every rank's slices of a sharded one, in rank order (no communication)."""
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
    if snapshot.sharded is not None:
        raise ValueError("a sharded snapshot holds only this rank's slice: rebuild it with `unsharded` first")
    model.load_state_dict(snapshot.model, strict=True)  # copies into the live tensors in place
    if len(optimizers) != len(snapshot.optimizers):
        raise ValueError(
            f"the snapshot holds {len(snapshot.optimizers)} optimizer states but {len(optimizers)} "
            "optimizers are live; were optimizers re-created after the snapshot?"
        )
    for opt, state in zip(optimizers, snapshot.optimizers):
        opt.load_state_dict(clone_tree(state))
    for name, obj in (stateful or {}).items():
        if name in snapshot.stateful:
            obj.load_state_dict(clone_tree(snapshot.stateful[name]))
    if restore_rng and snapshot.rng is not None:
        set_rng_state(snapshot.rng)
