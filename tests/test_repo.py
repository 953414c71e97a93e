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
    for cmd in (demo_cmd, test_cmd):  # each does its own set-up, with PyTorch's CPU wheel
        assert (
            cmd.startswith("pip install torch==2.13.0 ")
            and "--extra-index-url https://download.pytorch.org/whl/cpu" in cmd
        )
    assert "python -m dtkv.demo" in demo_cmd
    assert "python -m pytest" in test_cmd and "-c .ci/constraints.txt" in test_cmd
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines, f"{test_cmd!r} is not a line of .ci/run"


def test_exact_pins_live_only_in_the_ci_constraints():
    """The library's requirements are ranges (it installs into serving environments); CI's exact versions sit in
    ``.ci/constraints.txt``. Triton is not a base dependency (torch's CUDA wheels bring their own)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert not [r for r in reqs if "==" in r.split(";")[0]], reqs  # markers may compare with ==
    assert not [r for r in project["dependencies"] if r.startswith("triton")]
    pins = (ROOT / ".ci" / "constraints.txt").read_text()
    assert "torch==2.13.0" in pins and "transformers==5.17.0" in pins


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
    readme = (ROOT / "docs" / "usage.md").read_text()
    readers = []
    for path in list((ROOT / "dtkv").rglob("*.py")) + list((ROOT / "ops").rglob("*.py")):
        text = path.read_text()
        for name in re.findall(r"[\"'](DTKV_[A-Z_]+)[\"']", text):
            readers.append((path.relative_to(ROOT).as_posix(), name))
            assert f"`{name}`" in readme, f"{name} (read in {path}) is missing from the table of docs/usage.md"
    assert {p for p, _ in readers} <= {"dtkv/_env.py"}, readers


def test_changelog_names_the_tested_torch_version():
    assert re.search(r"Tested with torch 2\.\d+", (ROOT / "CHANGELOG.md").read_text())


def test_changelog_keeps_an_unreleased_section_above_the_first_release():
    text = (ROOT / "CHANGELOG.md").read_text()
    heads = re.findall(r"^## \[(.+?)\]", text, re.M)
    assert heads[0] == "Unreleased" and heads[-1] == "0.1.0" and heads[1] == __import__("dtkv").__version__, heads
    first = text[text.index("## [0.1.0]") :]
    assert "### Deprecated" not in first  # 0.1.0 is the first release: nothing released before it to deprecate


def test_one_version_for_the_package_and_its_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    import dtkv
    from dtkv._version import __version__

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in meta["project"]["dynamic"] and "version" not in meta["project"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dtkv._version.__version__"}
    assert dtkv.__version__ == __version__ and re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)
    assert meta["project"]["license"] == "BSD-3-Clause" and (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause")


def test_python_m_dtkv_prints_the_version_and_lists_the_subcommands():
    import subprocess
    import sys

    import dtkv

    run = subprocess.run([sys.executable, "-m", "dtkv", "--version"], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == f"dtkv {dtkv.__version__}"
    text = subprocess.run([sys.executable, "-m", "dtkv", "--help"], capture_output=True, text=True, check=True).stdout
    assert all(f"  {cmd} " in text for cmd in ("demo", "capacity", "bench"))
    bench = subprocess.run([sys.executable, "-m", "dtkv", "bench"], capture_output=True, text=True, check=True).stdout
    assert all(name in bench for name in ("materialize", "split", "transfer", "hf_parity"))
    bad = subprocess.run([sys.executable, "-m", "dtkv", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "got 'nope'" in bad.stderr


def test_dtkv_version_imports_neither_torch_nor_a_kernel():
    """``dtkv --version`` took 6 s: ``import dtkv`` imported torch. The package's names now load on first use."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "dtkv", "--version"], capture_output=True,
                         text=True, check=True, timeout=120)  # fmt: skip
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in run.stderr.splitlines() if ln.startswith("import time:")}
    assert "dtkv" in imported and run.stdout.startswith("dtkv ")
    assert not {m for m in imported if m == "torch" or m.startswith(("torch.", "triton", "dtkv.ops"))}, imported


def test_every_public_name_and_submodule_of_dtkv_resolves_on_first_use():
    import subprocess
    import sys

    code = (
        "import sys, dtkv\n"
        "assert 'torch' not in sys.modules\n"
        "missing = [n for n in dtkv.__all__ if getattr(dtkv, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert dtkv.ops.remap and dtkv.materialize.Materializer and dtkv.page_table.seq_lens_from_indptr\n"
        "from dtkv import PageOwnership, plan_cp_split\n"
        "assert set(dtkv.__all__) <= set(dir(dtkv))\n"
        "try:\n    dtkv.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "module 'dtkv' has no attribute 'no_such_name'" in run.stdout


_BROKEN = {
    "mooncake": ("engine.py", "raise ImportError('libibverbs.so.1: cannot open shared object file')\n"),
    "nixl": ("_api.py", "raise ImportError('libucs.so.0: cannot open shared object file')\n"),
}


def _pytest_with_a_broken_mooncake(tmp_path, *args, env_extra=None, package="mooncake"):
    """Run pytest's collection of one small test file with a ``mooncake`` (or ``nixl``) package whose engine cannot
    load."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "fake" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    name, code = _BROKEN[package]
    (fake / name).write_text(code)
    env = dict(os.environ)
    env.pop("DTKV_TEST_NO_MOONCAKE", None)
    env.pop("DTKV_TEST_NO_NIXL", None)
    env.update(PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]), **(env_extra or {}))
    pytest = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider"]  # -n 0: no xdist workers
    cmd = [*pytest, "--collect-only", "-q", "tests/test_util.py"]
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


def test_an_installed_nixl_that_does_not_load_fails_the_run_saying_how_to_fix_it(tmp_path):
    out = _pytest_with_a_broken_mooncake(tmp_path, package="nixl")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "the `nixl` extra is installed but NIXL does not load" in text
    assert "libucs.so.0" in text and "DTKV_TEST_NO_NIXL=1" in text and '-m "not nixl"' in text


@pytest.mark.parametrize("how", ["env", "marker"])
def test_the_nixl_check_can_be_turned_off_explicitly(tmp_path, how):
    if how == "env":
        out = _pytest_with_a_broken_mooncake(tmp_path, package="nixl", env_extra={"DTKV_TEST_NO_NIXL": "1"})
    else:
        out = _pytest_with_a_broken_mooncake(tmp_path, "-m", "not nixl", package="nixl")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_performance_page_links_every_results_file_and_shows_every_plot():
    page = (ROOT / "docs" / "performance.md").read_text()
    for f in sorted((ROOT / "benchmarks" / "results").iterdir()):
        if f.suffix == ".png":
            assert re.search(rf"!\[[^\]]+\]\(\.\./benchmarks/results/{re.escape(f.name)}\)", page), (
                f"{f.name} is not shown"
            )
        else:
            assert f"[{f.name}](path:../benchmarks/results/{f.name})" in page, f"{f.name} is not linked"


def test_docs_have_an_install_page_and_the_one_line_checkpoint_recipe():
    install = (ROOT / "docs" / "install.md").read_text()
    assert "install\n" in (ROOT / "docs" / "index.md").read_text() and "pip install torch==2.13.0" in install
    recipe = "tiny_model('deepseek-v32').save_pretrained('ckpt')"
    for doc in ("docs/install.md", "docs/usage.md", "docs/transformers.md", "README.md"):
        assert recipe in (ROOT / doc).read_text(), doc


def _structure():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dtkv_structure", ROOT / "tools" / "structure.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_package_depends_only_on_the_floors_below_it_and_no_import_is_circular():
    """``tools/structure.py`` reads every import of ``dtkv/`` and ``ops/`` (``TYPE_CHECKING`` ones too): no room
    imports a room on its own floor or a higher one, every room stands on one floor, no modules import each other in
    a circle."""
    r = _structure().read()
    assert r["back_arrows"] == [] and r["unplaced"] == [] and r["circles"] == [], r


def test_the_structure_check_finds_a_back_arrow_a_circle_and_a_room_on_no_floor(tmp_path):
    """The check can fail: a low room importing a high one, a circle through a ``TYPE_CHECKING`` import (0.1's
    ``runtime/adapter`` -> ``context`` -> ``runtime``), a module on no floor."""
    files = {
        "dtkv/__init__.py": "",
        "dtkv/low.py": "from dtkv.high import f\n",
        "dtkv/high.py": "def f(): pass\n",
        "dtkv/extra.py": "",
        "dtkv/pkg/__init__.py": "",
        "dtkv/pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtkv.pkg.b import B\n",
        "dtkv/pkg/b.py": "from dtkv.pkg import a\n",
        "dtkv/script.py": "if __name__ == '__main__':\n    from dtkv.high import f\n",  # a script's entry: no arrow
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "ops").mkdir()
    floors = (("low", "script"), ("high", "pkg"), ("dtkv",))
    r = _structure().read(tmp_path, floors)
    assert r["back_arrows"] == ["low (floor 0) -> high (floor 1): dtkv.low line 1 imports dtkv.high"]
    assert r["circles"] == [["dtkv.pkg.a", "dtkv.pkg.b"]] and r["unplaced"] == ["extra"]


def _ranges():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ci_ranges", ROOT / ".ci" / "ranges.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_tests_every_declared_range_at_both_ends():
    """``.ci/ranges.py check`` holds (every pinned end inside its range, the oldest at each floor), ``.ci/run``
    runs both ends, and each end runs the files that touch what differs there: the newest end (transformers,
    Triton) a transformers test and a Triton op test but no file that touches neither, the oldest (torch) all."""
    pytest.importorskip("tomllib")  # Python >= 3.11
    r = _ranges()
    assert r.check() == 0
    run = (ROOT / ".ci" / "run").read_text()
    assert "ranged newest" in run and "ranged oldest" in run and "python .ci/ranges.py check" in run
    newest, oldest = r.tests("newest"), r.tests("oldest")
    assert {"tests/test_integration_transformers.py", "tests/test_ops_write_owned.py"} <= set(newest)
    assert "tests/test_split.py" not in newest and "tests/test_transfer_wire.py" not in newest
    assert oldest == sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    oldest_pins = r.pins(ROOT / ".ci" / "constraints-oldest.txt")
    assert oldest_pins["torch"][0] == "2.11.0" and oldest_pins["triton"][0] == "3.6.0"


def test_a_range_end_outside_its_range_is_refused(tmp_path, monkeypatch, capsys):
    """An oldest pin below a floor (or not at it) and a newest pin past a range's top fail ``check``, naming it."""
    pytest.importorskip("tomllib")
    r = _ranges()
    ci = tmp_path / ".ci"
    ci.mkdir()
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (ci / "constraints.txt").write_text((ROOT / ".ci" / "constraints.txt").read_text())
    newest = (ROOT / ".ci" / "constraints-newest.txt").read_text()
    oldest = (ROOT / ".ci" / "constraints-oldest.txt").read_text()
    monkeypatch.setattr(r, "ROOT", tmp_path)
    for new, old, want in (
        (newest.replace("transformers==5.24.0", "transformers==6.0.0"), oldest, "transformers==6.0.0 in"),
        (newest, oldest.replace("torch==2.11.0", "torch==2.12.0"), "not its floor 2.11"),
        (newest, oldest.replace("numpy==1.24.4", "numpy==1.23.5"), "numpy==1.23.5 in"),
    ):
        (ci / "constraints-newest.txt").write_text(new)
        (ci / "constraints-oldest.txt").write_text(old)
        assert r.check() == 1
        assert want in capsys.readouterr().out
