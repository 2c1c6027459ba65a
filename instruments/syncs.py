"""Count the host reads and device-to-host copies made through ``torch.Tensor``'s Python methods.

One counter for the tests (which assert the guard's one read per step) and ``benchmarks/``
(which reports reads per step for every variant). torch and the standard library only.

Example:
    >>> import torch
    >>> from instruments.syncs import SyncCounter
    >>> t = torch.ones(2)
    >>> with SyncCounter(package=__name__) as counter:
    ...     with counter.step():
    ...         _ = t.sum().item()
    ...     _ = t.tolist()  # outside a step window: not counted
    >>> counter.step_total, counter.step_caused
    ([1], [1])

What is counted:

* reads: ``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``numpy``
  and ``__repr__`` (also ``str()``; formatting reads every shown value, counted as one read),
  on tensors of *any* device: on a CPU-only run every tensor is a CPU tensor, so this counts what
  would be a sync if the tensor lived on an accelerator (``step_on_device`` says how many really
  were on one);
* copies: ``cpu()`` and ``to(<a cpu device>)``, only when the source tensor is *not* on the CPU
  (on a CPU tensor they are no-ops; ``copies_from_cpu=True`` counts ``cpu()`` there too).

Only calls inside a *step window* (``step_started`` .. ``step_ended``, or ``with counter.step()``)
are counted per step; others are totalled in ``outside_total`` / ``outside_caused`` when
``count_outside=True`` and ignored otherwise. A call made while another counted call runs (e.g.
the ``item()`` calls inside a tensor's ``__repr__``) is counted once, as the outer one.

A call is *caused* by the package when a frame of a module named ``package`` or ``package.*``
(default ``lightning_numguard``) is anywhere on the Python stack, this module's own frames
excepted. So a read that torch makes inside a function the guard called counts, and so does
one Lightning makes inside a hook the guard calls; a read by Lightning or the model around the
guard's hooks does not. One over-count is possible: the op guard's ``__torch_function__`` is on
the stack of every torch function the model calls while it is active, so a read that torch
itself makes *inside* such a function counts as caused (never an under-count).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any, ClassVar

import torch

from lightning_numguard._compat import caller_frame, first_frame, to_target_device

__all__ = ["SyncCounter"]

_MISSING = object()
_THIS_FILE = __file__


class SyncCounter:
    """Patches ``torch.Tensor``'s host-read methods while installed and counts their calls.

    Use it as a context manager (``with SyncCounter() as counter:``) or call ``install`` /
    ``uninstall``; open and close step windows with ``step_started`` / ``step_ended`` (e.g. from
    a Lightning callback's ``on_train_batch_start`` / ``on_train_batch_end``) or ``with
    counter.step():``. One counter can be installed at a time.

    Args:
        package: module-name prefix whose frames make a call *caused* (see the module docstring).
        count_outside: also total the calls made outside step windows (``outside_*``).
        copies_from_cpu: count ``cpu()`` on CPU tensors too (a CPU-only test that stands in for an
            accelerator run, where it would be a device-to-host copy). ``to(cpu)`` on a CPU tensor
            still does not count: ``to(device)`` is how code moves tensors to its working device,
            which on a CPU-only run is the CPU.

    Attributes:
        step_total: counted calls per step window, in window order.
        step_caused: of which caused by ``package``.
        step_on_device: of which on a tensor not on the CPU (real syncs).
        outside_total: calls outside step windows (with ``count_outside``).
        outside_caused: of which caused by ``package``.
        sites: ``"step|outside | method | caused|other | module:line function"`` -> count; the
            site is the innermost ``package`` frame for a caused call, else the innermost frame
            outside torch (``-> torch frame`` appended when torch made the call).

    Raises:
        RuntimeError: ``install`` while a counter is installed.
    """

    READS: ClassVar[tuple[str, ...]] = (
        "item",
        "tolist",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "numpy",
        "__repr__",
    )
    COPIES: ClassVar[tuple[str, ...]] = ("cpu", "to")
    _installed: ClassVar[SyncCounter | None] = None

    def __init__(
        self, package: str = "lightning_numguard", *, count_outside: bool = False, copies_from_cpu: bool = False
    ) -> None:
        if not package or package.startswith(".") or package.endswith("."):
            raise ValueError(f"`package` must be a module name such as 'lightning_numguard', got {package!r}")
        self.package = package
        self.count_outside = count_outside
        self.copies_from_cpu = copies_from_cpu
        self.step_total: list[int] = []
        self.step_caused: list[int] = []
        self.step_on_device: list[int] = []
        self.outside_total = 0
        self.outside_caused = 0
        self.sites: Counter[str] = Counter()
        self.in_step = False
        self._saved: dict[str, Any] = {}
        self._local = threading.local()

    # ------------------------------------------------------------------ totals

    @property
    def total(self) -> int:
        """Counted calls over all step windows."""
        return sum(self.step_total)

    @property
    def caused(self) -> int:
        """Calls caused by ``package`` over all step windows."""
        return sum(self.step_caused)

    # ------------------------------------------------------------------ step window

    def step_started(self) -> None:
        """Open a step window: calls from now on count for a new step."""
        self.step_total.append(0)
        self.step_caused.append(0)
        self.step_on_device.append(0)
        self.in_step = True

    def step_ended(self) -> None:
        """Close the step window."""
        self.in_step = False

    @contextmanager
    def step(self) -> Iterator[SyncCounter]:
        """A step window around the ``with`` body."""
        self.step_started()
        try:
            yield self
        finally:
            self.step_ended()

    # ------------------------------------------------------------------ patching

    @property
    def installed(self) -> bool:
        """Whether this counter's wrappers are on ``torch.Tensor``."""
        return SyncCounter._installed is self

    def install(self) -> None:
        """Put the counting wrappers on ``torch.Tensor``."""
        if SyncCounter._installed is not None:
            raise RuntimeError("a SyncCounter is already installed; uninstall it first (one counter at a time)")
        for name in self.READS + self.COPIES:
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        SyncCounter._installed = self

    def uninstall(self) -> None:
        """Restore the original ``torch.Tensor`` methods (the same objects); no-op if not installed."""
        if not self.installed:
            return
        for name, orig in self._saved.items():
            if orig is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)
        self._saved.clear()
        self.in_step = False
        SyncCounter._installed = None

    def __enter__(self) -> SyncCounter:
        self.install()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        counter, local, counts, hit = self, self._local, self._counts, self._hit

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(local, "busy", False) or not (counter.in_step or counter.count_outside):
                return orig(self, *args, **kwargs)
            local.busy = True
            try:
                if counts(name, self, args, kwargs):
                    hit(name, self, caller_frame(1))
                return orig(self, *args, **kwargs)
            finally:
                local.busy = False

        wrapper.__name__ = name
        wrapper.__qualname__ = f"SyncCounter.{name}"
        return wrapper

    def _counts(self, name: str, t: torch.Tensor, args: Any, kwargs: Any) -> bool:
        if name in self.READS:
            return True
        if name == "cpu":
            return self.copies_from_cpu or t.device.type != "cpu"
        if t.device.type == "cpu":  # ``to(device)`` on the working device: no copy, on any run
            return False
        try:
            device = to_target_device(*args, **kwargs)
        except Exception:  # an invalid call: the original raises, nothing to count
            return False
        return device is not None and torch.device(device).type == "cpu"

    def _is_package(self, frame: FrameType) -> bool:
        module = frame.f_globals.get("__name__") or ""
        return (module == self.package or module.startswith(self.package + ".")) and (
            frame.f_code.co_filename != _THIS_FILE
        )

    def _hit(self, name: str, t: torch.Tensor, frame: FrameType | None) -> None:
        caused_at = first_frame(frame, self._is_package)
        if caused_at is not None:
            site = _site(caused_at)
        elif frame is None:  # a read with no Python caller (made from C)
            site = "?"
        else:  # the innermost frame outside torch itself (torch internals name their caller)
            f = first_frame(frame, lambda g: _module(g).partition(".")[0] != "torch")
            site = _site(f or frame) + ("" if f is frame else f" -> {_site(frame)}")
        caused = caused_at is not None
        where = "step" if self.in_step else "outside"
        self.sites[f"{where} | {name} | {'caused' if caused else 'other'} | {site}"] += 1
        if self.in_step:
            self.step_total[-1] += 1
            self.step_caused[-1] += caused
            self.step_on_device[-1] += t.device.type != "cpu"
        else:
            self.outside_total += 1
            self.outside_caused += caused


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__") or "?")


def _site(frame: FrameType) -> str:
    return f"{_module(frame)}:{frame.f_lineno} {frame.f_code.co_name}"
