"""Repository contracts: CI runs the README's test command, the package layout and docs stay consistent."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    demo_cmd, test_cmd = _readme_commands()
    assert "python -m dtkv.demo" in demo_cmd
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, f"{test_cmd!r} is not a line of .ci/run"


def test_ops_ship_as_a_subpackage_not_a_top_level_module(tmp_path):
    """From outside the checkout, the installed package has ``dtkv.ops`` (from ``ops/``) and no top-level ``ops``."""
    import subprocess
    import sys

    code = "import importlib.util, dtkv.ops; print(dtkv.ops.__file__); print(importlib.util.find_spec('ops') is None)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    ops_file, no_top_level = out.stdout.split()
    assert Path(ops_file).resolve().parent == ROOT / "ops"
    assert no_top_level == "True"


def test_every_env_var_is_read_in_one_place_and_documented():
    readme = (ROOT / "README.md").read_text()
    readers = []
    for path in list((ROOT / "dtkv").rglob("*.py")) + list((ROOT / "ops").rglob("*.py")):
        text = path.read_text()
        for name in re.findall(r"[\"'](DTKV_[A-Z_]+)[\"']", text):
            readers.append((path.relative_to(ROOT).as_posix(), name))
            assert f"`{name}`" in readme, f"{name} (read in {path}) is missing from the README table"
    assert {p for p, _ in readers} <= {"dtkv/_env.py"}, readers


def test_changelog_names_the_tested_torch_version():
    assert re.search(r"Tested with torch 2\.\d+", (ROOT / "CHANGELOG.md").read_text())
