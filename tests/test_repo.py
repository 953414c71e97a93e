"""Repository contracts: CI runs the README's test command, the package layout and docs stay consistent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def _pytest_with_a_broken_mooncake(tmp_path, *args, env_extra=None):
    """Run pytest's collection of one small test file with a ``mooncake`` package whose engine cannot load."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "fake" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "engine.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    env = dict(os.environ)
    env.pop("DTKV_TEST_NO_MOONCAKE", None)
    env.update(PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]), **(env_extra or {}))
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_util.py"]
    return subprocess.run(cmd + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_an_installed_mooncake_whose_engine_does_not_load_fails_the_run_saying_how_to_fix_it(tmp_path):
    out = _pytest_with_a_broken_mooncake(tmp_path)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "the `mooncake` extra is installed but its transfer engine does not load" in text
    assert "libibverbs.so.1" in text and "apt-get install libibverbs1" in text and "DTKV_TEST_NO_MOONCAKE=1" in text


@pytest.mark.parametrize("how", ["env", "marker"])
def test_the_mooncake_check_can_be_turned_off_explicitly(tmp_path, how):
    if how == "env":
        out = _pytest_with_a_broken_mooncake(tmp_path, env_extra={"DTKV_TEST_NO_MOONCAKE": "1"})
    else:
        out = _pytest_with_a_broken_mooncake(tmp_path, "-m", "not mooncake")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
