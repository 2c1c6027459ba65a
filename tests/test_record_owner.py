"""One writer per record: the step record is written by its recorder, a built event by nobody.

Every ``.py`` file of the package is parsed; these fail, named by ``file:line`` and the expression:

* outside ``lightning_numguard/engine/record.py``, an assignment (``=``, ``+=``, a tuple target, a
  subscript of the field, ``setattr``) or an in-place call (``append``, ``extend``, ``update``...) on a field of
  :class:`~lightning_numguard.engine.record.StepRecord` through a record: a name ``rec``, ``record``,
  ``current`` or ``carry`` (or an attribute so named: ``self.recorder.record``), or a name annotated
  ``StepRecord``. The other parts hand what they found to the recorder's methods (``force_skip``, ``mark_read``,
  ``settle``...);
* anywhere, an assignment into an event's ``["details"]`` or to its ``["message"]`` (or ``setdefault``/``update``
  on its details): an event, once the ledger built it, is recorded with what was done (``_outcome.Outcome``),
  not edited.

The record's fields are read from the dataclass itself, so a new field is covered without editing this test.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_numguard"
RECORD_MODULE = "lightning_numguard/engine/record.py"
RECORD_NAMES = frozenset({"rec", "record", "current", "carry"})
IN_PLACE = frozenset({"append", "extend", "insert", "pop", "clear", "update", "setdefault", "remove", "sort"})
EVENT_KEYS = frozenset({"details", "message"})


def record_fields(source: str) -> set[str]:
    """The field names of ``StepRecord`` (its annotated class attributes) in ``_record.py``'s source."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "StepRecord":
            return {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
    raise AssertionError("StepRecord not found")


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _record_names(tree: ast.AST) -> set[str]:
    """The names annotated ``StepRecord`` (or ``StepRecord | None``) anywhere in ``tree``, plus the usual ones."""
    names = set(RECORD_NAMES)
    for node in ast.walk(tree):
        annotation, name = None, None
        if isinstance(node, ast.arg):
            annotation, name = node.annotation, node.arg
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation, name = node.annotation, node.target.id
        if annotation is not None and "StepRecord" in ast.unparse(annotation):
            names.add(name)  # type: ignore[arg-type]
    return names


def _through_record(node: ast.expr, fields: set[str], names: set[str]) -> bool:
    """``node`` is ``<record>.<field>`` or a subscript of it (``rec.micro[0]``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr in fields and _last_name(node.value) in names


def _into_event(node: ast.expr) -> bool:
    """``node`` is ``e["message"]``, ``e["details"]`` or inside it (``e["details"]["x"]``)."""
    while isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and key.value in EVENT_KEYS:
            return True
        node = node.value
    return False


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def violations(source: str, path: str, fields: set[str]) -> list[str]:
    """``path:line: expression (why)`` for each write to a record's field or into a built event in ``source``."""
    tree = ast.parse(source)
    names = _record_names(tree)
    own_record = path == RECORD_MODULE
    found: list[str] = []

    def flag(node: ast.AST, expr: ast.expr, why: str) -> None:
        found.append(f"{path}:{getattr(node, 'lineno', 0)}: `{ast.unparse(expr)}` ({why})")

    for node in ast.walk(tree):
        for target in _targets(node):
            if not own_record and _through_record(target, fields, names):
                flag(node, target, "a step record's field: only its recorder writes it")
            if _into_event(target):
                flag(node, target, "a built event: record it with an Outcome instead")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) >= 2 and not own_record:
            obj, attr = node.args[0], node.args[1]
            if isinstance(attr, ast.Constant) and attr.value in fields and _last_name(obj) in names:
                flag(node, node, "a step record's field: only its recorder writes it")
        if isinstance(func, ast.Attribute) and func.attr in IN_PLACE:
            if not own_record and _through_record(func.value, fields, names):
                flag(node, func, "a step record's field changed in place: only its recorder does")
            if _into_event(func.value):
                flag(node, func, "a built event changed in place: record it with an Outcome instead")
    return found


def scan(package: Path) -> list[str]:
    root = package.parent
    fields = record_fields((root / RECORD_MODULE).read_text(encoding="utf-8"))
    found: list[str] = []
    for file in sorted(package.rglob("*.py")):
        found += violations(file.read_text(encoding="utf-8"), file.relative_to(root).as_posix(), fields)
    return found


def test_only_the_recorder_writes_the_step_record_and_nobody_edits_a_built_event():
    found = scan(PACKAGE)
    assert not found, "\n".join(found)


def test_the_fields_are_the_dataclass_s():
    fields = record_fields((REPO / RECORD_MODULE).read_text(encoding="utf-8"))
    assert {"forced_skip", "quarantine_flag", "read_done", "step", "decision", "events", "spike_read"} <= fields


def test_the_scan_finds_each_kind_of_write():
    fields = {"forced_skip", "events", "step", "micro"}
    source = """
def f(rec, other, state: "StepRecord | None", self):
    rec.forced_skip = "why"
    self.recorder.record.step += 1
    a, current.events = 1, []
    state.step = 3
    rec.micro[0] = None
    rec.events.append({})
    setattr(carry, "step", 2)
    e["details"]["steps_lost"] = 3
    e["message"] += "; a repeat"
    e["details"].setdefault("snapshot_step", 4)
    other.step = 1  # not a record
    self.events = []  # not a record
    details["x"] = 1  # not an event's details
    rec.batch_idx = 1  # not a field named here
"""
    found = violations(source, "lightning_numguard/x.py", fields)
    lines = sorted(int(v.split(":")[1]) for v in found)
    assert lines == list(range(3, 13)), found
    own = violations(source, RECORD_MODULE, fields)  # the recorder's module writes records, not built events
    assert sorted(int(v.split(":")[1]) for v in own) == [10, 11, 12], own
