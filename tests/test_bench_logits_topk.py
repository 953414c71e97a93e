"""``benchmarks/bench_logits_topk.py`` on a CPU (the torch backend): every mode of every smoke case runs, the new
top-k's rows say it selects exactly what the packed path selects, the quantization's that the kernel path and the
reference agree, and the summary and the files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = [
    "packed",
    "logits_topk_exact",
    "logits_topk",
    "logits_topk_ranges",
    "keys_topk",
    "torch_f32",
    "quantize",
    "quantize_torch",
    "indexer_f32",
    "indexer_packed",
]


def test_smoke_rows(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_logits_topk.py"), "--smoke", "--out-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (jsonl,) = tmp_path.glob("logits_topk_cpux1_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["tokens"], r["mode"]) for r in rows] == [(t, m) for t in (5, 33) for m in MODES]
    for r in rows:
        assert r["ok"] and r["ms"] > 0 and {"context", "k", "visible_keys", "gbps", "peak_mem_gb"} <= set(r), r
    assert all(
        r["bitwise"]
        for r in rows
        if r["mode"] in ("logits_topk", "logits_topk_exact", "logits_topk_ranges", "keys_topk", "quantize_torch")
    )
    new = [r for r in rows if r["mode"] == "logits_topk"]
    assert all(r["vs_exact"] > 0 and r["group"] == 0 for r in new), new  # the torch backend: no groups
    assert all(r["group"] == 0 for r in rows if r["mode"] == "logits_topk_exact")
    assert "SUMMARY logits_topk vs the packed path" in res.stdout and "; 0 failed" in res.stdout
    assert (tmp_path / jsonl.name.replace(".jsonl", ".md")).exists()
