"""Execute the tutorials in place and save them with their outputs (run from the repository root):

    python tools/execute_tutorials.py [tutorials/01_ownership_and_pools.ipynb ...]

Each notebook runs in a scratch working directory (nothing lands in tutorials/ but the notebook itself), top to
bottom, with the CPU Triton interpreter, and is written back with outputs and inline figures. The test suite
re-executes them in memory (tests/test_tutorials.py) and checks they are committed executed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted((ROOT / "tutorials").glob("*.ipynb"))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        with tempfile.TemporaryDirectory() as scratch:
            resources = {"metadata": {"path": scratch}}
            nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources).execute()
        nbformat.write(nb, path)
        print(f"executed {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
