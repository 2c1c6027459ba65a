"""What an autograd anomaly-mode log says about where the NaN was made, read as the guard would record it.

Anomaly mode (``torch.autograd.detect_anomaly``, ``Trainer(detect_anomaly=True)``) stops at the first backward node
whose output holds NaN ("Function 'LogSoftmaxBackward0' returned nan values in its 0th output") and, just before
it, warns "Error detected in LogSoftmaxBackward0. Traceback of forward call that caused the error:" with the
forward call that created that node. :class:`ForwardTraces` reads those tracebacks from a log, line by line;
:func:`guard_reading` says what ``NumGuardCallback`` records for the same fault:

- a node whose backward is non-finite where its forward value is finite (``SqrtBackward0`` at 0, a norm of a zero
  vector, ``x ** p`` with ``p < 1`` at 0, ``acos`` at 1): ``nonfinite_grad``, that node, at the forward call's line;
- any other node (``LogSoftmaxBackward0``, ``MseLossBackward0``, ``AddmmBackward0``, ``MulBackward0``, ...): its
  backward only turns NaN because the values it saved in the forward pass were NaN already. That is a forward
  fault, which the guard records as ``nonfinite_loss`` (a loss function's call) or ``nonfinite_output`` at the op
  that first wrote the NaN: this call, or one upstream of it (anomaly mode names the first node the backward
  pass reaches, next to the loss, not the op that made the value).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BACKWARD_ONLY", "ForwardCall", "ForwardTraces", "backward_only", "guard_reading", "is_library_path"]

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
#: Installed packages whose frames are not the user's (as the guard's own ``usercode`` rule).
_LIBRARIES = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics", "lightning_numguard")
_INSTALLED = re.compile(r"[\\/](?:site|dist)-packages[\\/](?P<package>[^\\/]+)[\\/]")
_STDLIB = re.compile(r"[\\/]lib[\\/]python\d+(?:\.\d+)?[\\/][^\\/]+\.py$")


def is_library_path(path: str) -> bool:
    """Whether a traceback's file is torch's, Lightning's, this package's or the stdlib's, read from the path alone
    (the log may come from another machine). Any other installed package (``transformers``) is the user's model
    code, as for the guard's ``source``."""
    installed = _INSTALLED.search(path)
    if installed:
        return installed.group("package") in _LIBRARIES
    if re.search(r"[\\/](?:torch|pytorch_lightning|lightning_fabric|lightning_numguard)[\\/]", path):
        return True
    return _STDLIB.search(path) is not None or path.startswith("<")


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
    if backward:
        return (
            "nonfinite_grad",
            f"NumGuardCallback records this as nonfinite_grad, op {node}, at {at}: {call.op}'s value there is "
            "finite but its gradient is not (when every forward value of the step was finite).",
        )
    kind = "nonfinite_loss" if _LOSSES.search(call.op) else "nonfinite_output"
    return (
        kind,
        f"NumGuardCallback records this as a forward fault, {kind}, at the op that first wrote the NaN: op "
        f"`{call.op}` at {at}, or an op upstream of it. {node}'s backward turns NaN only because the values it "
        "saved in the forward pass were NaN already; anomaly mode stops at the first node the backward pass "
        "reaches, next to the loss, not at the op that made the value.",
    )
