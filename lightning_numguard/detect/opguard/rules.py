"""The domain rules of the guarded ops, as data: which argument, which bounds, what fill.

A *check* reads the arguments of one call and returns the :class:`ArgRule` of each tensor
argument it wants checked (none when the call is one the op will reject by itself). The
mode applies them with :func:`violations` (an elementwise mask) and :func:`fill_mask`
(where to put the fill value). Everything here is pure torch and never reads a value on
the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "GUARDED_OPS",
    "ArgRule",
    "Args",
    "Check",
    "check_class_targets",
    "check_dim_index",
    "check_distribution",
    "check_embedding",
    "check_one_hot",
    "check_probabilities",
    "fill_mask",
    "violations",
]

GUARDED_OPS: frozenset[str] = frozenset(
    {
        "binary_cross_entropy",
        "nll_loss",
        "cross_entropy",
        "embedding",
        "embedding_bag",
        "gather",
        "scatter",
        "scatter_add",
        "index_select",
        "one_hot",
        "multinomial",
    }
)


class Args(Protocol):
    """The arguments of one call, read by canonical parameter name."""

    def get(self, name: str, default: Any = None) -> Any:
        """The argument ``name``, or ``default`` when the call does not pass it."""


@dataclass(frozen=True)
class ArgRule:
    """One tensor argument of one call to check, and what replaces its bad values.

    Attributes:
        arg: Canonical parameter name of the checked tensor (``"input"``, ``"target"``, ``"index"``).
        rule: The rule in words, e.g. ``"input in [0, 1]"``.
        low: Lower bound (inclusive). An ``int`` for an integer tensor: comparing int64 with a
            Python float promotes to float32 and misjudges indices past 2**24.
        high: Upper bound (inclusive for ``binary_cross_entropy``, exclusive otherwise);
            ``None`` when unbounded.
        fill: The value put in place of a bad one (for ``multinomial``: in the whole row).
        ignore_index: The value exempt from the bounds (``nll_loss``/``cross_entropy``), else ``None``.
    """

    arg: str
    rule: str
    low: float
    high: float | None
    fill: float
    ignore_index: int | None = None


Check = Callable[[str, Args], list[ArgRule]]
"""Reads one call of ``op`` and returns the arguments to check, in order."""


def violations(op: str, x: torch.Tensor, low: float, high: float | None, ignore_index: int | None) -> torch.Tensor:
    """Elementwise bool mask of the values of ``x`` that break ``op``'s rule; no sync.

    A range test is ``clamp(x, low, top) != x``: two kernels, and NaN (which survives the
    clamp and differs from itself) fails it. Integer tensors must get integer bounds:
    comparing int64 with a Python float promotes to float32 and misjudges indices past 2**24.
    For ``multinomial`` an entry is bad when it is non-finite or negative, and every entry
    of a row without a positive entry is bad.
    """
    if op == "multinomial":
        bad = x.clamp(0, torch.finfo(x.dtype).max) != x  # NaN, ±inf and negative entries
        bad |= (x > 0).any(-1, keepdim=True).logical_not_()  # a row without a positive entry
        return bad
    if high is None:
        return x < low
    top = high if op == "binary_cross_entropy" else high - 1  # integer rules: exclusive high
    bad = x.clamp(low, top) != x if top >= low else torch.ones_like(x, dtype=torch.bool)
    if ignore_index is not None and not low <= ignore_index <= top:
        bad &= x != ignore_index
    return bad


def fill_mask(op: str, bad: torch.Tensor) -> torch.Tensor:
    """Where the fill value goes, given the :func:`violations` mask: a whole row for ``multinomial``."""
    return bad.any(-1, keepdim=True) if op == "multinomial" else bad


def _is_index(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


def check_probabilities(op: str, args: Args) -> list[ArgRule]:
    """``binary_cross_entropy``: input and target in ``[0, 1]`` (NaN fails) → ``0.5``."""
    out = []
    for name in ("input", "target"):
        tensor = args.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            out.append(ArgRule(name, f"{name} in [0, 1]", 0.0, 1.0, 0.5))
    return out


def check_class_targets(op: str, args: Args) -> list[ArgRule]:
    """``nll_loss``/``cross_entropy``: an integer target in ``[0, C)`` or ``== ignore_index`` → ``ignore_index``."""
    logits, target = args.get("input"), args.get("target")
    if not (isinstance(logits, torch.Tensor) and logits.dim() > 0 and _is_index(target)):
        return []  # probability targets, or a call the op rejects by itself
    classes = logits.size(1) if logits.dim() > 1 else logits.size(0)
    ignore_index = args.get("ignore_index", -100)
    if not isinstance(ignore_index, int):
        return []
    rule = f"target in [0, {classes}) or == ignore_index ({ignore_index})"
    return [ArgRule("target", rule, 0, classes, ignore_index, ignore_index)]


def check_embedding(op: str, args: Args) -> list[ArgRule]:
    """``embedding``/``embedding_bag``: index in ``[0, num_embeddings)`` → ``padding_idx``, else 0."""
    index_name, weight_name = "input", "weight"
    indices, weight = args.get(index_name), args.get(weight_name)
    if op == "embedding_bag" and _is_index(weight) and isinstance(indices, torch.Tensor):
        # F.embedding_bag still accepts the legacy (weight, input) order and swaps them itself.
        index_name, weight_name, indices, weight = weight_name, index_name, weight, indices
    if not (_is_index(indices) and isinstance(weight, torch.Tensor) and weight.dim() > 0):
        return []
    rows = weight.size(0)
    padding_idx = args.get("padding_idx")
    if isinstance(padding_idx, int) and padding_idx < 0:
        padding_idx += rows  # the functional forms count a negative padding_idx from the end
    elif padding_idx is None:
        padding_idx = args.get("raw_padding_idx")  # raw torch.embedding*: negative means none
    fill = padding_idx if isinstance(padding_idx, int) and 0 <= padding_idx < rows else 0
    return [ArgRule(index_name, f"index in [0, {rows})", 0, rows, fill)]


def check_dim_index(op: str, args: Args) -> list[ArgRule]:
    """``gather``/``scatter``/``scatter_add``/``index_select``: index in ``[0, size)`` along ``dim`` → 0."""
    source, dim, index = args.get("input"), args.get("dim"), args.get("index")
    if not (isinstance(source, torch.Tensor) and _is_index(index) and isinstance(dim, int)):
        return []
    try:
        size = source.size(dim) if source.dim() > 0 else 1
    except (IndexError, RuntimeError):
        return []  # a bad dim: let the op raise its own error
    return [ArgRule("index", f"index in [0, {size}) along dim {dim}", 0, size, 0)]


def check_one_hot(op: str, args: Args) -> list[ArgRule]:
    """``one_hot``: value in ``[0, num_classes)``, or ``>= 0`` when it is inferred → 0."""
    labels, num_classes = args.get("input"), args.get("num_classes", -1)
    if not (_is_index(labels) and isinstance(num_classes, int)):
        return []
    if num_classes < 0:
        return [ArgRule("input", "value >= 0 (num_classes inferred)", 0, None, 0)]
    return [ArgRule("input", f"value in [0, {num_classes})", 0, num_classes, 0)]


def check_distribution(op: str, args: Args) -> list[ArgRule]:
    """``multinomial``: entries finite and ``>= 0``, each row with a positive sum → a uniform row."""
    probs = args.get("input")
    if not (isinstance(probs, torch.Tensor) and probs.is_floating_point() and probs.dim() in (1, 2)):
        return []
    return [ArgRule("input", "probabilities finite and >= 0, each row sum > 0", 0.0, None, 1.0)]
