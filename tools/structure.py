"""The package's structure, read from its source: rooms, floors, import arrows, circles (``python tools/structure.py``).

A *room* is a top-level module of ``dtkv`` (``dtkv/pool.py``: ``pool``) or a subpackage (``dtkv/runtime/``:
``runtime``; ``ops/``, installed as ``dtkv.ops``: ``ops``). Every import of one dtkv module by another is an
arrow -- at module level, inside a function, or under ``if TYPE_CHECKING:`` alike (a script's
``if __name__ == "__main__":`` block is not the module's dependency and is skipped). The rooms stand on the
floors of :data:`FLOORS`, the bottom first: each package depends only on the layers below it. The checks
(``tests/test_repo.py`` runs them):

- every room stands on exactly one floor, and no arrow goes to a room on its own floor or a higher one (a
  *back-arrow*);
- no import circle among modules (inside a room too: ``runtime/adapter`` -> ``context`` -> ``runtime`` would be
  one, ``TYPE_CHECKING`` imports included).

``python tools/structure.py`` prints the floors, the arrows between rooms and what fails (exit status 1), or
``--json`` the counts.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FLOORS: tuple[tuple[str, ...], ...] = (
    ("_checks", "_collectives", "_env", "_journal", "_names", "_util", "_version"),
    ("_agree", "_log", "layouts", "ownership", "page_table"),
    ("_scratch", "_startup", "allocator", "debug", "ops", "pool"),
    ("attention", "capacity", "kvio", "materialize", "prefix_cache", "split", "transfer"),
    ("_capacity_cli", "decode", "dtkv"),
    ("runtime",),
    ("integrations", "model"),
    ("demo",),
    ("__main__",),
)
"""Rooms by floor, the bottom first (``dtkv`` is the package's ``__init__``): each room on the lowest floor its
imports allow, so a new arrow either fits or says which room must move."""


def module_name(path: Path, root: Path = ROOT) -> str:
    """``dtkv/runtime/pd.py`` -> ``dtkv.runtime.pd``; ``ops/remap.py`` -> ``dtkv.ops.remap``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "ops":
        parts = ["dtkv", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return "dtkv" if len(parts) == 1 else parts[1]


def _sources(root: Path) -> dict[str, Path]:
    files = [*(root / "dtkv").rglob("*.py"), *(root / "ops").rglob("*.py")]
    return {module_name(f, root): f for f in sorted(files) if "dtkv/ops" not in f.relative_to(root).as_posix()}


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def _imports(tree: ast.AST, module: str, is_package: bool):
    """Every ``dtkv`` module name an import statement of ``tree`` names (with its line)."""
    package = module if is_package else module.rpartition(".")[0]
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if _is_main_guard(child):
                continue
            todo.append(child)
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, child.lineno
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                yield src, child.lineno
                for a in child.names:
                    yield f"{src}.{a.name}", child.lineno


def arrows(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported dtkv module: first line}: imports resolved to the modules they load."""
    sources = _sources(root)
    out: dict[str, dict[str, int]] = {}
    for mod, path in sources.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found: dict[str, int] = {}
        for name, line in _imports(tree, mod, path.name == "__init__.py"):
            while name and name not in sources:  # `from dtkv.x import f`: the module is dtkv.x
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):  # a module's own package is loaded anyway
                found.setdefault(name, line)
        out[mod] = found
    return out


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def read(root: Path = ROOT, floors: tuple[tuple[str, ...], ...] = FLOORS) -> dict[str, object]:
    """The structure of the tree at ``root`` and what breaks its rules: ``rooms``, ``floors``, ``room_arrows``,
    ``back_arrows``, ``unplaced`` (rooms on no floor, or on several, or floors naming no room), ``circles``."""
    graph = arrows(root)
    floor: dict[str, int] = {}
    twice = []
    for i, rooms in enumerate(floors):
        for r in rooms:
            if r in floor:
                twice.append(r)
            floor[r] = i
    rooms = sorted({room_of(m) for m in graph})
    room_arrows: dict[tuple[str, str], tuple[str, str, int]] = {}
    for mod, targets in graph.items():
        for dst, line in targets.items():
            a, b = room_of(mod), room_of(dst)
            if a != b:
                room_arrows.setdefault((a, b), (mod, dst, line))
    back = [
        f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]}): {mod} line {line} imports {dst}"
        for (a, b), (mod, dst, line) in sorted(room_arrows.items())
        if a in floor and b in floor and floor[b] >= floor[a]
    ]
    unplaced = sorted({r for r in rooms if r not in floor} | set(twice) | {r for r in floor if r not in rooms})
    return {
        "rooms": rooms,
        "floors": [list(f) for f in floors],
        "modules": len(graph),
        "module_arrows": sum(len(t) for t in graph.values()),
        "room_arrows": sorted(f"{a} -> {b}" for a, b in room_arrows),
        "back_arrows": back,
        "unplaced": unplaced,
        "circles": circles(graph),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the counts and the findings as one JSON object")
    args = ap.parse_args(argv)
    r = read()
    bad = bool(r["back_arrows"] or r["unplaced"] or r["circles"])
    if args.json:
        print(json.dumps({**r, "num_rooms": len(r["rooms"]), "num_floors": len(FLOORS), "ok": not bad}, indent=1))
        return int(bad)
    by_room = defaultdict(list)
    for arrow in r["room_arrows"]:
        a, b = arrow.split(" -> ")
        by_room[a].append(b)
    for i, rooms in reversed(list(enumerate(FLOORS))):
        print(f"floor {i:2d}: " + "; ".join(f"{x} -> {', '.join(sorted(by_room[x])) or '-'}" for x in rooms))
    print(f"{len(r['rooms'])} rooms on {len(FLOORS)} floors, {r['modules']} modules, {r['module_arrows']} imports")
    for key in ("back_arrows", "unplaced", "circles"):
        print(f"{key}: {len(r[key])}")
        for item in r[key]:
            print(f"  {item}")
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
