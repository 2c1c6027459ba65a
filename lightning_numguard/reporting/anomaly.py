"""What an autograd anomaly-mode log says about where the NaN was made, read as the guard would record it.

Anomaly mode (``torch.autograd.detect_anomaly``, ``Trainer(detect_anomaly=True)``) stops at the first backward node
whose output holds NaN ("Function 'LogSoftmaxBackward0' returned nan values in its 0th output") and, just before
it, warns "Error detected in LogSoftmaxBackward0. Traceback of forward call that caused the error:" with the
forward call that created that node. :class:`ForwardTraces` reads those tracebacks from a log, line by line, and
names the user's frame of each call as the guard's own rule does (:func:`is_library_path`: not torch, not
Lightning, not the stdlib; an installed model library's line is the model's code). :func:`read_node` says which
node made the value, and :func:`guard_reading` what ``NumGuardCallback`` records for the same fault:

- a node whose backward is non-finite where its forward value is finite (``SqrtBackward0`` at 0, ``x ** p`` with
  ``p < 1`` at 0, ``acos`` at 1): ``nonfinite_grad``, that node, at the forward call's line;
- a node that only turns an Inf it receives into NaN: anomaly mode checks for NaN only, so it names the node after
  the one that made the Inf. ``(a - b).pow(2).sum(-1).sqrt()`` at ``a == b``: ``SqrtBackward0`` makes Inf (a
  finite value, an infinite gradient), and ``PowBackward0`` turns it into NaN (``2 * x * inf`` at ``x = 0``), so the
  log names ``PowBackward0``. With an exponent of 1 or more, ``pow``'s backward cannot make NaN from finite
  gradients: the maker is the one call on the same line whose gradient is infinite at the edge of its domain (the
  guard records that node, ``SqrtBackward0``), or, when the line holds none or several, the log cannot tell;
- any other node (``LogSoftmaxBackward0``, ``MseLossBackward0``, ``AddmmBackward0``, ``MulBackward0``, ...): its
  backward only turns NaN because the values it saved in the forward pass were NaN already. That is a forward
  fault, which the guard records as ``nonfinite_loss`` (a loss function's call) or ``nonfinite_output`` at the op
  that first wrote the NaN: this call, or one upstream of it (anomaly mode names the first node the backward
  pass reaches, next to the loss, not the op that made the value).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "BACKWARD_ONLY",
    "ForwardCall",
    "ForwardTraces",
    "NodeReading",
    "backward_only",
    "guard_reading",
    "is_library_path",
    "read_node",
]

#: Nodes whose backward goes non-finite at a finite forward value (the name without its trailing digit).
BACKWARD_ONLY = frozenset(
    {
        "SqrtBackward",
        "RsqrtBackward",
        "PowBackward",
        "NormBackward",
        "LinalgVectorNormBackward",
        "StdBackward",
        "VarBackward",
        "AcosBackward",
        "AsinBackward",
        "AtanhBackward",
        "CdistBackward",
    }
)
#: Forward functions whose output is the loss.
_LOSSES = re.compile(r"(?:^|_)(?:loss|cross_entropy|nll_loss|mse_loss|l1_loss|binary_cross_entropy\w*|kl_div)$")
_FILE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')
_FUNCTIONAL = re.compile(r"[\\/]torch[\\/](?:nn[\\/])?functional\.py$")
_START = re.compile(r"Error detected in (?P<node>\w+)\. Traceback of forward call that caused the error:")
#: Packages whose frames are not the user's (as the guard's own ``diagnose/usercode`` rule).
_LIBRARIES = frozenset(
    {
        "torch",
        "pytorch_lightning",
        "lightning",
        "lightning_fabric",
        "lightning_utilities",
        "torchmetrics",
        "lightning_numguard",
        "jsonargparse",
        "tqdm",
        "rich",
        "typing_extensions.py",
    }
)
#: Of those, the ones whose folder name alone gives a source checkout or a path printed relative to site-packages
#: away (``torch/nn/functional.py``); ``lightning`` only as ``lightning/pytorch`` or ``lightning/fabric``.
_TREES = frozenset({"torch", "pytorch_lightning", "lightning_fabric", "lightning_numguard", "torchmetrics"})
#: Folders of a repository checkout, never of an installed package: a repository named like one holds the user's code.
_REPOSITORY = frozenset({"tests", "test", "examples", "benchmarks", "docs", "scripts", "notebooks"})
_INSTALLED = frozenset({"site-packages", "dist-packages"})
#: The standard library: ``lib/python3.11/`` (POSIX), ``Python311/Lib/`` and an environment's ``Lib/`` (Windows).
_STDLIB = re.compile(r"[\\/](?:[lL]ib[\\/]python\d+(?:\.\d+)?|[pP]ython\d+[\\/][lL]ib|Lib)[\\/]")


def is_library_path(path: str) -> bool:
    """Whether a traceback's file is torch's, Lightning's, this package's or the stdlib's, read from the path alone
    (the log may come from another machine, with its own separators, or with paths printed relative to a folder).

    Any other installed package (``transformers``) is the user's model code, as for the guard's ``source``.

    Example:
        >>> [is_library_path(p) for p in ("torch/nn/functional.py", "/srv/model.py", "/usr/lib/python3.11/runpy.py")]
        [True, False, True]
    """
    if path.startswith("<"):
        return True
    parts = [part for part in re.split(r"[\\/]+", path) if part]
    for i, part in enumerate(parts[:-1]):
        if part in _INSTALLED:
            return parts[i + 1] in _LIBRARIES
    for i, part in enumerate(parts[:-1]):
        inside = parts[i + 1] if i + 1 < len(parts) - 1 else ""
        if inside in _REPOSITORY:
            continue
        if part in _TREES or (part == "lightning" and inside in ("pytorch", "fabric")):
            return True
    return _STDLIB.search(path) is not None


@dataclass(frozen=True)
class ForwardCall:
    """The forward call behind an anomaly-mode node.

    Attributes:
        node: the backward node (``LogSoftmaxBackward0``).
        file, line, code: the user's frame of the call: the innermost frame outside torch, Lightning and the stdlib.
        op: the forward function: the innermost frame's function when it is torch's functional API
            (``cross_entropy`` for ``F.cross_entropy`` or ``nn.CrossEntropyLoss``), else the node's name in snake
            case without ``Backward`` (``mul`` for ``x * y``, ``addmm`` for a ``Linear``, ``sqrt``).
    """

    node: str
    file: str
    line: int
    code: str
    op: str


def _op_of(node: str) -> str:
    name = re.sub(r"Backward\d*$", "", node)
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class ForwardTraces:
    """Reads anomaly mode's "Traceback of forward call" blocks from a log fed one line at a time."""

    def __init__(self) -> None:
        self.calls: list[ForwardCall] = []
        self._node: str | None = None
        self._frames: list[list[str]] = []  # [file, line, func, code]

    def feed(self, line: str) -> None:
        start = _START.search(line)
        if start:
            self._finish()
            self._node, self._frames = start.group("node"), []
            return
        if self._node is None:
            return
        frame = _FILE.match(line)
        if frame:
            self._frames.append([frame.group("file"), frame.group("line"), frame.group("func"), ""])
        elif self._frames and line.startswith("    ") and not self._frames[-1][3]:
            self._frames[-1][3] = line.strip()
        elif not line.startswith("  "):  # "(Triggered internally at ...)", the exception: the block is over
            self._finish()

    def _finish(self) -> None:
        if self._node is not None and self._frames:
            user = [i for i, f in enumerate(self._frames) if not is_library_path(f[0])]
            if user:
                deepest = self._frames[-1]
                functional = _FUNCTIONAL.search(deepest[0]) is not None  # F.cross_entropy, torch.norm, ...
                op = deepest[2] if functional else _op_of(self._node)
                file, line, _, code = self._frames[user[-1]]
                self.calls.append(ForwardCall(self._node, file, int(line), code, op))
        self._node, self._frames = None, []

    def last(self, node: str | None) -> ForwardCall | None:
        """The last forward call read for ``node`` (any node when ``None``)."""
        self._finish()
        found = [c for c in self.calls if node is None or c.node == node]
        return found[-1] if found else None


def backward_only(node: str) -> bool:
    """Whether ``node``'s backward goes non-finite at a finite forward value (``SqrtBackward0``, not
    ``MulBackward0``)."""
    return re.sub(r"\d+$", "", node) in BACKWARD_ONLY


#: Calls whose backward makes ±Inf from a finite gradient at the edge of their domain (a finite value there), by how
#: code spells them, and the node each creates.
_EDGE_CALLS = re.compile(r"\b(sqrt|rsqrt|acos|arccos|asin|arcsin|atanh|arctanh)\s*\(")
_EDGE_NODES = {
    "sqrt": "SqrtBackward0",
    "rsqrt": "RsqrtBackward0",
    **dict.fromkeys(("acos", "arccos"), "AcosBackward0"),
    **dict.fromkeys(("asin", "arcsin"), "AsinBackward0"),
    **dict.fromkeys(("atanh", "arctanh"), "AtanhBackward0"),
}
#: The exponents a line raises to: ``.pow(2)``, ``torch.pow(x, 2)``, ``x ** 2``, ``.square()``.
_EXPONENT = re.compile(
    r"\.pow\(\s*(?P<method>[-+]?[\d.]+)\s*\)|\bpow\([^(),]+,\s*(?P<call>[-+]?[\d.]+)\s*\)"
    r"|\*\*\s*\(?\s*(?P<op>[-+]?[\d.]+)|(?P<square>\.square\(\))"
)


def _exponents(code: str) -> list[float] | None:
    """The literal exponents of every power on ``code``; ``None`` when a power's exponent is not a literal."""
    found: list[float] = []
    for match in _EXPONENT.finditer(code):
        text = "2" if match.group("square") else next(g for g in match.group("method", "call", "op") if g)
        try:
            found.append(float(text))
        except ValueError:
            return None
    powers = len(re.findall(r"\.pow\(|\bpow\(|\*\*|\.square\(\)", code))
    return found if len(found) == powers else None


@dataclass(frozen=True)
class NodeReading:
    """Which backward node made the non-finite value anomaly mode caught at ``node``.

    Attributes:
        node: the node anomaly mode named (``PowBackward0``).
        maker: the node that made the value: ``node`` itself, or the one after it in the forward pass on the same
            line whose ±Inf it turned into NaN (``SqrtBackward0``); ``None`` when the log cannot tell, or for a
            forward fault.
        relayed: ``node``'s backward cannot make NaN from finite gradients (``x ** 2``): it only passed on, as NaN,
            an Inf made after it in the forward pass.
        edge_calls: the calls on the forward line whose gradient is infinite at the edge of their domain, as nodes
            (``SqrtBackward0`` for ``.sqrt()``, ``PowBackward0`` for ``** 0.5``).
    """

    node: str
    maker: str | None
    relayed: bool
    edge_calls: tuple[str, ...] = ()


def read_node(node: str, call: ForwardCall | None) -> NodeReading:
    """What anomaly mode's ``node`` and its forward call say about the node that made the value.

    Anomaly mode checks a node's outputs for NaN only: ``sqrt``'s backward at 0 returns Inf, and the node after it
    in the backward (``pow(x, 2)``'s, ``2 * x * inf`` at ``x = 0``) is the one that returns NaN and is named.

    Example:
        >>> call = ForwardCall("PowBackward0", "model.py", 9, "d = (a - b).pow(2).sum(-1).sqrt()", "pow")
        >>> read_node("PowBackward0", call).maker
        'SqrtBackward0'
    """
    code = call.code if call is not None else ""
    edges = tuple(dict.fromkeys(_EDGE_NODES[name] for name in _EDGE_CALLS.findall(code)))
    exponents = _exponents(code) if code else None
    whole = exponents is not None and all(p >= 1 and p == int(p) for p in exponents)  # x ** 2: 2 * x * g is finite
    base = re.sub(r"\d+$", "", node)
    if base == "PowBackward":
        if exponents and whole:
            return NodeReading(node, edges[0] if len(edges) == 1 else None, True, edges)
        return NodeReading(node, node, False, edges)
    if exponents and not whole:  # x ** 0.5 on the line: infinite gradient at 0
        edges += ("PowBackward0",)
    if base in BACKWARD_ONLY:
        return NodeReading(node, node, False, edges)
    return NodeReading(node, None, False, edges)


def guard_reading(node: str, call: ForwardCall | None) -> tuple[str, str]:
    """``(kind, sentence)``: what ``NumGuardCallback`` records for the fault behind anomaly mode's ``node``."""
    backward = backward_only(node)
    if call is None:
        likely = f" (likely here: {node}'s gradient is infinite where its forward value is finite)" if backward else ""
        return (
            "nonfinite_grad" if backward else "nonfinite_output",
            "This log holds no forward traceback (anomaly mode warns it on stderr, just above the error). Run the "
            "same script with NumGuardCallback() in its callbacks, without detect_anomaly: its root-cause event "
            "names the op, module and file:line: nonfinite_output or nonfinite_loss at the op that first made the "
            f"NaN in the forward pass, or nonfinite_grad {node} only when every forward value was finite{likely}.",
        )
    at = f"{call.file}:{call.line}" + (f" (`{call.code}`)" if call.code else "")
    reading = read_node(node, call)
    checks_nan = (
        "anomaly mode checks for NaN only, so it names the node after the one that made an Inf, the first whose "
        "output is NaN"
    )
    if reading.relayed and reading.maker is not None:
        op = _op_of(reading.maker)
        return (
            "nonfinite_grad",
            f"NumGuardCallback records this as nonfinite_grad, op {reading.maker}, at {at}: {op}'s value there is "
            f"finite but its gradient is not (when every forward value of the step was finite). {node}'s backward "
            f"cannot make NaN from finite gradients (its exponent is 1 or more); it turned the Inf that "
            f"{reading.maker} made into NaN (0 * Inf): {checks_nan}.",
        )
    if reading.relayed:
        edges = ", ".join(reading.edge_calls)
        which = f" ({edges} on this line: the log cannot tell which)" if edges else ""
        return (
            "nonfinite_grad",
            f"{node} at {at} cannot make NaN from finite gradients (its exponent is 1 or more): it turned into NaN "
            f"an Inf made by an op after it in the forward pass{which}, most often a sqrt, rsqrt or acos at the edge "
            f"of its domain; {checks_nan}, and this log cannot tell which node made it. NumGuardCallback records "
            "it as nonfinite_grad at that node (the first whose gradient went non-finite from finite ones), at its "
            "own line.",
        )
    if backward:
        return (
            "nonfinite_grad",
            f"NumGuardCallback records this as nonfinite_grad, op {node}, at {at}: {call.op}'s value there is "
            "finite but its gradient is not (when every forward value of the step was finite).",
        )
    kind = "nonfinite_loss" if _LOSSES.search(call.op) else "nonfinite_output"
    sentence = (
        f"NumGuardCallback records this as a forward fault, {kind}, at the op that first wrote the NaN: op "
        f"`{call.op}` at {at}, or an op upstream of it. {node}'s backward turns NaN only because the values it "
        "saved in the forward pass were NaN already; anomaly mode stops at the first node the backward pass "
        "reaches, next to the loss, not at the op that made the value."
    )
    if reading.edge_calls:
        edge = reading.edge_calls[0]
        sentence += (
            f" Unless this line's {_op_of(edge)} ran after it: its backward makes Inf at the edge of its domain, "
            f"which {node} would turn into NaN ({checks_nan}); the log cannot tell these apart, and the guard then "
            f"records nonfinite_grad {edge}."
        )
    return kind, sentence
