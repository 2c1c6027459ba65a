"""``DTensor`` local shards: under FSDP2 and tensor parallelism a rank checks, copies and restores what it holds.

A parameter sharded by ``fully_shard`` or ``parallelize_module`` is a ``DTensor``: a local tensor (this
rank's shard, or the whole tensor for a ``Replicate`` placement) and a spec (device mesh, placements,
global shape and stride). Reductions and ``.tolist()`` on a ``DTensor`` either raise or gather the
whole tensor; the guard never wants either. So:

* :func:`local` is the tensor this rank holds (the same storage: an in-place write changes the
  ``DTensor``); checks run on it, and each rank's flag goes into the step's one packed all-reduce;
* :func:`localize` turns a state tree (a ``state_dict``, an optimizer's ``state_dict``) into its local
  tensors plus the :class:`ShardSpec` of each ``DTensor`` leaf, with no copy and no communication; a
  snapshot clones the local tensors (per-rank memory ``~ 1/world`` of the state under FSDP2);
* :func:`globalize` wraps the local tensors back into DTensors of the recorded specs
  (``DTensor.from_local`` with ``run_check=False``: no communication), so ``load_state_dict`` copies
  them shard to shard, in place, and the optimizer gets state with the placements it had.

torch and the standard library only. ``torch.distributed.tensor`` is never imported here: a tensor can
only be a ``DTensor`` once that module is loaded, so it is looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_numguard._compat import dtensor_local
from lightning_numguard.tree import map_tree

__all__ = ["ShardSpec", "dtensor_type", "globalize", "has_dtensor", "is_dtensor", "local", "localize", "rewrap"]


def dtensor_type() -> type | None:
    """The ``DTensor`` class when ``torch.distributed.tensor`` is loaded, else ``None`` (no tensor is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def has_dtensor(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor``."""
    cls = dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard (same storage), anything else itself."""
    if type(t) is torch.Tensor:  # the usual: a plain tensor (a DTensor is a subclass)
        return t
    cls = dtensor_type()
    return dtensor_local(t) if cls is not None and isinstance(t, cls) else t


@dataclass(frozen=True)
class ShardSpec:
    """What :func:`rewrap` needs to make a local tensor a ``DTensor`` again (no tensor data)."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: Any) -> ShardSpec:
        return cls(t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()))


def rewrap(shard: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """A ``DTensor`` of ``spec`` around ``shard`` (moved to the mesh's device type if elsewhere); no collective."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        shard, spec.mesh, list(spec.placements), run_check=False, shape=spec.shape, stride=spec.stride
    )


def localize(tree: Any) -> tuple[Any, Any]:
    """``(tree with each DTensor replaced by its local tensor, specs)``; no copy, no communication.

    ``specs`` is ``None`` when the tree holds no ``DTensor`` (nothing to undo), else a tree of the same
    structure with a :class:`ShardSpec` where a ``DTensor`` was and ``None`` elsewhere, for :func:`globalize`.
    """
    cls = dtensor_type()
    if cls is None:
        return tree, None
    found = False

    def spec_of(leaf: Any, _: Any) -> Any:
        nonlocal found
        if isinstance(leaf, cls):
            found = True
            return ShardSpec.of(leaf)
        return None

    specs = map_tree(spec_of, tree)
    if not found:
        return tree, None
    return map_tree(lambda leaf, _: dtensor_local(leaf) if isinstance(leaf, cls) else leaf, tree), specs


def globalize(tree: Any, specs: Any) -> Any:
    """``tree`` with every leaf whose spec is a :class:`ShardSpec` rewrapped as a ``DTensor`` (see :func:`localize`)."""
    if specs is None:
        return tree
    return map_tree(lambda leaf, spec: rewrap(leaf, spec) if isinstance(spec, ShardSpec) else leaf, tree, specs)
