"""The tutorials run top to bottom (tiny sizes) with no error cell and no dtkv deprecation warning.

They are committed executed (outputs and inline figures, ``tools/execute_tutorials.py``); here each one is
re-executed in memory, in a scratch working directory, so the committed files are never rewritten.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parent.parent / "tutorials").glob("*.ipynb"))
_NO_DEPRECATED = (
    "import warnings\n"
    "warnings.filterwarnings('error', message='.*is deprecated and will be removed in the next release')"
)


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_executes(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    before = path.read_bytes()
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_NO_DEPRECATED))  # a dtkv deprecation is an error here
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert path.read_bytes() == before, f"executing {path.name} rewrote the committed file"
    assert not list(path.parent.glob("*.png")), "a tutorial wrote a figure file into tutorials/ (show it inline)"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_is_committed_executed(path):
    """Every code cell has been run (an execution count) and the figures are inline PNG outputs."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c.get("execution_count") for c in code), f"{path.name}: commit it executed"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))
    if "plt.show()" in "".join("".join(c["source"]) for c in code):
        assert any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", [])), path.name


_LOCAL = ("/root/", "/home/", "/Users/", "/tmp/", "/work/", "site-packages", "Warning:", "Warning ")


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_outputs_hold_a_figure_and_no_local_path_or_warning(path):
    """Every tutorial shows a figure inline; no committed output names a local path (an interpreter's site-packages,
    a home directory) or carries a warning (04's stored a TqdmWarning with the interpreter's path)."""
    nb = json.loads(path.read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} shows no figure"
    for o in outputs:
        text = "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
        found = [m for m in _LOCAL if m in text]
        assert not found, f"{path.name}: an output holds {found}: {text[:300]!r}"
