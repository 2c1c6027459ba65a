"""Walk nested batches and module outputs into ``(path, tensor)`` pairs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["floating_leaves", "tensor_leaves"]

_MAX_DEPTH = 32


def tensor_leaves(obj: Any, prefix: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in a nested structure, depth first.

    Understands tensors, mappings, lists and tuples, namedtuples and dataclass instances.
    Anything else (strings, ids, ``None``, numpy arrays) is skipped without error.

    Paths read like Python: ``batch['image']``, ``batch[0]``, ``batch.pixels``.

    Example:
        >>> [p for p, _ in tensor_leaves({"x": torch.zeros(1), "meta": ["a", torch.ones(1)]})]
        ["batch['x']", "batch['meta'][1]"]
    """
    yield from _walk(obj, prefix, 0)


def floating_leaves(obj: Any, prefix: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """The floating-point (and complex) tensors of ``obj``; integer and bool tensors are left alone."""
    return [(p, t) for p, t in _walk(obj, prefix, 0) if t.is_floating_point() or t.is_complex()]


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
