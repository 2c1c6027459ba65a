"""Refuse the op calls that would trip a device-side assert, without a host sync.

A handful of ops check their inputs inside the kernel: ``binary_cross_entropy`` wants
probabilities in ``[0, 1]``, the class-index losses want targets in ``[0, C)``, the
embedding and indexing ops want indices in range, ``multinomial`` wants a valid
distribution. On CUDA a violation is a device-side assert that kills the process (and the
CUDA context with it); on CPU it is a ``RuntimeError`` or ``IndexError``.

:class:`OpGuard` sees these calls before their kernel runs: while it is entered, only the
guarded functions are wrapped in their namespaces (``patch``), so no other op pays for it.
For each checked tensor it computes, on the op's device, a 0-d boolean flag that says
whether the rule was broken, and (with ``sanitize=True``) replaces the offending values
with :func:`torch.where` so the kernel neither asserts nor raises.
Nothing here reads a tensor value on the host: the caller packs every flag with
:meth:`OpGuard.flags` into the step's single read, and only after a hit calls
:func:`describe` (which does sync) for the details.

The package is split by concern:

- ``rules``: the rule of each op as data (which argument, bounds, fill value) and the
  elementwise violation mask;
- ``signatures``: the table of function objects that spell each op (``F.*``, ``torch.*``,
  ``Tensor.*``, ``torch._C._nn.*``); a name this torch lacks is left out, never an import error;
- ``mode``: :class:`OpGuard`, :class:`OpRecord` and :func:`describe`;
- ``patch``: the per-thread, counted wrapping of the guarded functions while a guard is entered or held.

The advice shown for each op lives outside ``core``, in ``lightning_numguard.reporting.hints``.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> guard = OpGuard()
    >>> with guard:
    ...     loss = F.binary_cross_entropy(torch.tensor([0.3, 2.0]), torch.tensor([0.0, 1.0]))
    >>> guard.flags(torch.device("cpu"))
    tensor([1., 0.])
    >>> describe(guard.records[0])["count"]
    1
"""

from __future__ import annotations

from lightning_numguard.detect.opguard.mode import OpGuard, OpRecord, describe
from lightning_numguard.detect.opguard.rules import GUARDED_OPS

__all__ = ["GUARDED_OPS", "OpGuard", "OpRecord", "describe"]
