"""Refuse the op calls that would trip a device-side assert, without a host sync.

A handful of ops check their inputs inside the kernel: ``binary_cross_entropy`` wants
probabilities in ``[0, 1]``, the class-index losses want targets in ``[0, C)``, the
embedding and indexing ops want indices in range, ``multinomial`` wants a valid
distribution. On CUDA a violation is a device-side assert that kills the process (and the
CUDA context with it); on CPU it is a ``RuntimeError`` or ``IndexError``.

:class:`OpGuard` is a :class:`~torch.overrides.TorchFunctionMode` that sees these calls
before their kernel runs. For each checked tensor it computes, on the op's device, a 0-d
boolean flag that says whether the rule was broken, and (with ``sanitize=True``) replaces
the offending values with :func:`torch.where` so the kernel neither asserts nor raises.
Nothing here reads a tensor value on the host: the caller packs every flag with
:meth:`OpGuard.flags` into the step's single read, and only after a hit calls
:meth:`OpGuard.describe` (which does sync) for the details.

Example:
    >>> import torch.nn.functional as F
    >>> guard = OpGuard()
    >>> with guard:
    ...     loss = F.binary_cross_entropy(torch.tensor([0.3, 2.0]), torch.tensor([0.0, 1.0]))
    >>> guard.flags(torch.device("cpu"))
    tensor([1., 0.])
    >>> OpGuard.describe(guard.records[0])["count"]
    1
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["GUARDED_OPS", "HINTS", "OpGuard", "OpRecord"]

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

_INDEX_HINT = (
    "an index is negative or not smaller than the size of the indexed dimension: check the `dim` "
    "argument and how the index was computed (these ops do not wrap negative indices)"
)
_CLASS_HINT = (
    "a target class index is negative or not smaller than the number of classes C = input.size(1): "
    "make the output layer as wide as the label range (labels starting at 1, an extra background "
    "class) and mark padding with ignore_index (default -100)"
)
_EMBEDDING_HINT = (
    "a token id is negative or not smaller than num_embeddings: make the vocabulary size match the "
    "tokenizer (added special tokens, the padding id) or clamp out-of-vocabulary ids to an UNK id"
)

HINTS: dict[str, str] = {
    "binary_cross_entropy": (
        "use BCEWithLogitsLoss (it applies the sigmoid itself and is safe under autocast); "
        "or the input is already NaN/Inf upstream"
    ),
    "nll_loss": _CLASS_HINT,
    "cross_entropy": _CLASS_HINT,
    "embedding": _EMBEDDING_HINT,
    "embedding_bag": _EMBEDDING_HINT,
    "gather": _INDEX_HINT,
    "scatter": _INDEX_HINT,
    "scatter_add": _INDEX_HINT,
    "index_select": _INDEX_HINT,
    "one_hot": (
        "a label is negative or not smaller than num_classes: pass a num_classes that covers the label "
        "range and map ignore/padding labels (-100, -1) to a valid class before one_hot"
    ),
    "multinomial": (
        "the probabilities hold NaN/Inf or negative values, or a row is all zeros: sample from "
        "softmax(logits) (never negative), look for NaN upstream, and never mask out a whole row"
    ),
}


@dataclass
class OpRecord:
    """One checked tensor of one guarded op call.

    ``binary_cross_entropy`` checks two tensors (input and target) and so leaves two records
    per call; every other op leaves one. Calls with nothing to check (``cross_entropy``
    with probability targets, indices of a floating dtype that the op will reject itself)
    leave none.

    Attributes:
        op: Canonical op name from :data:`GUARDED_OPS` (``"scatter"`` also for ``Tensor.scatter_``).
        module: :attr:`OpGuard.current_module` at call time, else ``None``.
        flag: 0-d bool tensor on the op's device, ``True`` when the rule was broken.
        checked: Detached reference to the tensor that was checked, as it was before sanitising.
            It aliases the caller's tensor: modifying that tensor in place changes what
            :meth:`OpGuard.describe` reports.
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


class _Call:
    """The arguments of one call, readable and replaceable by canonical parameter name."""

    __slots__ = ("args", "form", "kwargs")

    def __init__(self, form: _Form, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.form = form
        self.args = list(args)
        self.kwargs = dict(kwargs)

    def get(self, name: str, default: Any = None) -> Any:
        position = self.form.positions.get(name)
        if position is not None and position < len(self.args):
            return self.args[position]
        for keyword in self.form.keywords.get(name, ()):
            if keyword in self.kwargs:
                return self.kwargs[keyword]
        return default

    def set(self, name: str, value: Any) -> None:
        position = self.form.positions.get(name)
        if position is not None and position < len(self.args):
            self.args[position] = value
            return
        for keyword in self.form.keywords.get(name, ()):
            if keyword in self.kwargs:
                self.kwargs[keyword] = value
                return


_Check = Callable[["OpGuard", str, _Call], None]


@dataclass(frozen=True)
class _Form:
    """How one function object spells one guarded op: its parameters and its check."""

    op: str
    check: _Check
    positions: dict[str, int]
    keywords: dict[str, tuple[str, ...]]


class OpGuard(TorchFunctionMode):
    """Flag, and by default defuse, op calls whose inputs would trip a device-side assert.

    While the mode is active (the callback enters it around the training forward pass),
    each call of a guarded op is checked before its kernel runs. The check is a few
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
    ``torch._C._nn`` loss bindings. Ops called *inside* a guarded function (the
    ``nll_loss`` inside ``cross_entropy``) are not seen again.

    Sanitising uses :func:`torch.where`, so gradients keep flowing to the valid elements
    (a replaced element gets a zero gradient). It runs on every guarded call, hit or not,
    because deciding would need a sync. When every class target of a mean-reduced loss
    is replaced by ``ignore_index`` the loss is NaN (0/0); that is expected, since the
    caller skips the step once it reads the flag.

    Args:
        ops: Names from :data:`GUARDED_OPS` to guard; ``None`` guards all of them. A single
            string is taken as one name.
        sanitize: Replace bad values on the device so the op runs; with ``False`` the flag is
            still recorded but the op then asserts (CUDA) or raises (CPU) as it would unguarded.

    Raises:
        ValueError: ``ops`` names an op that is not in :data:`GUARDED_OPS`.

    Attributes:
        current_module: Qualified name of the module running now, set by the caller (forward
            pre-hooks) and copied into each :class:`OpRecord`.
        module_resolver: When set, called at each guarded call (not at other ops) instead of
            reading ``current_module``: lets the caller find the module without a hook on
            every module's forward.
        records: One :class:`OpRecord` per checked tensor since the last :meth:`reset`, in call order.
        enabled: With ``False`` every call passes through untouched; toggle it instead of
            entering and exiting the mode.

    Example:
        >>> guard = OpGuard(ops=["cross_entropy"])
        >>> guard.current_module = "head"
        >>> with guard:
        ...     loss = F.cross_entropy(torch.zeros(2, 10), torch.tensor([3, 10]))
        >>> bool(guard.flags(torch.device("cpu")).any())
        True
        >>> info = OpGuard.describe(guard.records[0])
        >>> info["module"], info["count"], info["first_indices"]
        ('head', 1, [[1]])
    """

    def __init__(self, ops: Iterable[str] | None = None, sanitize: bool = True) -> None:
        super().__init__()
        if ops is None:
            selected = set(GUARDED_OPS)
        else:
            selected = {ops} if isinstance(ops, str) else set(ops)
            unknown = sorted(str(op) for op in selected - GUARDED_OPS)
            if unknown:
                raise ValueError(f"OpGuard(ops=...) got unknown op name(s) {unknown}; allowed: {sorted(GUARDED_OPS)}")
        self.sanitize = sanitize
        self.current_module: str | None = None
        self.module_resolver: Callable[[], str | None] | None = None
        self.records: list[OpRecord] = []
        self.enabled = True
        self._forms = {func: form for func, form in _FORMS.items() if form.op in selected}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Run ``func``; check (and maybe sanitise) its inputs first when it is a guarded op."""
        form = self._forms.get(func)
        if form is None or not self.enabled:
            return func(*args, **(kwargs or {}))
        call = _Call(form, args, kwargs or {})
        form.check(self, form.op, call)
        return func(*call.args, **call.kwargs)

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

    @staticmethod
    def describe(record: OpRecord) -> dict[str, object]:
        """Details of a violation, for messages; reads values on the host (syncs).

        ``count`` is the number of offending elements (for ``multinomial``: entries that
        are non-finite or negative, and every entry of a row without a positive entry).
        ``min``/``max`` are the smallest and largest offending values, NaN left out (``None``
        when there are none); ``nan_count`` says how many were NaN. ``first_indices`` holds
        up to five multi-indices of offending elements into ``record.checked``.
        """
        checked = record.checked
        integral = not (checked.is_floating_point() or checked.is_complex())
        low = 0.0 if record.low is None else record.low
        low = int(low) if integral else low
        high = None if record.high is None else (int(record.high) if integral else record.high)
        mask = _violations(record.op, checked, low, high, record.ignore_index)
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
            "hint": HINTS[record.op],
        }

    def _check(
        self,
        op: str,
        call: _Call,
        name: str,
        rule: str,
        low: float,
        high: float | None,
        fill: float,
        ignore_index: int | None = None,
    ) -> None:
        """Record whether ``call``'s argument ``name`` breaks the rule; replace bad values by ``fill``."""
        tensor: torch.Tensor = call.get(name)
        bad = _violations(op, tensor, low, high, ignore_index)
        self._record(op, tensor, bad.any(), rule, low, high, ignore_index)
        if self.sanitize:
            call.set(name, torch.where(bad, fill, tensor))

    def _record(
        self,
        op: str,
        tensor: torch.Tensor,
        flag: torch.Tensor,
        rule: str,
        low: float | None,
        high: float | None,
        ignore_index: int | None = None,
    ) -> None:
        self.records.append(
            OpRecord(
                op=op,
                module=self.current_module if self.module_resolver is None else self.module_resolver(),
                flag=flag,
                checked=tensor.detach(),
                rule=rule,
                low=None if low is None else float(low),
                high=None if high is None else float(high),
                ignore_index=ignore_index,
            )
        )


def _violations(op: str, x: torch.Tensor, low: float, high: float | None, ignore_index: int | None) -> torch.Tensor:
    """Elementwise bool mask of the values of ``x`` that break ``op``'s rule; no sync.

    A range test is ``clamp(x, low, top) != x``: two kernels, and NaN (which survives the
    clamp and differs from itself) fails it. Integer tensors must get integer bounds:
    comparing int64 with a Python float promotes to float32 and misjudges indices past 2**24.
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


def _is_index(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())


def _check_probabilities(guard: OpGuard, op: str, call: _Call) -> None:
    for name in ("input", "target"):
        tensor = call.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            guard._check(op, call, name, f"{name} in [0, 1]", 0.0, 1.0, 0.5)


def _check_class_targets(guard: OpGuard, op: str, call: _Call) -> None:
    logits, target = call.get("input"), call.get("target")
    if not (isinstance(logits, torch.Tensor) and logits.dim() > 0 and _is_index(target)):
        return  # probability targets, or a call the op rejects by itself
    classes = logits.size(1) if logits.dim() > 1 else logits.size(0)
    ignore_index = call.get("ignore_index", -100)
    if not isinstance(ignore_index, int):
        return
    rule = f"target in [0, {classes}) or == ignore_index ({ignore_index})"
    guard._check(op, call, "target", rule, 0, classes, ignore_index, ignore_index)


def _check_embedding(guard: OpGuard, op: str, call: _Call) -> None:
    index_name, weight_name = "input", "weight"
    indices, weight = call.get(index_name), call.get(weight_name)
    if op == "embedding_bag" and _is_index(weight) and isinstance(indices, torch.Tensor):
        # F.embedding_bag still accepts the legacy (weight, input) order and swaps them itself.
        index_name, weight_name, indices, weight = weight_name, index_name, weight, indices
    if not (_is_index(indices) and isinstance(weight, torch.Tensor) and weight.dim() > 0):
        return
    rows = weight.size(0)
    padding_idx = call.get("padding_idx")
    if isinstance(padding_idx, int) and padding_idx < 0:
        padding_idx += rows  # the functional forms count a negative padding_idx from the end
    elif padding_idx is None:
        padding_idx = call.get("raw_padding_idx")  # raw torch.embedding*: negative means none
    fill = padding_idx if isinstance(padding_idx, int) and 0 <= padding_idx < rows else 0
    guard._check(op, call, index_name, f"index in [0, {rows})", 0, rows, fill)


def _check_dim_index(guard: OpGuard, op: str, call: _Call) -> None:
    source, dim, index = call.get("input"), call.get("dim"), call.get("index")
    if not (isinstance(source, torch.Tensor) and _is_index(index) and isinstance(dim, int)):
        return
    try:
        size = source.size(dim) if source.dim() > 0 else 1
    except (IndexError, RuntimeError):
        return  # a bad dim: let the op raise its own error
    guard._check(op, call, "index", f"index in [0, {size}) along dim {dim}", 0, size, 0)


def _check_one_hot(guard: OpGuard, op: str, call: _Call) -> None:
    labels, num_classes = call.get("input"), call.get("num_classes", -1)
    if not (_is_index(labels) and isinstance(num_classes, int)):
        return
    if num_classes < 0:
        guard._check(op, call, "input", "value >= 0 (num_classes inferred)", 0, None, 0)
    else:
        guard._check(op, call, "input", f"value in [0, {num_classes})", 0, num_classes, 0)


def _check_distribution(guard: OpGuard, op: str, call: _Call) -> None:
    probs = call.get("input")
    if not (isinstance(probs, torch.Tensor) and probs.is_floating_point() and probs.dim() in (1, 2)):
        return
    bad_rows = _violations(op, probs, 0.0, None, None).any(-1)
    rule = "probabilities finite and >= 0, each row sum > 0"
    guard._record(op, probs, bad_rows.any(), rule, 0.0, None)
    if guard.sanitize:
        call.set("input", torch.where(bad_rows.unsqueeze(-1), 1.0, probs))


def _form(op: str, check: _Check, params: Sequence[str], aliases: Mapping[str, str] | None = None) -> _Form:
    """A form whose positional parameters are ``params`` (canonical names), plus keyword aliases."""
    keywords: dict[str, tuple[str, ...]] = {name: (name,) for name in params}
    for keyword, name in (aliases or {}).items():
        keywords[name] = (*keywords.get(name, ()), keyword)
    return _Form(op, check, {name: i for i, name in enumerate(params)}, keywords)


def _build_forms() -> dict[Callable[..., Any], _Form]:
    nn: Any = torch._C._nn  # the stubs lack some of these bindings
    self_alias = {"self": "input"}
    bce = ("input", "target", "weight")
    loss = ("input", "target", "weight", "size_average", "ignore_index")  # F.* and its reduce/reduction tail
    raw_loss = ("input", "target", "weight", "reduction", "ignore_index")  # torch._C._nn.*
    dim_index = ("input", "dim", "index")
    forms: dict[Callable[..., Any], _Form] = {
        F.binary_cross_entropy: _form("binary_cross_entropy", _check_probabilities, bce),
        nn.binary_cross_entropy: _form("binary_cross_entropy", _check_probabilities, bce, self_alias),
        F.nll_loss: _form("nll_loss", _check_class_targets, loss),
        nn.nll_loss: _form("nll_loss", _check_class_targets, raw_loss, self_alias),
        nn.nll_loss_nd: _form("nll_loss", _check_class_targets, raw_loss, self_alias),
        nn.nll_loss2d: _form("nll_loss", _check_class_targets, raw_loss, self_alias),
        F.cross_entropy: _form("cross_entropy", _check_class_targets, loss),
        nn.cross_entropy_loss: _form("cross_entropy", _check_class_targets, raw_loss, self_alias),
        F.embedding: _form("embedding", _check_embedding, ("input", "weight", "padding_idx")),
        torch.embedding: _form(
            "embedding", _check_embedding, ("weight", "input", "raw_padding_idx"), {"indices": "input"}
        ),
        F.embedding_bag: _form(
            "embedding_bag",
            _check_embedding,
            (
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
            ),
        ),
        torch.embedding_bag: _form(
            "embedding_bag",
            _check_embedding,
            (
                "weight",
                "input",
                "offsets",
                "scale_grad_by_freq",
                "mode",
                "sparse",
                "per_sample_weights",
                "include_last_offset",
                "raw_padding_idx",
            ),
            {"indices": "input", "padding_idx": "raw_padding_idx"},
        ),
        F.one_hot: _form("one_hot", _check_one_hot, ("input", "num_classes")),
        torch.multinomial: _form("multinomial", _check_distribution, ("input", "num_samples")),
        torch.Tensor.multinomial: _form("multinomial", _check_distribution, ("input", "num_samples")),
    }
    for op, funcs in {
        "gather": (torch.gather, torch.Tensor.gather),
        "scatter": (torch.scatter, torch.Tensor.scatter, torch.Tensor.scatter_),
        "scatter_add": (torch.scatter_add, torch.Tensor.scatter_add, torch.Tensor.scatter_add_),
        "index_select": (torch.index_select, torch.Tensor.index_select),
    }.items():
        for func in funcs:
            forms[func] = _form(op, _check_dim_index, dim_index, self_alias)
    return forms


_FORMS: dict[Callable[..., Any], _Form] = _build_forms()
