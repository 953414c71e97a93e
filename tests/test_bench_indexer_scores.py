"""``benchmarks/bench_indexer_scores.py`` on a CPU: the smoke sweep (interpreter, tiny geometry) writes checked rows,
``--check-launches --smoke`` finds every launch giving the default launch's keys, and ``--apply-table`` turns a
sweep's results into the op's ``LAUNCH_TABLE`` block (here in a copy of the source), keeping only launches that
passed their checks with the default launch's bits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtkv.ops.indexer_scores import LAUNCH_TABLE, IndexerLaunch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_indexer_scores as bench  # noqa: E402


@pytest.mark.slow
def test_smoke_sweep_writes_checked_rows(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_indexer_scores.py"), "--smoke",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "suggested table" in res.stdout and res.stdout.strip().splitlines()[-1].endswith("0 errors")
    (jsonl,) = tmp_path.glob("indexer_sweep_cpux1_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["shape"] for r in rows} == {"2x64", "1x160"}
    assert len(rows) == 2 * (len(bench.SMOKE_CANDIDATES) + 1)  # every candidate with fp8 queries, the default bf16
    for r in rows:
        assert "error" not in r, r
        assert r["ok"] and r["bitwise"] and r["positions_exact"] and r["topk_agree"] == 1.0, r
        assert r["bytes"] > 0 and r["gbps"] > 0 and r["bucket"] in ([0, 0], [1, 0]), r
    # the winners into a copy of the op's source: the block parses back into launches per bucket
    src = tmp_path / "indexer_scores.py"
    shutil.copy(bench.TABLE_SOURCE, src)
    block = bench.apply_table(jsonl, src)
    text = src.read_text()
    assert block in text and text.count("# BEGIN LAUNCH_TABLE") == 1 and text.count("# END LAUNCH_TABLE") == 1
    table = {}
    exec(block, {"IndexerLaunch": IndexerLaunch}, table)
    assert set(table["LAUNCH_TABLE"]) == {(0, 0), (1, 0)}
    assert all(isinstance(c, IndexerLaunch) for c in table["LAUNCH_TABLE"].values())
    assert all(len(line) <= 120 for line in block.splitlines())


@pytest.mark.slow
def test_check_launches_finds_every_launch_gives_the_default_keys():
    """``--check-launches`` (the GPU check that a tuned table never changes the selected keys) under the
    interpreter: every smoke candidate and every table entry, bitwise equal to the default launch on every case."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_indexer_scores.py"), "--check-launches",
                          "--smoke"], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert {r["name"] for r in rows} >= {name for name, _ in bench.SMOKE_CANDIDATES}
    assert sum(r["in_table"] for r in rows) == len(set(LAUNCH_TABLE.values()))
    for r in rows:
        assert r["bitwise"] and r["topk_equal"] and r["cases"] == 4 and "error" not in r, r
    assert res.stdout.strip().splitlines()[-1].endswith("other launches that differ: none")


def _row(shape, bucket, name, gbps, **kw):
    cfg = IndexerLaunch(num_stages=kw.pop("stages", 8))
    base = {"shape": shape, "bucket": bucket, "name": name, "config": bench.dataclasses.asdict(cfg), "q_fp8": True,
            "gbps": gbps, "hbm_fraction": gbps / 4800, "ok": True, "bitwise": True, "date": "2026-12-02"}  # fmt: skip
    return base | kw


def test_best_table_takes_the_fastest_checked_bitwise_fp8_launch():
    rows = [
        _row("16x131072", [2, 0], "default", 3000.0),
        _row("16x131072", [2, 0], "s12", 3900.0, stages=12),
        _row("16x131072", [2, 0], "fast_but_other_bits", 4500.0, bitwise=False),
        _row("16x131072", [2, 0], "fast_but_wrong", 4600.0, ok=False),
        _row("16x131072", [2, 0], "bf16", 4700.0, q_fp8=False),
        _row("1x131072", [0, 0], "default", 2500.0),
        {"shape": "1x131072", "bucket": [0, 0], "name": "broken", "q_fp8": True, "error": "CompilationError"},
    ]
    best = bench.best_table(rows)
    assert {b: r["name"] for b, r in best.items()} == {(2, 0): "s12", (0, 0): "default"}
    block = bench.table_source(best)
    assert "(2, 0): IndexerLaunch(num_stages=12)," in block and "(0, 0): IndexerLaunch()," in block
    assert "# 16x131072: s12, 3900 GB/s = 81% of 4.8 TB/s (2026-12-02)" in block
    assert bench.table_source({}) == "LAUNCH_TABLE: dict[tuple[int, int], IndexerLaunch] = {}"


def test_apply_table_needs_the_markers(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("LAUNCH_TABLE = {}\n")
    res = tmp_path / "r.jsonl"
    res.write_text(json.dumps(_row("1x131072", [0, 0], "default", 2500.0)) + "\n")
    with pytest.raises(ValueError, match="has no '# BEGIN LAUNCH_TABLE'"):
        bench.apply_table(res, src)
    assert src.read_text() == "LAUNCH_TABLE = {}\n"
