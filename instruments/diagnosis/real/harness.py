"""The harness of the real-model diagnosis table: what a row is, where its fault is, how it runs, how it is judged.

A row's expected answer is read from the scenario's source, never written down as numbers:

- :class:`Marker` — the faulty line carries ``# FAULT: <tag>`` in a scenario file of this package; the expected
  ``file:line`` is that line, the expected module the instance of the class whose method holds it (the
  LightningModule itself, ``ROOT``, when the line runs in its own ``forward``/``training_step``), or ``child`` of
  it when the faulty op runs in a child called from that line (``self.fc1(x)`` overflowing in ``fc1``), or the
  module a hook was registered on (a hook function is not a method of a module).
- :class:`LibrarySite` — the faulty op runs in library code the project did not write (Hugging Face): the line
  holding ``code`` inside ``cls``'s source, read from the installed file, and the module ``instance``.
- :class:`Leaf` — a parameter or batch field already non-finite: the guard must name that parameter or field.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from instruments.faults import quiet_trainer

BAD_STEP = 1  #: every fault is injected at this global step (step 0 runs clean)
ROOT = ""  #: the module name of the LightningModule itself (``named_modules`` spells it so)
#: The dispatcher names one ``x[i] = value`` write by the aten op it becomes (a write through an index).
WRITE_OPS = frozenset({"__setitem__", "index_put_", "index_put", "fill_", "copy_", "masked_fill_"})
FORWARD_KINDS = frozenset({"nonfinite_output", "nonfinite_loss"})
TRACED_KINDS = FORWARD_KINDS | {"nonfinite_grad"}  #: kinds whose op is one the replay traced the value to


@dataclass(frozen=True)
class Marker:
    tag: str
    child: str | None = None  # the faulty op runs in this child of the marker's module
    hooked: str | None = None  # the marker is in a hook registered on this module
    instance: str | None = None  # which instance of the marker's class, when the model holds several


@dataclass(frozen=True)
class LibrarySite:
    cls: type
    code: str  # text of the one line of ``cls``'s source where the faulty op is called
    instance: str  # the module the op runs in


@dataclass(frozen=True)
class Leaf:
    where: str  # the parameter's name, or the batch field as the guard spells it (``batch['labels']``)
    tag: str  # the marker on the line that injects it


@dataclass(frozen=True)
class Row:
    """One scenario of the table."""

    name: str
    model: str  # the model, in words
    story: str  # the fault, in words
    build: Callable[[], tuple[pl.LightningModule, Any]]  # (LightningModule, train DataLoader)
    kind: str
    op: str | None
    fault: Marker | LibrarySite | Leaf
    file: str  # the scenario file holding the markers
    trainer: dict[str, Any] = field(default_factory=dict)
    steps: int = BAD_STEP + 1  # the fit ends with the step of the fault
    note: str = ""  # how the fault is reproduced honestly (precision, accumulation, ...)
    batch_idx: int | None = None  # the micro-batch the guard must name (accumulation)
    rank: int | None = None  # the rank the guard must name (sharded)


@dataclass(frozen=True)
class Expected:
    kind: str
    module: str | None
    op: str | None
    file: str | None
    line: int | None
    where: str | None = None


def fp16_autocast() -> dict[str, Any]:
    """fp16 autocast on CPU with a GradScaler: ``precision="16-mixed"`` on CPU falls back to bf16 in Lightning 2.6
    (whose range is float32's, so nothing overflows); the plugin keeps float16."""
    from pytorch_lightning.plugins import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}


@cache
def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as stream:
        return stream.read().splitlines()


def marker_line(path: str, tag: str) -> int:
    """The 1-based line of ``# FAULT: tag`` in ``path`` (exactly one)."""
    hits = [i for i, text in enumerate(_lines(path), 1) if text.rstrip().endswith(f"# FAULT: {tag}")]
    if len(hits) != 1:
        raise LookupError(f"{path}: {len(hits)} lines end with '# FAULT: {tag}'")
    return hits[0]


def enclosing_class(path: str, line: int) -> str | None:
    """The innermost class whose body holds ``line`` in ``path`` (``None`` outside any class)."""
    tree = ast.parse("\n".join(_lines(path)))
    best: ast.ClassDef | None = None
    for node in ast.walk(tree):
        inside = isinstance(node, ast.ClassDef) and node.lineno <= line <= (node.end_lineno or node.lineno)
        if inside and (best is None or node.lineno > best.lineno):
            best = node  # type: ignore[assignment]
    return best.name if best is not None else None


def _instance_of(model: nn.Module, class_name: str, module_name: str) -> list[str]:
    return [
        name
        for name, mod in model.named_modules()
        if type(mod).__name__ == class_name and type(mod).__module__ == module_name
    ]


def expected(row: Row, model: pl.LightningModule) -> Expected:
    """What the guard must name for ``row``, read from the scenario's source and the built model."""
    fault = row.fault
    if isinstance(fault, Leaf):
        return Expected(row.kind, None, None, None, None, fault.where)
    if isinstance(fault, LibrarySite):
        path = inspect.getsourcefile(fault.cls) or ""
        body, start = inspect.getsourcelines(fault.cls)
        hits = [start + i for i, text in enumerate(body) if fault.code in text]
        if len(hits) != 1:
            raise LookupError(f"{fault.cls.__name__}: {len(hits)} lines hold {fault.code!r}")
        model.get_submodule(fault.instance)
        return Expected(row.kind, fault.instance, row.op, os.path.realpath(path), hits[0])
    line = marker_line(row.file, fault.tag)
    if fault.hooked is not None:
        model.get_submodule(fault.hooked)
        module = fault.hooked
    else:
        owner = enclosing_class(row.file, line)
        if owner is None:
            raise LookupError(f"{row.name}: the marker is outside a class and no hooked module is named")
        mod_name = next(n for n, m in list(sys.modules.items()) if getattr(m, "__file__", None) == row.file)
        names = _instance_of(model, owner, mod_name)
        names = [fault.instance] if fault.instance in names else names
        if len(names) != 1:
            raise LookupError(f"{row.name}: {len(names)} instances of {owner} in the model")
        module = names[0]
        if fault.child is not None:
            module = f"{module}.{fault.child}" if module else fault.child
            model.get_submodule(module)
    return Expected(row.kind, module, row.op, os.path.realpath(row.file), line)


def root_cause(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The first event that is not a consequence (``{}`` when the guard recorded none)."""
    return next((e for e in events if e.get("root_cause", True)), {})


def _split_source(source: str | None) -> tuple[str | None, int | None]:
    if not source or ":" not in source:
        return None, None
    path, line = source.rsplit(":", 1)
    return os.path.realpath(path), int(line) if line.isdigit() else None


def wrong_fields(row: Row, want: Expected, event: dict[str, Any], root_name: str) -> list[str]:
    """The fields of the root-cause event that differ from what ``row`` expects (empty: the row is right)."""
    if not event:
        return ["no event"]
    wrong = []
    kind = event.get("kind")
    if kind != want.kind and not (want.kind in FORWARD_KINDS and want.module == ROOT and kind in FORWARD_KINDS):
        wrong.append(f"kind {kind}")
    if want.where is not None:
        if want.where not in (event.get("where") or []):
            wrong.append(f"where {event.get('where')}")
    else:
        module = event.get("module")
        roots = {ROOT, None, root_name}
        if not (module == want.module or (want.module == ROOT and module in roots)):
            wrong.append(f"module {module!r}")
        op = event.get("op")
        if not (op == want.op or (want.op in WRITE_OPS and op in WRITE_OPS)):
            wrong.append(f"op {op!r}")
        if _split_source(event.get("source")) != (want.file, want.line):
            source = event.get("source")
            wrong.append(f"source {os.path.basename(source) if source else None}")
    if row.batch_idx is not None and event.get("batch_idx") != row.batch_idx:
        wrong.append(f"batch_idx {event.get('batch_idx')}")
    if row.rank is not None and event.get("rank") != row.rank:
        wrong.append(f"rank {event.get('rank')}")
    return wrong


@dataclass
class Result:
    row: Row
    want: Expected
    event: dict[str, Any]
    wrong: list[str]
    root_name: str
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def right(self) -> bool:
        return not self.wrong

    @property
    def stray(self) -> list[str]:
        """Ops that other events of the run name as made "from finite inputs" although they are not the fault
        (T5's bucket ``log(0)``, a causal mask's ``masked_fill``): ``op file:line`` of each, once."""
        want = self.want
        found: list[str] = []
        for e in self.events:
            op = e.get("op")
            if not op or e is self.event or e.get("kind") not in TRACED_KINDS:
                continue  # an op_domain consequence names the op that refused the value, not one that made it
            same_op = op == want.op or (want.op in WRITE_OPS and op in WRITE_OPS)
            if same_op and _split_source(e.get("source")) == (want.file, want.line):
                continue
            source = e.get("source") or ""
            text = f"`{op}` {os.path.basename(source)}"
            if text not in found:
                found.append(text)
        return found


def _trainer(row: Row, callbacks: list[Any], root: str, **extra: Any) -> pl.Trainer:
    kwargs = {"max_steps": row.steps, "devices": 1, "default_root_dir": root, **row.trainer, **extra}
    return quiet_trainer(callbacks, **kwargs)


def run_guarded(row: Row, root: str) -> Result:
    """Fit ``row``'s model with ``NumGuardCallback(action="skip")``; its root-cause event, judged."""
    from lightning_numguard import NumGuardCallback

    torch.manual_seed(0)
    model, data = row.build()
    want = expected(row, model)
    guard = NumGuardCallback(action="skip", dirpath=os.path.join(root, "ng"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(row, [guard], root).fit(model, data)
    event = root_cause(guard.events)
    name = type(model).__name__
    return Result(row, want, event, wrong_fields(row, want, event, name), name, guard.events)


def run_detect_anomaly(row: Row, root: str) -> tuple[str, str]:
    """What ``Trainer(detect_anomaly=True)`` without the guard says: the error's first line (or "said nothing"),
    and the whole log a user sees on stderr (the warnings as Python prints them, then the traceback)."""
    import traceback

    torch.manual_seed(0)
    model, data = row.build()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            _trainer(row, [], root, detect_anomaly=True).fit(model, data)
        except Exception as err:  # what a user would see
            log = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in records)
            return f"{type(err).__name__}: {str(err).splitlines()[0][:100]}", log + "".join(
                traceback.format_exception(err)
            )
    return "said nothing", ""


def launch_fsdp2(root: str) -> list[dict[str, Any]]:
    """Run ``fsdp2_script.py`` (2 gloo processes); each rank's result (its events, or its traceback)."""
    import json
    import socket
    import subprocess
    from pathlib import Path

    script = Path(__file__).with_name("fsdp2_script.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, str(script), root], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fsdp2_script exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads((Path(root) / f"rank{r}.json").read_text()) for r in range(2)]


def run_fsdp2(row: Row, root: str) -> Result:
    """The FSDP2 row's root-cause event (rank 0's record: every rank merges the incident), judged."""
    ranks = launch_fsdp2(root)
    for result in ranks:
        if "error" in result:
            raise RuntimeError(f"rank {result['rank']} raised:\n{result['error']}")
    model, _ = row.build()
    want = expected(row, model)
    event = root_cause(ranks[0]["events"])
    wrong = wrong_fields(row, want, event, type(model).__name__)
    return Result(row, want, event, wrong, type(model).__name__, ranks[0]["events"])
