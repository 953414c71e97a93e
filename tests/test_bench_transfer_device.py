"""``benchmarks/bench_transfer.py --device cpu --smoke --stage always``: the device hand-off benchmark runs end to end
on CPU (the host windows forced, a decode process over Mooncake), every row verified bitwise, the rows written as
``transfer_cpux1_<date>.jsonl`` with the keys the GPU run reports (``--device cuda`` on one H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"case", "device", "cp_p", "cp_d", "round_pages", "rounds", "staged_prefill", "staged_decode", "bytes",
        "e2e_ms", "gb_s", "d2d_ms", "d2d_gb_s", "host_gb_s", "ratio", "verified"}  # fmt: skip


@pytest.mark.mooncake
@pytest.mark.slow  # a decode process starts torch and Mooncake: ~40 s on 2 cores
def test_the_device_handoff_benchmark_runs_on_cpu_and_verifies_every_row(tmp_path):
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--device", "cpu", "--smoke",
                          "--stage", "always", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, check=False, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    files = list(tmp_path.glob("transfer_cpux1_*.jsonl"))
    assert len(files) == 1 and files[0].with_suffix(".md").exists()
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(rows) == 2 and all(KEYS <= set(r) for r in rows), rows
    assert all(r["verified"] and r["staged_prefill"] and r["staged_decode"] and r["gb_s"] > 0 for r in rows)
    assert rows[1]["rounds"] > 1 and rows[1]["round_pages"] == 16  # the many-rounds row goes through both slots
