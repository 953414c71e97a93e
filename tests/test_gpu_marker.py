"""The ``gpu`` marker is the suite's one way to say "needs CUDA", so that ``python -m pytest -m gpu`` selects every
GPU case and a CPU run skips them with one reason (``tests/conftest.py``).

Read from the test sources: no ``skipif`` / ``pytest.skip`` decides on CUDA (``torch.cuda.is_available()``, a
``CUDA`` flag), and every ``pytest.param("cuda", ...)`` of a device parametrization carries ``pytest.mark.gpu``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
_CUDA = re.compile(r"cuda", re.IGNORECASE)


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.glob("*.py") if p.name != Path(__file__).name)


def _is_mark(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and "mark" in ast.unparse(node)


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_mark(node.func, "skipif") and node.args:
            if _CUDA.search(ast.unparse(node.args[0])):
                out.append(
                    f"{path.name}:{node.lineno}: skipif on CUDA ({ast.unparse(node.args[0])}): use pytest.mark.gpu"
                )
        if isinstance(node, ast.If) and _CUDA.search(ast.unparse(node.test)):
            for sub in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if isinstance(sub, ast.Call) and ast.unparse(sub.func) == "pytest.skip":
                    out.append(
                        f"{path.name}:{sub.lineno}: pytest.skip under `if {ast.unparse(node.test)}`: use pytest.mark.gpu"
                    )
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and first.value == "cuda":
                marks = next((k.value for k in node.keywords if k.arg == "marks"), None)
                if marks is None or "mark.gpu" not in ast.unparse(marks):
                    out.append(f"{path.name}:{node.lineno}: pytest.param('cuda') without marks=pytest.mark.gpu")
    return out


def test_gpu_cases_say_so_with_the_marker_only():
    bad = [v for p in _sources() for v in _violations(p)]
    assert not bad, "\n".join(bad)


def test_the_guard_catches_each_other_way(tmp_path):
    """The check itself flags a CUDA skipif, a CUDA-conditioned skip and an unmarked cuda parameter."""
    src = tmp_path / "test_fake.py"
    src.write_text(
        "import pytest, torch\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
        "def test_a(): pass\n"
        "def test_b():\n"
        "    if not torch.cuda.is_available():\n"
        "        pytest.skip('no gpu')\n"
        "P = [pytest.param('cuda', id='cuda'), pytest.param('cuda', marks=pytest.mark.gpu)]\n"
    )
    got = _violations(src)
    assert len(got) == 3 and "skipif on CUDA" in got[0] and "pytest.skip under" in got[1] and "without marks" in got[2]


def test_the_marker_is_registered(pytestconfig):
    assert any(m.startswith("gpu:") for m in pytestconfig.getini("markers"))


@pytest.mark.gpu
def test_a_gpu_case_is_skipped_without_cuda_and_runs_with_it():
    import torch

    assert torch.cuda.is_available()  # reached only on a CUDA machine
