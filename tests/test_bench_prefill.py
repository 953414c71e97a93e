"""``benchmarks/bench_prefill.py`` on 2 gloo ranks at tiny sizes: every mode stores the same KV bytes and computes the
same activations, sharded ranks hold half the bytes, the outputs (with paired overheads and their intervals) are
written; the modes' interleaving schedule, the paired statistics and the target verdicts; the DSA kernels match
their references (Triton through the CPU interpreter); the trace summary's interval arithmetic and categories."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.ops_reference import backend_ok

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _smoke(rank, world, out_dir):
    bench = _load("bench_prefill")
    argv = ["--tiny", "--verify", "--profile", "--contexts", "40", "64", "--chunk", "8", "--samples", "4"]
    bench.main(argv + ["--out-dir", out_dir])
    return None


@pytest.mark.multirank
def test_modes_store_the_same_kv_and_compute_the_same_activations(ranks2, tmp_path):
    ranks2.run(_smoke, str(tmp_path))
    (jsonl,) = tmp_path.glob("prefill_cpux2_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {(r["context"], r["mode"]) for r in rows} == {
        (t, m) for t in (40, 64) for m in ("replicated", "sharded_prefetch", "sharded")
    }
    for t in (40, 64):
        by_mode = {r["mode"]: r for r in rows if r["context"] == t}
        rep = by_mode["replicated"]
        for mode in ("sharded_prefetch", "sharded"):
            r = by_mode[mode]
            assert r["kv_digest"] == rep["kv_digest"]  # every stored byte, in logical page order
            assert r["x_digest"] == rep["x_digest"]  # the layer stack's output, bit for bit
            assert 2 * r["kv_bytes_per_rank"] == rep["kv_bytes_per_rank"] == r["kv_bytes_replicated"]
            assert r["view_gathered_bytes_per_step"] > 0 and r["materialize_backend"] == "all_gather"
            assert r["scratch_bytes"] <= 2 * r["view_bytes_per_layer"]  # pages in order: no send buffer
            lo, hi = r["overhead_ci95"]
            assert lo <= r["overhead_vs_replicated"] <= hi and r["verdict_1pct"] in ("met", "not met", "inconclusive")
            assert len(r["step_ms_samples"]) == r["samples"] == 4
        assert rep["overhead_vs_replicated"] == 0.0 and rep["timed_chunks"] == 2 and rep["overhead_ci95"] is None
    md = (tmp_path / jsonl.name.replace(".jsonl", ".md")).read_text()
    assert md.count("| 40 |") == 3 and "- TARGET KV bytes per rank = 1/cp of replicated: **met**" in md
    assert (tmp_path / jsonl.name.replace(".jsonl", ".png")).stat().st_size > 0
    assert list(tmp_path.glob("prefill_trace_sharded_prefetch-all_gather_64.json"))
    assert "sharded_prefetch-all_gather" in next(tmp_path.glob("prefill_profile_cpux2_*.md")).read_text()


def _smoke_one_rank(rank, world, out_dir, attention):
    bench = _load("bench_prefill")
    argv = ["--tiny", "--verify", "--contexts", "40", "--chunk", "8", "--samples", "2", "--attention", attention]
    bench.main(argv + ["--out-dir", out_dir])


@pytest.mark.multirank
@pytest.mark.parametrize("attention", ["torch", "standin"])
def test_one_rank_runs_every_mode(tmp_path, attention):
    """cp = 1 (``torchrun --nproc-per-node 1``): every mode on one rank, the views gathered from itself; the stand-in
    stays a labelled option."""
    from tests._multirank import RankGroup

    group = RankGroup(1)
    try:
        group.run(_smoke_one_rank, str(tmp_path), attention)
    finally:
        group.close()
    (jsonl,) = tmp_path.glob("prefill_cpux1_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"replicated", "sharded_prefetch", "sharded"}
    assert {r["attention"] for r in rows} == {attention} and {r["cp"] for r in rows} == {1}
    assert len({(r["x_digest"], r["kv_digest"]) for r in rows}) == 1
    assert f"attention: {attention}" in (tmp_path / jsonl.name.replace(".jsonl", ".md")).read_text()


def _indexer_case(seed):
    g = torch.Generator().manual_seed(seed)
    n, heads, dim, page = 20, 2, 32, 4
    pages = torch.zeros(9, page * (dim + 4), dtype=torch.uint8)
    keys = torch.randn(9 * page, dim, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(9 * page, generator=g) + 0.5
    for p in range(9):
        pages[p, : page * dim] = keys[p * page : (p + 1) * page].view(torch.uint8).flatten()
        pages[p, page * dim :] = scales[p * page : (p + 1) * page].view(torch.uint8)
    table = torch.tensor([3, 0, 8, 5, 1, 2, 7], dtype=torch.int32)
    q = torch.randn(n, heads, dim, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
    w = torch.randn(n, heads, generator=g)
    pos = torch.randint(0, 27, (n,), generator=g)
    return q, w, pages, table, pos, keys.float(), scales


def test_indexer_reference_is_the_formula():
    kernels = _load("_dsa_kernels")
    q, w, pages, table, pos, keys, scales = _indexer_case(0)
    got = kernels.indexer_logits_torch(q, w, pages, table, pos, 27, 4)
    qf = q.view(torch.float8_e4m3fn).float()
    for i in (0, 7, 19):
        for j in (0, 5, 26):
            row = int(table[j // 4]) * 4 + j % 4
            want = sum(float(w[i, h]) * max(0.0, float(qf[i, h] @ keys[row])) for h in range(2)) * float(scales[row])
            want = want if j <= int(pos[i]) else float("-inf")
            assert got[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="needs Triton in interpreter mode")
def test_indexer_kernel_vs_reference():
    """fp8 products summed in float32 in a different order: equal within float32 rounding."""
    kernels = _load("_dsa_kernels")
    q, w, pages, table, pos, _, _ = _indexer_case(1)
    ref = kernels.indexer_logits_torch(q, w, pages, table, pos, 27, 4)
    cfg = {"BQ": 16, "BK": 16, "num_warps": 4, "num_stages": 1}
    got = kernels.indexer_logits(q, w, pages, table, pos, 27, 4, config=cfg, interpret=True)
    assert torch.equal(got == float("-inf"), ref == float("-inf"))
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="needs Triton in interpreter mode")
def test_sparse_mla_kernel_vs_reference():
    """The benchmark's wrappers of ``dtkv::sparse_mla`` (its own tests: ``tests/test_ops_sparse_mla.py``). The kernel
    rounds dequantized keys and probabilities to bf16 (as FlashMLA does): tolerance 0.05 absolute on outputs of
    magnitude ~1; skipped rows (-1) and a query with no row at all (zero output) are exact."""
    from dtkv import MLAFp8Layout
    from dtkv.ops import quantize_mla_fp8

    kernels = _load("_dsa_kernels")
    g = torch.Generator().manual_seed(2)
    lay = MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32)
    rows = quantize_mla_fp8(torch.randn(40, 80, generator=g), lay)
    q = torch.randn(5, 4, 80, generator=g).to(torch.bfloat16)
    locs = torch.randint(-1, 40, (5, 20), generator=g).to(torch.int32)
    locs[2] = -1
    ref = kernels.sparse_mla_torch(q, rows, locs, 0.1, 64, 16, 32)
    got = kernels.sparse_mla(q, rows, locs, 0.1, 64, 16, 32, backend="triton")
    assert got.shape == (5, 4, 64) and got.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max() < 0.05
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    standin = kernels.sparse_mla_standin(q, rows, locs, 0.1, 64, 16, 32, slab=2)
    assert standin.shape == got.shape
    assert kernels.sparse_mla_flops(5, 4, 20, 64, 16) == 2 * 5 * 4 * 20 * (2 * 64 + 16)


def test_trace_summary_intervals(tmp_path):
    bench = _load("bench_prefill")
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 50, "dur": 100, "args": {"stream": 7}},  # union 0..150
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 140, "dur": 30, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 200, "dur": 10, "args": {"stream": 9}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "ts": 1, "dur": 2},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    events += [
        {"ph": "X", "cat": "kernel", "name": "_indexer_logits_kernel", "ts": 400, "dur": 50, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "c10d::symmetric_memory::barrier_kernel(", "ts": 300, "dur": 5,
         "args": {"stream": 9}},
    ]  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events}))
    s = bench.trace_summary(path)
    assert s["compute_stream"] == 7 and s["compute_busy_ms"] == 0.2 and s["window_ms"] == 0.45
    assert s["streams"]["9"] == {"busy_ms": 0.045, "overlap_with_compute_ms": 0.01}
    assert s["nccl_kernel_ms"] == 0.03 and s["copy_ms"] == 0.01 and s["stream_waits"] == 1
    assert s["compute_idle_ms"] == 0.25 and s["compute_gaps_top"] == [[0.25, "_indexer_logits_kernel"]]
    assert s["categories_ms"] == {"gemm": 0.2, "indexer": 0.05}  # kernel time: sums of durations
    assert s["side_categories_ms"] == {"nccl": 0.03, "memcpy_peer": 0.01, "barrier": 0.005}
    table = bench.profile_table({"replicated-none": s, "sharded_prefetch-copy_engine": s}, "replicated-none")
    assert "| indexer | 0.050 | 0.050 (+0.000) |" in table


def test_schedule_interleaves_the_modes_in_rotating_order():
    bench = _load("bench_prefill")
    runs = ["a", "b", "c"]
    sched = bench.schedule(runs, 6, [10, 20])
    assert len(sched) == 18
    for i in range(6):
        block = sched[3 * i : 3 * i + 3]
        assert {r for _, _, r in block} == set(runs)  # every mode once per sample, back to back
        assert {(s, p) for s, p, _ in block} == {(i, [10, 20][i % 2])}  # on the same step
    firsts = [sched[3 * i][2] for i in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]  # each mode leads equally often


def test_paired_overhead_cancels_a_drift_the_ratio_of_medians_does_not():
    """A clock drift of 10% across the run, and a true overhead of exactly 0.5%: the paired median finds it, with an
    interval around it; the ratio of medians of runs taken one after another does not."""
    db = _load("_dist_bench")
    ref = [100.0 * (1 + 0.1 * i / 29) for i in range(30)]
    mode = [r * 1.005 for r in ref]
    stats = db.paired_overhead(mode, ref)
    assert stats["overhead"] == pytest.approx(0.005) and stats["n"] == 30
    assert stats["ci95"][0] == pytest.approx(0.005) and stats["ci95"][1] == pytest.approx(0.005)
    later = [100.0 * (1 + 0.1 * (30 + i) / 29) * 1.005 for i in range(30)]  # the same mode, timed after ref
    assert sorted(later)[15] / sorted(ref)[15] - 1 > 0.09
    noisy = db.paired_overhead([m + (-1) ** i * 0.8 for i, m in enumerate(mode)], ref, reps=500)
    assert noisy["ci95"][0] < noisy["overhead"] < noisy["ci95"][1]
    with pytest.raises(ValueError, match="values and refs must be non-empty and of equal length, got 2 and 1"):
        db.paired_overhead([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="refs must be positive"):
        db.paired_overhead([1.0], [0.0])


@pytest.mark.parametrize(
    "ci,want", [((-0.01, 0.009), "met"), ((0.011, 0.02), "not met"), ((0.005, 0.012), "inconclusive")]
)
def test_verdict_needs_the_whole_interval_on_one_side(ci, want):
    assert _load("_dist_bench").verdict(ci, 0.01) == want


def test_target_lines_state_each_context_and_the_worst():
    bench = _load("bench_prefill")
    base = dict(cp=2, mode="sharded_prefetch", materialize_backend="copy_engine", samples=30, kv_bytes_per_rank=1,
                scratch_bytes=200, view_bytes_per_layer=100)  # fmt: skip
    rows = [
        {**base, "context": 65536, "overhead_vs_replicated": 0.004, "overhead_ci95": [0.001, 0.008], "verdict_1pct": "met"},
        {**base, "context": 131072, "overhead_vs_replicated": 0.009, "overhead_ci95": [0.006, 0.013],
         "verdict_1pct": "inconclusive"},
        {**base, "context": 131072, "mode": "replicated", "kv_bytes_per_rank": 2, "overhead_vs_replicated": 0.0,
         "overhead_ci95": None, "verdict_1pct": None, "view_bytes_per_layer": 0},
    ]  # fmt: skip
    lines = bench.target_lines(rows)
    assert lines[0] == ("- TARGET overhead, sharded_prefetch (copy_engine), 64K: +0.40% [95% CI +0.10%, +0.80%], n=30 "
                        "(target <= +1.0%): **met**")  # fmt: skip
    assert lines[2] == "- TARGET overhead, sharded_prefetch, 64K-256K: worst median +0.90% at 128K: **inconclusive**"
    assert "- TARGET materialization scratch <= 2 layers of view: 2.000 layers: **met**" in lines
