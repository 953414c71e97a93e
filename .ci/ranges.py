"""The declared dependency ranges at both ends: which versions CI tests, and which tests touch each dependency.

``pyproject.toml`` keeps ranges (dtkv installs into existing serving environments); ``.ci/constraints.txt`` pins the
versions of the main test run; ``.ci/constraints-newest.txt`` and ``.ci/constraints-oldest.txt`` hold the newest and
the oldest versions the ranges allow, where CI can install them. ``.ci/run`` runs the tests again on each of those
two, in a venv of its own, but only the test files that touch a dependency whose version there differs from the
main run's (every file touches torch and numpy; a file touches transformers, Triton or Mooncake when its text names
it, or names the parametrization that brings it in: ``ADAPTERS`` of ``tests/_runtime.py`` (both model adapters),
``BACKENDS`` of ``tests/ops_reference.py`` (both op backends)).

Commands (``python .ci/ranges.py ...``; no network unless said):

- ``check``: every version in the two files lies inside its range, and the oldest file's is the range's floor (or
  the reason it is not is written beside it); exits 1 naming the first that does not.
- ``tests newest|oldest``: the test files to run on that end, one a line (nothing when it equals the main run).
- ``versions``: the installed version of each ranged dependency, one line (for the log).
- ``newer``: asks the package index (``pip index versions``) for the newest release inside each range and prints a
  ``NOTE`` for each one newer than ``constraints-newest.txt`` (bump the pin there once it is green); never fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RANGED = {
    # distribution name -> (where pyproject.toml declares it, regex naming it in a test file; None: every file)
    "torch": ("dependencies", None),
    "numpy": ("dependencies", None),
    "transformers": ("optional-dependencies.hf", r"\btransformers\b|\bADAPTERS\b"),
    "safetensors": ("optional-dependencies.hf", r"\btransformers\b|\bADAPTERS\b|\bsafetensors\b"),
    "triton": ("optional-dependencies.test", r"\btriton\b|TRITON_INTERPRET|\bBACKENDS\b"),
    "mooncake-transfer-engine-non-cuda": ("optional-dependencies.mooncake", r"(?i)mooncake"),
}
"""The dependencies whose declared range CI tests at both ends (the test tools' ranges are not the library's)."""

ENDS = ("newest", "oldest")


def _requirement(name: str):
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    where = RANGED[name][0]
    reqs = project["dependencies"] if where == "dependencies" else project["optional-dependencies"][where.split(".")[1]]
    for text in reqs:
        req = Requirement(text)
        if req.name == name:
            return req
    raise SystemExit(f"ranges: {name} is not declared in pyproject.toml's {where}")


def pins(path: Path) -> dict[str, tuple[str, str]]:
    """``{name: (version, comment)}`` of a constraints file's ``name==version`` lines (markers dropped)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)==([^;#\s]+)[^#]*(?:#\s*(.*))?$", line)
        if m:
            out[m.group(1).lower()] = (m.group(2), m.group(3) or "")
    return out


def check() -> int:
    from packaging.version import Version

    main = pins(ROOT / ".ci" / "constraints.txt")
    for end in ENDS:
        got = pins(ROOT / ".ci" / f"constraints-{end}.txt")
        for name in RANGED:
            if name not in got:
                print(f"ranges: .ci/constraints-{end}.txt must pin {name} (a ranged dependency)")
                return 1
            version, why = got[name]
            spec = _requirement(name).specifier
            if not spec.contains(version, prereleases=True):
                print(f"ranges: {name}=={version} in .ci/constraints-{end}.txt is outside pyproject.toml's {spec}")
                return 1
            floors = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
            floor = max(floors, default=None)
            # a floor written ">=1.24" is the 1.24 series: its first release or a patch release of it
            series = floor is not None and Version(version).release[: len(floor.release)] == floor.release
            if end == "oldest" and floor is not None and not series and not why:
                print(
                    f"ranges: .ci/constraints-oldest.txt pins {name}=={version}, not its floor {floor}: "
                    "pin the floor, narrow the range, or say why beside the pin"
                )
                return 1
        for name, (version, _) in main.items():
            if name in RANGED and name in got and end == "newest" and Version(got[name][0]) < Version(version):
                print(f"ranges: .ci/constraints-newest.txt pins {name}=={got[name][0]}, older than the main run's")
                return 1
    return 0


def touches(pattern: str | None) -> list[str]:
    """The test files whose text matches ``pattern`` (``None``: every test file)."""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    return [p.relative_to(ROOT).as_posix() for p in tests if pattern is None or re.search(pattern, p.read_text())]


def tests(end: str) -> list[str]:
    """The test files to run at ``end``: those touching a dependency whose version there differs from the main
    run's (a dependency the main run does not pin gets the newest there, so only its oldest differs)."""
    main = pins(ROOT / ".ci" / "constraints.txt")
    got = pins(ROOT / ".ci" / f"constraints-{end}.txt")
    files: set[str] = set()
    for name, (_, pattern) in RANGED.items():
        here = main.get(name, (None,))[0]
        if here is None and end == "newest":
            continue
        if got[name][0] != here:
            files.update(touches(pattern))
    return sorted(files)


def versions() -> str:
    out = []
    for name in RANGED:
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return "; ".join(out)


def newer() -> int:
    from packaging.version import InvalidVersion, Version

    got = pins(ROOT / ".ci" / "constraints-newest.txt")
    for name in RANGED:
        spec = _requirement(name).specifier
        try:
            run = subprocess.run(
                [sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            print(f"ranges: the package index did not answer for {name} within 60 s")
            continue
        m = re.search(r"Available versions: (.*)", run.stdout)
        if not m:
            print(f"ranges: the package index gave no versions of {name}")
            continue
        releases = []
        for v in m.group(1).split(","):
            try:
                releases.append(Version(v.strip()))
            except InvalidVersion:
                continue
        inside = [v for v in releases if spec.contains(v) and not v.is_prerelease]
        newest = max(inside, default=None)
        pinned = Version(got[name][0])
        if newest is not None and Version(newest.public) > Version(pinned.public):
            print(
                f"NOTE ranges: {name} {newest} is inside pyproject.toml's {spec} and newer than the {pinned} "
                f"CI tests (.ci/constraints-newest.txt{': ' + got[name][1] if got[name][1] else ''})"
            )
    return 0


def main(argv: list[str]) -> int:
    if argv == ["check"]:
        return check()
    if len(argv) == 2 and argv[0] == "tests" and argv[1] in ENDS:
        print("\n".join(tests(argv[1])))
        return 0
    if argv == ["versions"]:
        print(versions())
        return 0
    if argv == ["newer"]:
        return newer()
    print("usage: python .ci/ranges.py check | tests newest|oldest | versions | newer", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
