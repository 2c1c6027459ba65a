"""The torch-level call running now during the replay, and the user's line of every call (one per call).

The dispatcher sees ``addmm`` where the user wrote ``linear``: :class:`Calls` keeps the outermost torch function
running, so that :class:`~lightning_numguard.diagnose.provenance.Provenance` names ops as the user wrote them, and the
user's ``file:line`` of each call (two calls of ``div`` at two lines are two sites).
"""

from __future__ import annotations

import linecache
from typing import Any

from torch.overrides import TorchFunctionMode

from lightning_numguard._compat import caller_frame, first_frame
from lightning_numguard.diagnose.usercode import user_site

__all__ = ["Calls", "op_name", "site"]

_ALIASES = {"truediv": "div", "rtruediv": "div", "rdiv": "div", "radd": "add", "rsub": "sub", "rmul": "mul"}
_ALIASES.update({"rpow": "pow", "rmatmul": "matmul", "iadd": "add_", "imul": "mul_", "itruediv": "div_"})
_ALIASES["setitem"] = "__setitem__"  # `x[i] = v`: named as Python spells the write
_IGNORED = {"__get__", "__set__", "__getitem__", "__setitem__", "__len__", "__format__", "__repr__"}
# Calls made by torch.distributed's own code (FSDP2's copies into and out of its all-gather buffers) are not
# the model's: they get no user line.
_DISTRIBUTED = "/torch/distributed/"
_OWN = tuple(
    f"/lightning_numguard/{n}.py"
    for n in ("diagnose/replay", "diagnose/provenance", "diagnose/calls", "dtensor", "tree")
)


def op_name(func: Any) -> str:
    """The plain name of a torch function or tensor method: ``Tensor.__truediv__`` -> ``div``."""
    name = str(getattr(func, "__name__", func))
    bare = name.strip("_")
    return _ALIASES.get(bare, bare) if name.startswith("__") else name


def site(file: str, line: int) -> dict[str, Any]:
    return {"file": file, "line": line, "code": linecache.getline(file, line).strip()}


class Calls(TorchFunctionMode):
    """The torch-level call running now (``linear`` while its ``addmm`` runs) and every call's user line.

    ``sites``: op name -> the user's ``file``/``line``/``code`` of each call of it, in call order (one per
    call, never one per name: two calls of ``div`` at two lines are two sites).
    """

    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.sites: dict[str, list[dict[str, Any]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _IGNORED and name != "__setitem__":
            return func(*args, **kwargs)
        caller = _caller_file(caller_frame(1))
        if caller.endswith(_OWN):  # the replay's own checks (module hooks), not the model's
            return func(*args, **kwargs)
        op = op_name(func)
        if _DISTRIBUTED not in caller:
            where = user_site(caller_frame(1))
            self.sites.setdefault(op, []).append(site(*where) if where else {})
        outer, self.current = self.current, op
        try:
            return func(*args, **kwargs)
        finally:
            self.current = outer


def _caller_file(frame: Any) -> str:
    """The file of the code that called a torch function, past the ``torch.ops`` call machinery, with ``/``."""
    found = first_frame(frame, lambda f: not _path(f).endswith("/torch/_ops.py"))
    return _path(found) if found is not None else ""


def _path(frame: Any) -> str:
    return str(frame.f_code.co_filename).replace("\\", "/")
