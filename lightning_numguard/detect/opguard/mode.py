"""The :class:`OpGuard` mode: intercepts the guarded calls, records a flag, defuses the values."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_numguard.detect.opguard import patch, signatures
from lightning_numguard.detect.opguard.rules import GUARDED_OPS, ArgRule, fill_mask, violations

__all__ = ["OpGuard", "OpRecord", "describe"]

#: Functions that write into an argument: their kernel may write part of it before it raises.
_IN_PLACE = frozenset(func for func in signatures.FORMS if getattr(func, "__name__", "").endswith("_"))


def _on_cpu(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the call's first tensor argument lives on the CPU (an op's tensors share its device)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.is_cpu
    return False


@dataclass
class OpRecord:
    """One checked tensor of one guarded op call.

    ``binary_cross_entropy`` checks two tensors (input and target) and so leaves two records
    per call; every other op leaves one. Calls with nothing to check (``cross_entropy``
    with probability targets, indices of a floating dtype that the op will reject itself)
    leave none.

    Attributes:
        op: Canonical op name from :data:`GUARDED_OPS` (``"scatter"`` also for ``Tensor.scatter_``).
        module: What :attr:`OpGuard.module_resolver` returned at call time; ``None`` without one.
        flag: 0-d bool tensor on the op's device, ``True`` when the rule was broken.
        checked: Detached reference to the tensor that was checked, as it was before sanitising.
            It aliases the caller's tensor: modifying that tensor in place changes what
            :func:`describe` reports.
        rule: The rule in words, e.g. ``"input in [0, 1]"``.
        low: Lower bound of the rule (inclusive).
        high: Upper bound of the rule (inclusive for ``binary_cross_entropy``, exclusive
            otherwise); ``None`` when unbounded.
        ignore_index: The value exempt from the bounds (``nll_loss``/``cross_entropy``), else ``None``.
    """

    op: str
    module: str | None
    flag: torch.Tensor
    checked: torch.Tensor
    rule: str
    low: float | None
    high: float | None
    ignore_index: int | None = None


def describe(record: OpRecord) -> dict[str, object]:
    """Details of a violation, as data for messages; reads values on the host (syncs).

    ``count`` is the number of offending elements (for ``multinomial``: entries that
    are non-finite or negative, and every entry of a row without a positive entry).
    ``min``/``max`` are the smallest and largest offending values, NaN left out (``None``
    when there are none); ``nan_count`` says how many were NaN. ``first_indices`` holds
    up to five multi-indices of offending elements into ``record.checked``. The advice for
    the op is not here: it is ``lightning_numguard.reporting.hints.OP_DOMAIN_HINTS[op]``.

    Returns:
        ``op``, ``module``, ``rule``, ``count``, ``nan_count``, ``min``, ``max`` and ``first_indices``.
    """
    checked = record.checked
    integral = not (checked.is_floating_point() or checked.is_complex())
    low = 0.0 if record.low is None else record.low
    low = int(low) if integral else low
    high = None if record.high is None else (int(record.high) if integral else record.high)
    mask = violations(record.op, checked, low, high, record.ignore_index)
    values = checked[mask]
    nans = values.isnan() if values.is_floating_point() else torch.zeros_like(values, dtype=torch.bool)
    numbers = values[~nans].double()
    return {
        "op": record.op,
        "module": record.module,
        "rule": record.rule,
        "count": int(mask.sum().item()),
        "nan_count": int(nans.sum().item()),
        "min": float(numbers.min().item()) if numbers.numel() else None,
        "max": float(numbers.max().item()) if numbers.numel() else None,
        "first_indices": mask.nonzero()[:5].tolist(),
    }


class OpGuard:
    """Flag, and by default defuse, op calls whose inputs would trip a device-side assert.

    While the guard is entered (the callback enters it around the training forward pass),
    each call of a guarded op is checked before its kernel runs. Only the guarded functions
    are intercepted (:mod:`~lightning_numguard.detect.opguard.patch` wraps them in their
    namespaces while a guard is entered, and only on the thread that entered it), so every
    other op runs untouched, at no cost. The check is a few
    elementwise comparisons and one ``any()`` on the op's device; nothing is read on the
    host. The rules, and what ``sanitize`` puts in place of a bad value:

    - ``binary_cross_entropy``: input and target in ``[0, 1]`` (NaN fails) → ``0.5``;
    - ``nll_loss``, ``cross_entropy``: an integer target in ``[0, C)`` or ``== ignore_index``
      → ``ignore_index`` (probability targets are not checked);
    - ``embedding``, ``embedding_bag``: index in ``[0, num_embeddings)`` → ``padding_idx``, else 0;
    - ``gather``, ``scatter``, ``scatter_add``, ``index_select``: index in ``[0, size)`` along
      ``dim`` (negative indices raise on CPU too) → 0;
    - ``one_hot``: value in ``[0, num_classes)``, or ``>= 0`` when it is inferred → 0;
    - ``multinomial``: entries finite and ``>= 0``, each row with a positive sum → a uniform row.

    Function forms covered: the ``torch.nn.functional`` functions (``nn.BCELoss`` and
    ``nn.CrossEntropyLoss`` arrive as those), the ``torch.*`` functions, the ``Tensor``
    methods including in-place ``scatter_``/``scatter_add_``, and the raw
    ``torch._C._nn`` loss bindings this torch has. Ops called *inside* a guarded function
    (the ``nll_loss`` inside ``cross_entropy``) are not seen again. Not seen: ops inside a
    ``torch.compile``d graph, ``torch.ops.aten.*`` calls, and a reference to a builtin
    (``torch.gather``, ``F.one_hot``, a ``Tensor`` method) taken *before* the guard was
    entered; a reference to a Python function such as ``F.cross_entropy`` taken early still
    reaches the raw binding it calls, which is guarded. Nested guards on one thread: the
    innermost enabled guard that guards the op records it.

    Sanitising uses :func:`torch.where`, so gradients keep flowing to the valid elements
    (a replaced element gets a zero gradient). On an accelerator it runs on every guarded call,
    hit or not, because deciding would need a sync.

    On the CPU the guarded kernels check every one of these rules themselves and raise a Python
    error, before any output exists (a CUDA kernel's device-side assert, by contrast, is fatal).
    With ``check_cpu_calls=False`` a CPU call therefore runs as it is first, with no check and no
    record: a clean call costs the wrapper only (``NumGuardCallback`` guards this way). When it
    raises, the call is checked, recorded and sanitised as on an accelerator and run again; an
    error that no rule explains is raised as it was. In-place forms (``Tensor.scatter_``/
    ``scatter_add_``) can write part of their output before the kernel raises, so they are
    always checked first. When every class target of a mean-reduced loss
    is replaced by ``ignore_index`` the loss is NaN (0/0); that is expected, since the
    caller skips the step once it reads the flag.

    Args:
        ops: Names from :data:`GUARDED_OPS` to guard; ``None`` guards all of them. A single
            string is taken as one name.
        sanitize: Replace bad values on the device so the op runs; with ``False`` the flag is
            still recorded but the op then asserts (CUDA) or raises (CPU) as it would unguarded.
        check_cpu_calls: Check CPU calls before they run, as on an accelerator (one record per
            checked tensor of every call); with ``False``, only after their kernel raised.

    Raises:
        ValueError: ``ops`` names an op that is not in :data:`GUARDED_OPS`.

    Attributes:
        module_resolver: Returns the qualified name of the module running now (or ``None``);
            called at each guarded call only (not at other ops), and its answer copied into
            each :class:`OpRecord`. ``None`` (the default) records ``module=None``.
        records: One :class:`OpRecord` per checked tensor since the last :meth:`reset`, in call order
            (on the CPU with ``check_cpu_calls=False``: of the calls whose kernel raised only).
        enabled: With ``False`` every call passes through untouched; toggle it instead of
            entering and exiting the mode.

    Example:
        >>> import torch.nn.functional as F
        >>> guard = OpGuard(ops=["cross_entropy"])
        >>> guard.module_resolver = lambda: "head"
        >>> with guard:
        ...     loss = F.cross_entropy(torch.zeros(2, 10), torch.tensor([3, 10]))
        >>> bool(guard.flags(torch.device("cpu")).any())
        True
        >>> info = OpGuard.describe(guard.records[0])
        >>> info["module"], info["count"], info["first_indices"]
        ('head', 1, [[1]])
    """

    describe = staticmethod(describe)

    def __init__(self, ops: Iterable[str] | None = None, sanitize: bool = True, check_cpu_calls: bool = True) -> None:
        super().__init__()
        if ops is None:
            selected = set(GUARDED_OPS)
        else:
            selected = {ops} if isinstance(ops, str) else set(ops)
            unknown = sorted(str(op) for op in selected - GUARDED_OPS)
            if unknown:
                raise ValueError(f"OpGuard(ops=...) got unknown op name(s) {unknown}; allowed: {sorted(GUARDED_OPS)}")
        self.sanitize = sanitize
        self.check_cpu_calls = check_cpu_calls
        self.module_resolver: Callable[[], str | None] | None = None
        self.records: list[OpRecord] = []
        self.enabled = True
        self.forms = {func: form for func, form in signatures.FORMS.items() if form.op in selected}
        self._entered: list[bool] = []  # per entry: whether it wrapped the functions itself
        self._held = False

    def __enter__(self) -> OpGuard:
        """Intercept the guarded functions on this thread until :meth:`__exit__`."""
        if self._held:  # the functions are wrapped already: only this thread's stack changes
            patch.active_guards().append(self)
        else:
            patch.install(self, self.forms)
        self._entered.append(not self._held)
        return self

    def __exit__(self, *exc: object) -> None:
        """Put the original functions back (exceptions pass through)."""
        if self._entered:
            patch.uninstall(self, self.forms if self._entered.pop() else ())

    def hold(self) -> None:
        """Keep the guarded functions intercepted until :meth:`release`, entered or not (idempotent).

        Entering and leaving a held guard only push and pop this thread's guard stack; without a
        hold they also replace and restore the functions (which costs the next forward pass a
        few hundred microseconds of attribute-cache misses on ``torch.Tensor``).
        """
        if not self._held:
            self._held = True
            patch.acquire(self.forms)

    def release(self) -> None:
        """Undo :meth:`hold` (idempotent): the originals come back once nothing else needs them."""
        if self._held:
            self._held = False
            patch.release(self.forms)

    def call(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run ``func``; check (and maybe sanitise) its inputs first when it is a guarded op."""
        form = self.forms.get(func)
        if form is None:
            return func(*args, **kwargs)
        if not self.check_cpu_calls and func not in _IN_PLACE and _on_cpu(args, kwargs):
            try:  # the CPU kernel checks its own inputs and raises before any output exists
                return self._run(func, args, kwargs)
            except (IndexError, RuntimeError, ValueError):
                first = len(self.records)
                call = self._checked(form, args, kwargs)
                if not any(bool(r.flag) for r in self.records[first:]):  # not ours: raise as it was
                    del self.records[first:]
                    raise
            return self._run(func, call.args, call.kwargs)
        call = self._checked(form, args, kwargs)
        return self._run(func, call.args, call.kwargs)

    def _run(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The guarded function itself (a seam: ``benchmarks.micro`` times the guard's own work without it)."""
        return func(*args, **kwargs)

    def _checked(self, form: signatures.Form, args: Sequence[Any], kwargs: Mapping[str, Any]) -> signatures.Call:
        """The call's arguments after every rule of ``form``: each checked and recorded, and maybe sanitised."""
        call = signatures.Call(form, args, kwargs)
        for rule in form.check(form.op, call):
            self._apply(form.op, call, rule)
        return call

    def reset(self) -> None:
        """Forget the records (a new list: a list taken from :attr:`records` earlier stays intact)."""
        self.records = []

    def flags(self, device: torch.device) -> torch.Tensor:
        """Every record's flag as one float32 vector on ``device``; 1.0 where the rule was broken.

        Does not sync when the flags already live on ``device`` (moving a flag across
        devices is a copy like any other).
        """
        if not self.records:
            return torch.zeros(0, dtype=torch.float32, device=device)
        return torch.stack([record.flag.to(device) for record in self.records]).to(torch.float32)

    def _apply(self, op: str, call: signatures.Call, rule: ArgRule) -> None:
        """Record whether ``call``'s argument ``rule.arg`` breaks the rule; replace bad values by ``rule.fill``."""
        tensor: torch.Tensor = call.get(rule.arg)
        bad = violations(op, tensor, rule.low, rule.high, rule.ignore_index)
        self.records.append(
            OpRecord(
                op=op,
                module=None if self.module_resolver is None else self.module_resolver(),
                flag=bad.any(),
                checked=tensor.detach(),
                rule=rule.rule,
                low=float(rule.low),
                high=None if rule.high is None else float(rule.high),
                ignore_index=rule.ignore_index,
            )
        )
        if self.sanitize:
            call.set(rule.arg, tensor.masked_fill(fill_mask(op, bad), rule.fill))  # one kernel (no scalar tensor)
