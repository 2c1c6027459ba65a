"""The walker over nested batches, module outputs and states.

A *tree* is any nesting of tensors in mappings, lists, tuples, namedtuples and dataclass
instances; anything else is a leaf. Reading a batch or an output, and copying, moving or
converting a state, goes through :func:`tensor_leaves` (read) or :func:`map_tree` (rebuild).
Two modules walk their own data by their own recursion: :mod:`.sharding` flattens a state
(dicts, lists, tuples) into one buffer per dtype and rebuilds it from its skeleton, and
:mod:`.events` makes an event's record JSON-safe.

* :func:`tensor_leaves` / :func:`floating_leaves` / :func:`tensors`: the tensors, with paths that
  read like Python (``batch['image']``, ``batch[0]``, ``batch.pixels``);
* :func:`clone_tree`: a deep copy with every tensor cloned (optionally into an earlier copy's storage);
* :func:`to_plain`: tensors on the CPU in dicts, lists and primitives (loadable with ``weights_only=True``);
* :func:`nbytes`: bytes held by the tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lightning_numguard._compat import foreach_copy_

__all__ = ["clone_tree", "floating_leaves", "map_tree", "nbytes", "tensor_leaves", "tensors", "to_plain"]

_MAX_DEPTH = 32
#: leaves ``copy.deepcopy`` returns as they are (immutable)
_ATOMIC = frozenset({int, float, bool, str, bytes, complex, type(None)})


def tensor_leaves(obj: Any, prefix: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in a nested structure, depth first.

    Understands tensors, mappings, lists and tuples, namedtuples and dataclass instances.
    Anything else (strings, ids, ``None``, numpy arrays) is skipped without error.

    Example:
        >>> [p for p, _ in tensor_leaves({"x": torch.zeros(1), "meta": ["a", torch.ones(1)]})]
        ["batch['x']", "batch['meta'][1]"]
    """
    yield from _walk(obj, prefix, 0)


def floating_leaves(obj: Any, prefix: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """The floating-point (and complex) tensors of ``obj``; integer and bool tensors are left alone."""
    if type(obj) in (tuple, list) and all(map(operator.is_, map(type, obj), itertools.repeat(torch.Tensor))):  # (x, y)
        return [(f"{prefix}[{i}]", t) for i, t in enumerate(obj) if t.is_floating_point() or t.is_complex()]
    return [(p, t) for p, t in _walk(obj, prefix, 0) if t.is_floating_point() or t.is_complex()]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor of ``obj``, depth first."""
    return [t for _, t in _walk(obj, "", 0)]


def nbytes(obj: Any) -> int:
    """Bytes held by the tensors of ``obj``."""
    return sum(t.numel() * t.element_size() for t in tensors(obj))


def _walk(obj: Any, path: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if depth >= _MAX_DEPTH or isinstance(obj, (str, bytes, bytearray)):
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, f"{path}[{key!r}]", depth + 1)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        for name in obj._fields:
            yield from _walk(getattr(obj, name), f"{path}.{name}", depth + 1)
    elif isinstance(obj, Sequence):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _walk(getattr(obj, field.name), f"{path}.{field.name}", depth + 1)


def map_tree(fn: Callable[[Any, Any], Any], obj: Any, like: Any = None, *, plain: bool = False) -> Any:
    """Rebuild ``obj`` with every leaf replaced by ``fn(leaf, matching leaf of like)``.

    ``like`` is a tree of the same structure (or ``None``) walked in step with ``obj``: leaves
    without a counterpart get ``None``. Dicts, lists, tuples and namedtuples keep their types;
    with ``plain=True`` the result holds only dicts (string keys) and lists, namedtuples and
    dataclass instances becoming dicts of their fields.
    """
    if isinstance(obj, (torch.Tensor, str, bytes, bytearray)):
        return fn(obj, like)
    if isinstance(obj, dict):
        sub = like if isinstance(like, dict) else {}
        items = ((k, map_tree(fn, v, sub.get(k), plain=plain)) for k, v in obj.items())
        return {str(k): v for k, v in items} if plain else type(obj)(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        sub_t = like if isinstance(like, tuple) and len(like) == len(obj) else (None,) * len(obj)
        values = [map_tree(fn, v, s, plain=plain) for v, s in zip(obj, sub_t)]
        return dict(zip(obj._fields, values)) if plain else type(obj)(*values)
    if isinstance(obj, (list, tuple)):
        sub_l = like if isinstance(like, (list, tuple)) and len(like) == len(obj) else (None,) * len(obj)
        values = [map_tree(fn, v, s, plain=plain) for v, s in zip(obj, sub_l)]
        return values if plain or isinstance(obj, list) else tuple(values)
    if plain and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: map_tree(fn, getattr(obj, f.name), None, plain=plain) for f in dataclasses.fields(obj)}
    return fn(obj, like)


def clone_tree(obj: Any, device: torch.device | str | None = None, pin: bool = False, into: Any = None) -> Any:
    """Deep-copy a nested structure, cloning every tensor (to ``device`` when given).

    ``into`` is an earlier result of ``clone_tree`` with the same structure: tensors whose
    shape, dtype and device match are overwritten in place instead of reallocated (those on the
    source's own device in one fused ``_foreach_copy_``, the per-tensor dispatch being most of a
    snapshot's cost for a model of many small tensors). Non-tensor leaves are deep-copied.
    """
    target_device = torch.device(device) if device is not None else None
    fused_dst: list[torch.Tensor] = []
    fused_src: list[torch.Tensor] = []

    def clone(leaf: Any, prev: Any) -> Any:
        if type(leaf) in _ATOMIC:  # what deepcopy returns as it is (a step's count, a learning rate, a name)
            return leaf
        if not isinstance(leaf, torch.Tensor):
            return copy.deepcopy(leaf)
        target = target_device if target_device is not None else leaf.device
        if (
            isinstance(prev, torch.Tensor)
            and prev.shape == leaf.shape
            and prev.dtype == leaf.dtype
            and prev.device == target
        ):
            if target == leaf.device:
                fused_dst.append(prev)
                fused_src.append(leaf)
            else:
                prev.copy_(leaf.detach(), non_blocking=leaf.device.type == "cuda")
            return prev
        src = leaf.detach()
        if target == src.device:
            return src.clone()
        out = torch.empty(src.shape, dtype=src.dtype, device=target, pin_memory=pin and target.type == "cpu")
        out.copy_(src, non_blocking=src.device.type == "cuda" and pin)
        return out

    result = map_tree(clone, obj, into)
    if fused_dst:
        with torch.no_grad():
            foreach_copy_(fused_dst, fused_src)
    return result


def to_plain(obj: Any) -> Any:
    """A copy made of CPU tensors, dicts, lists and primitives: loadable with ``weights_only=True``.

    Anything else becomes its ``repr``.
    """

    def plain(leaf: Any, _: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().cpu()
        if isinstance(leaf, (str, int, float, bool)) or leaf is None:
            return leaf
        return repr(leaf)

    return map_tree(plain, obj, plain=True)
