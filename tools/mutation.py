"""Time-boxed mutation testing of the modules whose bugs corrupt data silently (mutmut 3, outside CI).

    pip install -e ".[test,mutation]"
    python tools/mutation.py                          # every target, 90 minutes in all
    python tools/mutation.py allocator split --budget-min 20
    python tools/mutation.py --tests-ref main         # the same mutants against another commit's tests/
    python tools/mutation.py --resume                 # re-run the last run's survivors against today's tests

mutmut 3 names a mutant after its file's path and activates it by comparing that name with the running
function's ``__module__``, so ``ops/`` (shipped as ``dtkv.ops`` through a package-dir mapping) must sit at
``dtkv/ops/`` for its mutants to be reached. Each target therefore runs in its own scratch copy
(``<workdir>/<target>/``: ``dtkv/`` with ``ops/`` copied into ``dtkv/ops/``, ``tests/``, ``pyproject.toml`` with
a generated ``[tool.mutmut]`` table) and never touches the checkout. A target names the files it mutates, an
optional glob over mutant names (the ``ops`` target keeps only the torch references) and the fast test files
that exercise it; mutmut then runs, per mutant, only the selected tests that called the mutated function.
Multi-rank, Mooncake, slow, compile and Triton tests are deselected: each costs seconds to minutes per mutant
(the collective paths of ``materialize`` are therefore reported as "no tests").

The budget is shared by the targets in order, each getting a fair share of what is left (``timeout``); mutmut
runs the cheapest mutants first and the ones not reached count as not checked. The kill ratio is
``(killed + timeout) / (killed + timeout + survived + no tests)`` per file; the summary is printed as a markdown
table and written to ``<workdir>/summary.json``, the survivors' diffs to ``<workdir>/<target>/survivors.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["-m", "not multirank and not mooncake and not slow", "-k", "not compile and not triton"]
PYTEST_ARGS = ["-p", "no:cacheprovider", "--no-showlocals", "--tb=line", "-W", "ignore"]


@dataclass(frozen=True, kw_only=True)
class Target:
    """One mutmut run: the files it mutates, the mutants it keeps and the tests it runs."""

    files: tuple[str, ...]
    """Paths in the scratch layout (``dtkv/ops/x.py`` for ``ops/x.py``)."""
    tests: tuple[str, ...]
    """Test files (missing ones are dropped, so an older ``--tests-ref`` still runs)."""
    mutants: tuple[str, ...] = field(default=())
    """Globs over mutant names (``dtkv.ops.remap.x_remap_torch__mutmut_3``); empty keeps all."""


_OPS = ("direct_write", "pack_owned_pages", "quantize_write_indexer_fp8", "quantize_write_mla_fp8", "remap")
TARGETS: dict[str, Target] = {
    "allocator": Target(
        files=("dtkv/allocator.py",),
        tests=("tests/test_allocator.py", "tests/test_allocator_owners.py", "tests/test_allocator_inputs.py"),
    ),
    "ownership": Target(
        files=("dtkv/ownership.py",),
        tests=(
            "tests/test_ownership.py",
            "tests/test_ownership_contracts.py",
            "tests/test_allocator.py",
            "tests/test_allocator_owners.py",
        ),
    ),
    "materialize": Target(
        files=("dtkv/materialize/_plan.py", "dtkv/materialize/_views.py"),
        tests=("tests/test_materialize.py", "tests/test_materialize_single_rank.py"),
    ),
    "transfer": Target(
        files=("dtkv/transfer/plan.py", "dtkv/transfer/coalesce.py"),
        tests=("tests/test_transfer_coalesce.py", "tests/test_transfer_plan.py", "tests/test_transfer_descriptors.py"),
    ),
    "ops": Target(
        files=tuple(f"dtkv/ops/{m}.py" for m in ("_common", "write_owned", *_OPS)),
        tests=tuple(f"tests/test_ops_{m}.py" for m in ("common", "write_owned", *_OPS, "unvalidated_writes")),
        mutants=("dtkv.ops.*.x_*_torch__mutmut_*", "dtkv.ops.*.x_quantize_indexer_fp8__mutmut_*"),
    ),
    "split": Target(
        files=tuple(f"dtkv/split/{m}.py" for m in ("_plan", "_compute", "_alloc", "_local", "_index")),
        tests=(
            "tests/test_split.py",
            "tests/test_split_compute.py",
            "tests/test_split_properties.py",
            "tests/test_split_reference.py",
            "tests/test_split_index.py",
            "tests/test_split_local.py",
        ),
    ),
}

# mutmut 3 exit codes (mutmut.stats.status_by_exit_code)
_KILLED, _TIMEOUT, _SURVIVED, _NO_TESTS = {1, 3}, {36, 24, -24, 152, 255}, {0}, {5, 33}


def _toml_list(values) -> str:
    return "[" + ", ".join(json.dumps(str(v)) for v in values) + "]"


def _scratch(name: str, target: Target, workdir: Path, tests_ref: str | None) -> Path:
    """A fresh copy of the package in the layout mutmut needs, with this target's ``[tool.mutmut]``."""
    dest = workdir / name
    shutil.rmtree(dest, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    top = shutil.ignore_patterns("__pycache__", "*.pyc", "ops")  # a checkout's dtkv/ops symlink
    shutil.copytree(
        ROOT / "dtkv", dest / "dtkv", ignore=lambda d, n: (top if Path(d) == ROOT / "dtkv" else ignore)(d, n)
    )
    shutil.copytree(ROOT / "ops", dest / "dtkv" / "ops", ignore=ignore)
    if tests_ref:
        archive = subprocess.run(["git", "archive", tests_ref, "tests"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    tests = [t for t in target.tests if (dest / t).exists()]
    pyproject = re.sub(r"\n\[tool\.mutmut\][^\[]*", "\n", (ROOT / "pyproject.toml").read_text())
    pyproject += (
        "\n[tool.mutmut]\n"
        'source_paths = ["dtkv"]\n'
        f"only_mutate = {_toml_list(target.files)}\n"
        f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
        f"pytest_add_cli_args = {_toml_list(FAST + PYTEST_ARGS)}\n"
        'process_isolation = "forkserver"\n'
        "timeout_multiplier = 3.0\n"
        "timeout_constant = 40.0\n"
    )
    (dest / "pyproject.toml").write_text(pyproject)
    return dest


def _tally(scratch: Path, target: Target) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Per file: killed / timeout / survived / no tests / not checked; and each survivor's bucket."""
    from fnmatch import fnmatch

    per_file, survivors = {}, {}
    for f in target.files:
        meta = scratch / "mutants" / (f + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        c = dict(killed=0, timeout=0, survived=0, no_tests=0, not_checked=0)
        for key, code in codes.items():
            if target.mutants and not any(fnmatch(key, g) for g in target.mutants):
                continue
            bucket = (
                "killed" if code in _KILLED else "timeout" if code in _TIMEOUT else "survived" if code in _SURVIVED
                else "no_tests" if code in _NO_TESTS else "not_checked"
            )  # fmt: skip
            c[bucket] += 1
            if bucket in ("survived", "no_tests"):
                survivors[key] = bucket
        per_file[f] = c
    return per_file, survivors


_SHOW = """
import sys
from mutmut.__main__ import find_mutant, get_diff_for_mutant
for name in sys.argv[1:]:
    print(f"### {name}\\n```diff\\n{get_diff_for_mutant(name, path=find_mutant(name).path).strip()}\\n```\\n")
"""


_RETRY = """
import json, os, signal, sys
import pytest
names, files, args, limit = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
def _expire(*_):
    raise TimeoutError(f"mutant still running after {limit} s")
signal.signal(signal.SIGALRM, _expire)
done = {}
for name in names:
    os.environ["MUTANT_UNDER_TEST"] = name
    signal.alarm(limit)
    try:
        done[name] = int(pytest.main(["--rootdir=.", "-x", "-q", *args, *files]))
    finally:
        signal.alarm(0)
    with open("retry.json", "w") as f:
        json.dump(done, f)
"""


def _retry(scratch: Path, target: Target, prev: dict, left: int, env: dict) -> tuple[int, dict, dict]:
    """``--resume``: each survivor of ``prev`` against the test files added or changed since (in one process).

    A survivor passed every test of the previous run, so with deterministic tests it is killed now exactly when
    one of the new or changed test files fails; mutants killed before stay killed. ``<scratch>/tests`` keeps the
    tests the survivors were last tried against; a run cut short by the budget leaves it as it was.
    """
    old = scratch / "tests"
    changed = [t for t in target.tests if (ROOT / t).exists()
               and (not (scratch / t).exists() or (scratch / t).read_bytes() != (ROOT / t).read_bytes())]  # fmt: skip
    shutil.rmtree(scratch / "mutants" / "tests", ignore_errors=True)
    shutil.copytree(
        ROOT / "tests", scratch / "mutants" / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    (scratch / "mutants" / "retry.json").unlink(missing_ok=True)
    before = prev["survivors"] if isinstance(prev["survivors"], dict) else _tally(scratch, target)[1]
    names = list(before)
    rc = 0
    if changed and names:
        cmd = ["timeout", "--signal=INT", "--kill-after=30", str(left), sys.executable, "-c", _RETRY,
               json.dumps(names), json.dumps(changed), json.dumps(FAST + PYTEST_ARGS), "300"]  # fmt: skip
        with open(scratch / "retry.log", "w") as log:
            rc = subprocess.run(cmd, cwd=scratch / "mutants", env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc == 0:
        shutil.rmtree(old)
        shutil.copytree(scratch / "mutants" / "tests", old)
    record = scratch / "mutants" / "retry.json"
    done = json.loads(record.read_text()) if record.exists() else {}
    per_file = {f: dict(c) for f, c in prev["files"].items()}
    survivors = {}
    for name, bucket in before.items():
        f = next(f for f in target.files if name.startswith(f[:-3].replace("/", ".") + ".x"))
        if done.get(name) in (1, 2, 3):  # a failed test, an interrupted or broken collection: killed
            per_file[f][bucket] -= 1
            per_file[f]["killed"] += 1
        else:
            survivors[name] = bucket
    return rc, per_file, survivors


def _ratio(c: dict[str, int]) -> str:
    tried = c["killed"] + c["timeout"] + c["survived"] + c["no_tests"]
    return f"{(c['killed'] + c['timeout']) / tried:.0%}" if tried else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="*", help=f"targets to run, of {', '.join(TARGETS)} (default: all)")
    p.add_argument("--budget-min", type=float, default=90.0, help="wall-clock budget, shared fairly by the targets")
    p.add_argument("--max-children", type=int, default=1, help="mutants run in parallel (the CPU is shared)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dtkv-mutation")
    p.add_argument("--tests-ref", help="take tests/ from this git commit instead of the working tree")
    p.add_argument(
        "--resume",
        action="store_true",
        help="retry the last run's survivors in --workdir against the test files added or changed since, in one "
        "process (valid when tests were only added: the mutants killed before stay killed)",
    )
    args = p.parse_args(argv)
    names = args.targets or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"targets must be among {list(TARGETS)}, got {unknown}")
    summary_path = args.workdir / "summary.json"
    previous = json.loads(summary_path.read_text()) if args.resume and summary_path.exists() else {}
    if args.resume:
        names = [n for n in names if n in previous]
    args.workdir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.budget_min
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("MUTANT_UNDER_TEST", None)
    summary = dict(previous) if args.resume else {}
    for i, name in enumerate(names):
        target = TARGETS[name]
        left = int((deadline - time.monotonic()) / (len(names) - i))  # a fair share; unused time rolls over
        if left < 60:
            print(f"{name}: skipped, the budget is spent", flush=True)
            continue
        prev = previous.get(name)
        if prev is not None and not prev["survivors"]:
            continue
        start = time.monotonic()
        if prev is None:
            scratch = _scratch(name, target, args.workdir, args.tests_ref)
            cmd = ["timeout", "--signal=INT", "--kill-after=30", str(left), sys.executable, "-m", "mutmut", "run",
                   "--max-children", str(args.max_children), *target.mutants]  # fmt: skip
            with open(scratch / "mutmut.log", "w") as log:
                rc = subprocess.run(cmd, cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            per_file, survivors = _tally(scratch, target)
        else:
            scratch = args.workdir / name
            rc, per_file, survivors = _retry(scratch, target, prev, left, env)
        if survivors:
            show = subprocess.run([sys.executable, "-c", _SHOW, *survivors], cwd=scratch, env=env, capture_output=True,
                                  text=True)  # fmt: skip
            (scratch / "survivors.md").write_text(show.stdout + show.stderr)
        seconds = round(time.monotonic() - start)
        summary[name] = dict(rc=rc, seconds=seconds, files=per_file, survivors=survivors)
        summary_path.write_text(json.dumps(summary, indent=2))
        print(f"{name}: exited {rc} after {seconds} s, {len(survivors)} survivors (in {scratch})", flush=True)
    print("\n| file | killed | timeout | survived | no tests | not checked | kill ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for res in summary.values():
        for f, c in res["files"].items():
            cells = " | ".join(str(c[k]) for k in ("killed", "timeout", "survived", "no_tests", "not_checked"))
            print(f"| `{f}` | {cells} | {_ratio(c)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
