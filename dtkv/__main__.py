"""``python -m dtkv`` and the ``dtkv`` console script: one entry point for the demo, capacity planning and the
benchmarks.

    dtkv --version                        # imports neither torch nor a kernel
    dtkv demo [demo options]              # = python -m dtkv.demo
    dtkv capacity [capacity options]      # = python -m dtkv.capacity
    dtkv bench                            # lists the benchmarks of a source checkout
    dtkv bench NAME [benchmark options]   # runs benchmarks/bench_NAME.py (torchrun -m dtkv bench NAME for N ranks)

Each subcommand's ``--help`` gives its options with their defaults and units.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

__all__ = ["BENCHMARKS", "main"]

BENCHMARKS: dict[str, str] = {
    "materialize": "full views vs the raw all-gather of the same bytes, both backends, overlap (torchrun, N GPUs)",
    "runtime": "the shipped Runtime, both adapters: chunked prefill tok/s and decode ms/step, GPU busy share, dtkv's "
    "part against the kernels alone, the roofline (one GPU; torchrun for N ranks; --smoke on CPU)",
    "decode": "replicated / full-view / sharded decode steps, eager and CUDA graphs: step time, bytes per step, the "
    "fp8 indexer's GB/s (torchrun, N GPUs; --quick; --smoke on CPU)",
    "hf_parity": "the transformers parity grid as one job (torchrun, NCCL or gloo)",
    "ops": "the custom ops against torch and the copy ceiling (one GPU)",
    "split": "host time of CP split planning (CPU)",
    "transfer": "PD transfer over Mooncake TCP loopback against one contiguous transfer (CPU)",
}
"""``dtkv bench NAME`` -> what ``benchmarks/bench_NAME.py`` measures (other ``bench_*.py`` scripts of the
checkout are listed too, with their docstring's first line)."""

_USAGE = """usage: dtkv [-h] [--version] {demo,capacity,bench} ...

dtkv: page-ownership-sharded KV caches for context-parallel prefill of sparse-attention LLMs.

subcommands:
  demo       2 gloo ranks (or torchrun's group): chunked CP prefill on sharded KV against the replicated
             baseline; --pd, --multi-turn, --model deepseek-v32|glm5 (dtkv demo --help)
  capacity   GiB of KV per rank, replicated vs sharded, and the view's scratch, for a model, cp and
             context; no allocation (dtkv capacity --help)
  bench      the benchmarks of a source checkout: `dtkv bench` lists them, `dtkv bench NAME --help` explains one

options:
  -h, --help  show this help message and exit
  --version   print the dtkv version and exit
"""


def _benchmarks_dir() -> Path | None:
    d = Path(__file__).resolve().parent.parent / "benchmarks"
    return d if (d / "_dist_bench.py").exists() else None


def _listed(where: Path | None) -> dict[str, str]:
    found = dict(BENCHMARKS)
    for script in sorted(where.glob("bench_*.py")) if where else []:
        name = script.stem.removeprefix("bench_")
        if name not in found:
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
            found[name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _bench(argv: list[str]) -> int:
    where = _benchmarks_dir()
    listed = _listed(where)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dtkv bench NAME [options]   (multi-rank: torchrun --nproc-per-node N -m dtkv bench NAME ...)\n")
        for name, what in listed.items():
            print(f"  {name:<12} {what}")
        print(f"\nbenchmarks directory: {where or 'not found (they ship in the source checkout, not the wheel)'}")
        return 0
    name = argv[0].removeprefix("bench_").removesuffix(".py")
    if name not in listed:
        print(f"dtkv bench: NAME must be one of {sorted(listed)}, got {argv[0]!r}", file=sys.stderr)
        return 2
    if where is None or not (where / f"bench_{name}.py").exists():
        print("dtkv bench: the benchmarks ship in the source checkout; install dtkv from one (pip install -e .)",
              file=sys.stderr)  # fmt: skip
        return 2
    script = where / f"bench_{name}.py"
    sys.argv = [str(script), *argv[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``dtkv`` command (see the module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        from dtkv._version import __version__

        print(f"dtkv {__version__}")
        return 0
    if cmd == "demo":
        from dtkv.demo import main as demo_main

        return demo_main(rest, prog="dtkv demo")
    if cmd == "capacity":
        from dtkv._capacity_cli import main as capacity_main

        return capacity_main(rest, prog="dtkv capacity")
    if cmd == "bench":
        return _bench(rest)
    print(_USAGE, end="", file=sys.stderr)
    print(f"dtkv: the subcommand must be one of demo, capacity, bench; got {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
