"""``benchmarks/bench_keys_topk.py`` on a CPU, the kernels under the interpreter: both modes of every smoke case
and the sweep run, the kernel path's rows say it selects exactly what the packed path selects, and the summary
and the files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.ops_reference import skip_unless

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_rows(tmp_path):
    skip_unless("triton", "cpu")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_keys_topk.py"), "--smoke", "--sweep",
           "--out-dir", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (jsonl,) = tmp_path.glob("keys_topk_cpux1_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    modes = [(r["rows"], r["context"], r["mode"]) for r in rows]
    assert modes == [(1, 37, "packed"), (1, 37, "keys_topk"), (3, 300, "packed"), (3, 300, "keys_topk"),
                     (3, 300, "sweep"), (3, 300, "sweep")]  # fmt: skip
    for r in rows:
        assert r["ok"] and r["ms"] > 0 and r["k"] == 2048, r
    assert all(r["bitwise"] for r in rows if r["mode"] != "packed")
    assert "SUMMARY keys_topk vs the packed path" in res.stdout and "; 0 failed" in res.stdout
    assert (tmp_path / jsonl.name.replace(".jsonl", ".md")).exists()
