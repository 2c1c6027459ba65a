"""``ARCHITECTURE.md`` says what the code does: who writes files, loggers and warnings; each part listed once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_numguard"
DOC = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")

#: calls that write a file, reach the loggers or the progress bar, or warn, on any receiver
WRITE_ATTRIBUTES = frozenset(
    {"save", "save_checkpoint", "log_dict", "log_metrics", "add_text", "add_scalar", "write_text", "write_bytes"}
)
#: ``receiver.attribute`` calls that write only on these receivers (a logger, the LightningModule, a console)
WRITE_ON = {
    "warn": ("warnings",),
    "warning": ("log", "logger", "logging"),
    "error": ("log", "logger", "logging"),
    "log": ("log", "logger", "logging", "pl_module"),
    "print": ("console",),
    "open": ("path", "self.path", "Path(path)"),
}
#: the guard's own reporting, and the commands, which write what the user asked for
OUT_OF_SCOPE = ("reporting/", "cli.py", "doors/trainer/demo.py")


def writes(source: str) -> list[str]:
    """The writing calls in ``source``, as ``receiver.attribute``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver, attr = ast.unparse(node.func.value), node.func.attr
        if attr in WRITE_ATTRIBUTES or receiver in WRITE_ON.get(attr, ()) or receiver.endswith("console"):
            if attr == "open" and receiver not in WRITE_ON["open"]:
                continue
            found.append(f"{receiver}.{attr}")
    return found


def writers_in_code() -> dict[str, list[str]]:
    out = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(PACKAGE).as_posix()
        if rel.startswith(OUT_OF_SCOPE):
            continue
        calls = writes(file.read_text(encoding="utf-8"))
        if calls:
            out[rel.removesuffix(".py")] = calls
    return out


def writers_in_doc() -> list[str]:
    table = DOC.split("<!-- writers -->", 1)[1].split("<!-- /writers -->", 1)[0]
    return re.findall(r"^\| `([\w/]+)` \|", table, re.M)


def test_the_scan_sees_writing_calls():
    """Control: the scan recognises each form it looks for, and leaves an ordinary call alone."""
    source = "warnings.warn('x')\nlog.warning('x')\ntorch.save(x, p)\npl_module.log('k', v)\nt.sum()\nlog.debug('x')"
    assert writes(source) == ["warnings.warn", "log.warning", "torch.save", "pl_module.log"]


def test_every_module_that_writes_is_in_the_architecture_table_and_only_those():
    code = writers_in_code()
    doc = writers_in_doc()
    assert len(doc) == len(set(doc)), doc
    assert set(doc) == set(code), {"missing from the table": sorted(set(code) - set(doc)), "not writing": sorted(set(doc) - set(code)), "calls": code}  # fmt: skip


def layer_parts() -> list[str]:
    """The parts the layer map lists, as paths (``engine/loop``, ``doors/trainer/loop``): a room's parts are
    indented under it."""
    layers = DOC.split("## Layers", 1)[1].split("```", 2)[1]
    rooms: list[str] = []
    parts = []
    for line in layers.splitlines():
        m = re.match(r"^( +)(_?\w+)(/)? +\S", line)
        if not m or len(m.group(1)) not in (2, 4, 6):
            continue
        depth = len(m.group(1)) // 2 - 1
        rooms[depth:] = []
        if m.group(3):
            rooms.append(m.group(2))
        elif depth:
            parts.append("/".join([*rooms, m.group(2)]))
    return parts


def test_each_part_is_listed_once_in_the_layers_and_exists():
    parts = layer_parts()
    assert "reporting/ledger" in parts and "doors/trainer/callback" in parts, parts
    assert len(parts) == len(set(parts)), sorted(n for n in parts if parts.count(n) > 1)
    missing = [p for p in parts if not (PACKAGE / f"{p}.py").is_file() and not (PACKAGE / p).is_dir()]
    assert not missing, missing


def test_the_architecture_names_no_symbol_the_code_lacks():
    """Each ``CONSTANT`` the page tells a newcomer to edit is used beyond its definition and ``__all__`` entry."""
    constants = set(re.findall(r"`([A-Z][A-Z_]{3,})`", DOC))
    files = [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    source = "\n".join(p.read_text(encoding="utf-8") for p in files if p.name != "test_architecture.py")
    unused = sorted(c for c in constants if len(re.findall(rf"\b{c}\b", source)) < 3)
    assert not unused, unused


def test_every_module_of_the_package_is_drawn_in_the_layers():
    """The layer map draws what the code is: each module in a room is one of its parts, each top-level module is named."""
    parts = set(layer_parts())
    layers = DOC.split("## Layers", 1)[1].split("```", 2)[1]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if "__pycache__" in rel.parts or rel.name in ("__init__", "__main__", "__about__"):
            continue
        if (len(rel.parts) > 1 and rel.as_posix() not in parts) or (
            len(rel.parts) == 1 and not re.search(rf"\b{re.escape(rel.name)}(\.py)?\b", layers)
        ):
            missing.append(rel.as_posix())
    assert not missing, missing
