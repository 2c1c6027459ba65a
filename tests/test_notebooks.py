"""The walk-through notebooks in ``notebooks/`` run end to end, and are committed without outputs.

Each notebook asserts its own story (an event of the right kind exists, the run survived, a bad
YAML value was refused), so executing it is the test. The kernel is ``python3`` from the running
environment; a first test proves it is this interpreter, so the notebooks see the same packages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _execute(nb: nbformat.NotebookNode, cwd: Path) -> nbformat.NotebookNode:
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    return client.execute()


def test_at_least_three_notebooks() -> None:
    assert len(NOTEBOOKS) >= 3, [p.name for p in NOTEBOOKS]


def test_kernel_runs_this_interpreter(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    out = _execute(nb, tmp_path).cells[0].outputs
    printed = "".join(o.get("text", "") for o in out if o.output_type == "stream").strip()
    assert Path(printed).resolve() == Path(sys.executable).resolve()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each notebook runs, writes only under ``tempfile.mkdtemp()`` and removes that folder at its end.

    The kernel's temporary folder is one of this test's own (``TMPDIR``), so the suite never leaves a
    ``numguard-*`` folder in the machine's ``/tmp``, even when a notebook fails half-way.
    """
    cwd, kernel_tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))  # the kernel is a child process: it inherits the environment
    nb = nbformat.read(path, as_version=4)
    _execute(nb, cwd)  # raises CellExecutionError, naming the cell, when any cell fails
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert errors == []
    printed = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert f"writing under {kernel_tmp}{os.sep}numguard-" in printed  # control: the kernel used this folder
    assert list(cwd.iterdir()) == [], "notebooks write under tempfile.mkdtemp(), not the working directory"
    left = [p.name for p in kernel_tmp.iterdir() if p.name.startswith("numguard-")]  # torch may cache there too
    assert left == [], "a notebook removes its temporary folder at its end"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [], f"{path.name}: a code cell has outputs; strip them"
        assert cell.execution_count is None, f"{path.name}: a code cell has an execution count; strip it"
