"""``benchmarks/bench_materialize.py`` on 2 gloo ranks: ``--check`` passes (bitwise views for every case and path the
CPU can run), the sweep writes the documented keys, and the markdown summary evaluates the targets."""

from __future__ import annotations

import json

import pytest

from tests.test_bench_runtime import _load

KEYS = {"tokens", "backend", "prefetch", "view_ms", "raw_allgather_ms", "efficiency_vs_raw",
        "overlap_overhead_vs_compute", "host_us_per_layer", "layers", "order", "graphs"}  # fmt: skip


def _run(rank, world, argv):
    return _load("bench_materialize").main(argv)


@pytest.mark.multirank
def test_check_and_sweep_on_gloo(ranks2, tmp_path):
    assert ranks2.run(_run, ["--check"]) == [0, 0]
    argv = ["--tokens", "640", "--layers", "1", "2", "--reps", "1", "--overlap-reps", "1", "--out-dir", str(tmp_path)]
    assert ranks2.run(_run, argv) == [0, 0]
    (jsonl,) = tmp_path.glob("materialize_cpux2_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2  # orders x layers x prefetch (CPU: the all-gather backend only)
    assert all(KEYS <= set(r) for r in rows)
    assert {r["backend"] for r in rows} == {"all_gather"}
    overlap = [r for r in rows if r["overlap_overhead_vs_compute"] is not None]
    assert {(r["layers"], r["prefetch"]) for r in overlap} == {(2, True)}
    assert all(r["overlap_ci95"][0] <= r["overlap_overhead_vs_compute"] <= r["overlap_ci95"][1] for r in overlap)
    assert "## Targets" in (tmp_path / jsonl.name.replace(".jsonl", ".md")).read_text()


def test_summary_names_the_best_configuration():
    bench = _load("bench_materialize")
    row = dict(tokens=32768, view_MB_per_layer=25.8, order="in_order", layers=8, prefetch=True, raw_allgather_ms=1.0,
               overlap_overhead_first_exposed=None, gemm_ms=None)  # fmt: skip
    rows = [
        {**row, "backend": "all_gather", "graphs": False, "view_ms": 2.0, "efficiency_vs_raw": 0.5,
         "host_us_per_layer": 80.0, "overlap_overhead_vs_compute": 0.03},
        {**row, "backend": "copy_engine", "graphs": True, "view_ms": 1.0, "efficiency_vs_raw": 1.0,
         "host_us_per_layer": 9.0, "overlap_overhead_vs_compute": 0.004},
    ]  # fmt: skip
    rows[1]["overlap_ci95"] = [0.001, 0.007]
    text = bench.summary(rows, "t")
    assert (
        "| 32768 | 25.8 | 1.0 (copy_engine, in_order, graphs=True, L=8, prefetch=True) | 80.0 | 9.0 | "
        "+0.40% [+0.10%, +0.70%] (copy_engine, in_order, graphs=True) |" in text
    )
    assert (
        "- TARGET view speed, 32K tokens (25.8 MB/layer), eager: efficiency 0.5 (all_gather, in_order, prefetch=True; "
        "target >= 0.9), host 80.0 us/layer (target <= 100): **not met**" in text
    )
    assert "- TARGET view speed, 32K tokens (25.8 MB/layer), graphs: efficiency 1.0" in text
    assert "TARGET overlap" not in text  # only for views of 50-200 MB per layer (the target's 100 MB)
    rows = [{**r, "tokens": 131072, "view_MB_per_layer": 103.3} for r in rows]
    assert (
        "- TARGET overlap, 128K tokens (103.3 MB/layer): +0.40% [95% CI +0.10%, +0.70%] (copy_engine, in_order, "
        "graphs=True; target <= +1.0%): **met**" in bench.summary(rows, "t")
    )
