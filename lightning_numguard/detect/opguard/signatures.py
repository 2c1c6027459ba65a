"""The table of op signatures: each function object that spells a guarded op, and how.

One op has several spellings (``F.cross_entropy``, ``torch._C._nn.cross_entropy_loss``;
``torch.gather``, ``Tensor.gather``), each with its own parameter order and names. A
:class:`Form` maps the canonical parameter names the rules use to positions and keywords
of one spelling; :class:`Call` reads and replaces arguments by those names.

The table is tolerant: every function is looked up by name with ``getattr(..., None)``
and a name this torch lacks (a private ``torch._C._nn`` binding renamed or removed) is
left out of the table, with one DEBUG log line, instead of failing the import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_numguard._compat import nn_bindings
from lightning_numguard.detect.opguard.rules import (
    Check,
    check_class_targets,
    check_dim_index,
    check_distribution,
    check_embedding,
    check_one_hot,
    check_probabilities,
)

__all__ = ["FORMS", "Call", "Form"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Form:
    """How one function object spells one guarded op: its parameters and its check."""

    op: str
    check: Check
    positions: dict[str, int]
    keywords: dict[str, tuple[str, ...]]


class Call:
    """The arguments of one call, readable and replaceable by canonical parameter name."""

    __slots__ = ("args", "form", "kwargs")

    def __init__(self, form: Form, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.form = form
        self.args = list(args)
        self.kwargs = dict(kwargs)

    def get(self, name: str, default: Any = None) -> Any:
        """The argument ``name``, or ``default`` when the call does not pass it."""
        position = self.form.positions.get(name)
        if position is not None and position < len(self.args):
            return self.args[position]
        for keyword in self.form.keywords.get(name, ()):
            if keyword in self.kwargs:
                return self.kwargs[keyword]
        return default

    def set(self, name: str, value: Any) -> None:
        """Replace the argument ``name`` where the call passed it; nothing when it did not."""
        position = self.form.positions.get(name)
        if position is not None and position < len(self.args):
            self.args[position] = value
            return
        for keyword in self.form.keywords.get(name, ()):
            if keyword in self.kwargs:
                self.kwargs[keyword] = value
                return


def _form(op: str, check: Check, params: Sequence[str], aliases: Mapping[str, str] | None = None) -> Form:
    """A form whose positional parameters are ``params`` (canonical names), plus keyword aliases."""
    keywords: dict[str, tuple[str, ...]] = {name: (name,) for name in params}
    for keyword, name in (aliases or {}).items():
        keywords[name] = (*keywords.get(name, ()), keyword)
    return Form(op, check, {name: i for i, name in enumerate(params)}, keywords)


_SELF = {"self": "input"}
_BCE = ("input", "target", "weight")
_LOSS = ("input", "target", "weight", "size_average", "ignore_index")  # F.* and its reduce/reduction tail
_RAW_LOSS = ("input", "target", "weight", "reduction", "ignore_index")  # torch._C._nn.*
_DIM_INDEX = ("input", "dim", "index")
_MULTINOMIAL = ("input", "num_samples")
_F_EMBEDDING_BAG = (
    "input",
    "weight",
    "offsets",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "mode",
    "sparse",
    "per_sample_weights",
    "include_last_offset",
    "padding_idx",
)
_RAW_EMBEDDING_BAG = (
    "weight",
    "input",
    "offsets",
    "scale_grad_by_freq",
    "mode",
    "sparse",
    "per_sample_weights",
    "include_last_offset",
    "raw_padding_idx",
)


def _build_forms(
    nn: object | None,
    functional: object = F,
    torch_ns: object = torch,
    tensor: object = torch.Tensor,
) -> dict[Callable[..., Any], Form]:
    """The table from function object to form, built from the namespaces given.

    Args:
        nn: The raw loss bindings (``torch._C._nn``); ``None`` when torch has none.
        functional: ``torch.nn.functional``.
        torch_ns: The ``torch`` namespace.
        tensor: The ``torch.Tensor`` class (its methods).

    Returns:
        One entry per function the namespaces have; a name one of them lacks is left out
        and logged once, at DEBUG, with every other missing name.
    """
    entries: list[tuple[object, str, str, Form]] = [
        (functional, "F", "binary_cross_entropy", _form("binary_cross_entropy", check_probabilities, _BCE)),
        (nn, "torch._C._nn", "binary_cross_entropy", _form("binary_cross_entropy", check_probabilities, _BCE, _SELF)),
        (functional, "F", "nll_loss", _form("nll_loss", check_class_targets, _LOSS)),
        (nn, "torch._C._nn", "nll_loss", _form("nll_loss", check_class_targets, _RAW_LOSS, _SELF)),
        (nn, "torch._C._nn", "nll_loss_nd", _form("nll_loss", check_class_targets, _RAW_LOSS, _SELF)),
        (nn, "torch._C._nn", "nll_loss2d", _form("nll_loss", check_class_targets, _RAW_LOSS, _SELF)),
        (functional, "F", "cross_entropy", _form("cross_entropy", check_class_targets, _LOSS)),
        (nn, "torch._C._nn", "cross_entropy_loss", _form("cross_entropy", check_class_targets, _RAW_LOSS, _SELF)),
        (functional, "F", "embedding", _form("embedding", check_embedding, ("input", "weight", "padding_idx"))),
        (
            torch_ns,
            "torch",
            "embedding",
            _form("embedding", check_embedding, ("weight", "input", "raw_padding_idx"), {"indices": "input"}),
        ),
        (functional, "F", "embedding_bag", _form("embedding_bag", check_embedding, _F_EMBEDDING_BAG)),
        (
            torch_ns,
            "torch",
            "embedding_bag",
            _form(
                "embedding_bag",
                check_embedding,
                _RAW_EMBEDDING_BAG,
                {"indices": "input", "padding_idx": "raw_padding_idx"},
            ),
        ),
        (functional, "F", "one_hot", _form("one_hot", check_one_hot, ("input", "num_classes"))),
        (torch_ns, "torch", "multinomial", _form("multinomial", check_distribution, _MULTINOMIAL)),
        (tensor, "Tensor", "multinomial", _form("multinomial", check_distribution, _MULTINOMIAL)),
    ]
    for op, namespaced in {
        "gather": ((torch_ns, "torch", "gather"), (tensor, "Tensor", "gather")),
        "scatter": ((torch_ns, "torch", "scatter"), (tensor, "Tensor", "scatter"), (tensor, "Tensor", "scatter_")),
        "scatter_add": (
            (torch_ns, "torch", "scatter_add"),
            (tensor, "Tensor", "scatter_add"),
            (tensor, "Tensor", "scatter_add_"),
        ),
        "index_select": ((torch_ns, "torch", "index_select"), (tensor, "Tensor", "index_select")),
    }.items():
        for namespace, label, name in namespaced:
            entries.append((namespace, label, name, _form(op, check_dim_index, _DIM_INDEX, _SELF)))

    forms: dict[Callable[..., Any], Form] = {}
    missing: list[str] = []
    for namespace, label, name, form in entries:
        func = getattr(namespace, name, None)
        if callable(func):
            forms[func] = form
        else:
            missing.append(f"{label}.{name}")
    if missing:
        log.debug("OpGuard leaves out the op forms this torch %s lacks: %s", torch.__version__, ", ".join(missing))
    return forms


FORMS: dict[Callable[..., Any], Form] = _build_forms(nn_bindings())
"""Every guarded function object of this torch, to its form."""
