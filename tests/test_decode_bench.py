"""CPU smoke of ``benchmarks/bench_decode.py`` on 2 gloo ranks (tiny geometry, torch kernels, eager): the three
modes run in one process group on the same requests and agree, the collectives carry what the cost model says
(sharded: candidates and partials, the same at every context; full view: the batch's pages, growing with it;
replicated: nothing), every row has the issue's keys, and the result files (JSONL, markdown, plot) are written.

Agreement: the modes score the same fp8 bytes in float32 over differently shaped GEMMs (~1e-7 relative noise);
with 48 of at most 800 keys selected, a swap at the K-th place needs two scores within that noise (~1e-5 chance per
query at these fixed seeds), so selections must agree and outputs differ by less than 1e-5 relative.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dtkv.decode import sharded_decode_comm_bytes

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
OPTS = {"contexts": [40, 160], "batches": [1, 3], "reps": 1, "warmup": 0, "smoke": True, "print": False,
        "phases": True}  # fmt: skip
KEYS = {"mode", "cp", "context", "batch", "graph", "step_ms", "layers", "bytes_sent_per_step", "vs_replicated"}


def _load():
    if "bench_decode" in sys.modules:
        return sys.modules["bench_decode"]
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_decode"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _bench_rank(rank, world, opts):
    import torch.distributed as dist

    return _load().run(rank, world, opts, group=dist.group.WORLD)


@pytest.mark.multirank
def test_bench_decode_smoke_on_two_gloo_ranks(ranks2, tmp_path, monkeypatch):
    out = ranks2.run(_bench_rank, OPTS)
    rows = out[0]["rows"]
    assert [(r["mode"], r["bytes_sent_per_step"]) for r in rows] == [
        (r["mode"], r["bytes_sent_per_step"]) for r in out[1]["rows"]
    ]  # every rank ran the same sweep
    bench = _load()
    geom = bench.SMOKE
    assert len(rows) == 2 * 2 * 3 and all(KEYS <= set(r) for r in rows)
    sent = {}
    for r in rows:
        assert r["cp"] == 2 and r["layers"] == geom.num_layers and r["step_ms"] > 0 and r["graph"] is False
        assert r["topk_agree"] == 1.0 and r["out_rel_diff"] < 1e-5, r
        assert set(r["phase_us"]) >= {"write", "indexer", "topk", "indices", "attention", "layer"}
        sent[(r["mode"], r["context"], r["batch"])] = r["bytes_sent_per_step"]
        if r["mode"] == "replicated":
            assert r["vs_replicated"] == 1.0 and r["bytes_sent_per_step"] == 0 and r["comm"] == "none"
            assert r["kv_bytes_per_rank"] == 2 * next(
                x["kv_bytes_per_rank"] for x in rows if x["mode"] == "sharded" and x["context"] == r["context"]
                and x["batch"] == r["batch"]
            )  # fmt: skip
        if r["mode"] == "sharded":
            want = sharded_decode_comm_bytes(num_queries=r["batch"], topk=geom.topk, num_heads=geom.num_heads,
                                             kv_lora_rank=geom.kv_lora_rank, cp_size=2)  # fmt: skip
            assert r["bytes_sent_per_step"] == want.sent * geom.num_layers
    for b in OPTS["batches"]:
        assert sent[("sharded", 40, b)] == sent[("sharded", 160, b)]  # independent of context length
        assert sent[("full_view", 160, b)] > sent[("full_view", 40, b)] > 0
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    paths = bench.report.write_results(rows, [], tmp_path / "results", "python benchmarks/bench_decode.py --smoke",
                                       "cpux2")  # fmt: skip
    date = rows[0]["date"]
    names = {p.name for p in paths}
    assert {f"decode_graph_cpux2_{date}.jsonl", f"decode_graph_cpux2_{date}.md"} <= names
    assert all(p.exists() for p in paths) and {p.parent for p in paths} == {tmp_path / "results", tmp_path / "out"}
    pytest.importorskip("matplotlib")
    assert f"decode_graph_cpux2_{date}.png" in names
    md = (tmp_path / "results" / f"decode_graph_cpux2_{date}.md").read_text()
    assert "| context | batch | graph | replicated ms |" in md and md.count("\n| 160 | 3 | off |") == 1
    assert "## Targets" in md and "not measured" in md  # no graphs on CPUs
    back = [
        json.loads(line) for line in (tmp_path / "out" / f"decode_graph_cpux2_{date}.jsonl").read_text().splitlines()
    ]
    assert len(back) == len(rows)


def test_targets_read_the_rows():
    """The target lines: met and not met from hand-made rows (no GPU needed to check the verdicts)."""
    report = _load().report
    base = {"cp": 1, "layers": 61, "graph": True, "batch": 1, "context": 32768}
    rows = [dict(base, mode="replicated", step_ms=6.0), dict(base, mode="sharded", step_ms=6.3),
            dict(base, mode="full_view", step_ms=7.0)]  # fmt: skip
    report.add_vs_replicated(rows)
    sweep = [{"config": {"block_s": 64}, "q_fp8": True, "gbps": 4000.0, "hbm_fraction": 4000 / 4800, "queries": 16,
              "context": 131072, "copy_gbps": 4100.0}]  # fmt: skip
    lines = report.targets(rows, sweep)
    assert "6.30 ms (<= 8.0 ms): **met**" in lines[0]
    assert "worst 1.167x (full_view, 32768, batch 1): **not met**" in lines[1]
    assert "4000 GB/s = 83%" in lines[2] and lines[2].endswith("**met**")
