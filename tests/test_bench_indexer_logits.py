"""``benchmarks/bench_indexer_logits.py`` on a CPU: the smoke run (torch, and the kernel under the interpreter)
writes checked ``phase: "indexer"`` rows with the issue's keys, the smoke sweep writes ``tune_ops``' JSON, and
``--write-table`` merges its winners into (a copy of) ``ops/_tuned.py``, where :func:`dtkv.ops._tuned.launch_config`
reads them on the tuned device."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtkv.ops import _tuned

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_indexer_logits as bench  # noqa: E402
import tune_ops  # noqa: E402

KEYS = {"phase", "tokens", "context", "ms", "tflops", "mode", "peak_mem_gb", "visible_keys", "ok"}


def _smoke(tmp_path: Path, interpret: bool, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1" if interpret else "0"}
    env.pop("OUT", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_indexer_logits.py"), "--smoke", "--out-dir", str(tmp_path)]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, timeout=900)


def _rows(tmp_path: Path) -> list[dict]:
    (jsonl,) = tmp_path.glob("indexer_cpux1_*.jsonl")
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


def test_smoke_torch_rows(tmp_path):
    """Without the interpreter only the plain-PyTorch path runs: one checked row a case."""
    res = _smoke(tmp_path, False)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [(r["tokens"], r["context"], r["mode"]) for r in rows] == [(n, k, "torch") for n, k in bench.SMOKE_CASES]
    for r in rows:
        assert KEYS <= set(r) and r["ok"] and r["ms"] > 0 and r["tflops"] > 0, r
        assert r["visible_keys"] == sum(r["context"] - r["tokens"] + i + 1 for i in range(r["tokens"]))
    assert "TARGET indexer" in res.stdout and res.stdout.strip().endswith("0 failed")


def test_smoke_kernel_sweep_and_table(tmp_path):
    """The interpreter: every mode of every case checked against the torch path, the sweep's rows and JSON, and
    the winners merged into a copy of the table."""
    pytest.importorskip("triton")
    res = _smoke(tmp_path, True, "--sweep")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _rows(tmp_path)
    modes = [(r["tokens"], r["mode"]) for r in rows if r["phase"] == "indexer"]
    assert modes == [(n, m) for n, _ in bench.SMOKE_CASES for m in ("torch", "logits", "packed", "topk")]
    for r in rows:
        assert "error" not in r and r["ok"], r
    for r in rows:
        if r.get("mode") == "logits":
            assert r["mask_equal"] and r["max_rel_err"] <= 1e-5 and r["config"] == _tuned.DEFAULTS["indexer_logits"]
    sweep = [r for r in rows if r["phase"] == "indexer_sweep"]
    assert [r["candidate"] for r in sweep] == list(range(-1, len(bench.SMOKE_CANDIDATES)))
    assert sweep[0]["bitwise"] and all("bitwise" in r for r in sweep)
    doc = json.loads((tmp_path / "indexer_logits_tuned.json").read_text())
    (size,) = doc["tuned"]["indexer_logits"]
    assert int(size) == bench.SMOKE_CASES[0][0]
    table = tmp_path / "_tuned.py"
    shutil.copy(tune_ops.TABLE, table)
    block = tune_ops.write_table(str(tmp_path / "indexer_logits_tuned.json"), table)
    assert '"indexer_logits": {' in block
    merged = tune_ops._load_table(table)
    assert merged.DEFAULTS == _tuned.DEFAULTS and set(merged.TUNED) == set(_tuned.TUNED) | {"indexer_logits"}
    # the swept size is written, the table's other sizes stay (a sweep of some sizes merges into the table)
    want = {**_tuned.TUNED.get("indexer_logits", {}), int(size): doc["tuned"]["indexer_logits"][size]}
    assert merged.TUNED["indexer_logits"] == want


def test_tuned_entries_reach_the_launch(monkeypatch):
    """What ``--write-table`` writes is what a launch on the tuned device takes (by query count, log-nearest)."""
    entry = {**_tuned.DEFAULTS["indexer_logits"], "block_q": 4, "num_warps": 8}
    monkeypatch.setattr(_tuned, "TUNED", {**_tuned.TUNED, "indexer_logits": {4096: entry}})
    monkeypatch.setattr(_tuned, "_device_name", lambda device: _tuned.TUNED_DEVICE)
    assert _tuned.launch_config("indexer_logits", 8192, torch.device("cuda", 0)) == entry
    assert _tuned.launch_config("indexer_logits", 1, torch.device("cpu")) == entry  # the table's only size
    monkeypatch.setattr(_tuned, "_device_name", lambda device: "NVIDIA H100")
    assert _tuned.launch_config("indexer_logits", 8192, torch.device("cuda", 0)) == _tuned.DEFAULTS["indexer_logits"]
