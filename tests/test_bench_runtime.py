"""``benchmarks/bench_runtime.py``: the shipped ``Runtime`` measured on 2 gloo ranks and in one process at tiny dims
(every case runs, rows carry the issue's keys, the files are written), a failing case keeps the others, the time
budget skips what it cannot run, ``--graph`` reaches a runtime switch when there is one; and the pieces checked on
hand-made inputs: the trace's busy time and dtkv's part (intervals merged across streams, kernels attributed through
their launch), the FLOP count, the target verdicts. Also the benchmarks' shared plumbing (``_dist_bench``'s paired
statistics, ``_trace``'s summary)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
ISSUE_KEYS = {"phase", "adapter", "layers", "hidden", "attention", "kv_dtype", "decode_mode", "context", "chunk",
              "batch", "graph", "ok", "error", "tok_s", "step_ms", "gpu_busy_share", "peak_mem_gb",
              "dtkv_ms_per_layer", "kernel_ms_per_layer", "model_tflop", "roofline_share"}  # fmt: skip
SMOKE = ["--smoke", "--prefill", "64x16", "--decode-contexts", "40", "--batches", "1,2", "--long-layers", "1",
         "--reference-prefill", "40x16", "--reference-decode-contexts", "40"]  # fmt: skip


def _load(name: str):
    """A module of ``benchmarks/`` by name (the directory on ``sys.path``, as the scripts have it)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rows(out_dir: Path, tag: str) -> list[dict]:
    (jsonl,) = out_dir.glob(f"runtime_{tag}_*.jsonl")
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


def _smoke(rank, world, argv):
    return _load("bench_runtime").main(argv)


@pytest.mark.multirank
def test_two_gloo_ranks_run_every_case(ranks2, tmp_path):
    """cp = 2 (``torchrun --nproc-per-node 2``): both adapters, prefill and both decode modes, the long model, the
    indexer op; every row ok with its measurements (no GPU: no busy share, no peak memory)."""
    assert ranks2.run(_smoke, [*SMOKE, "--out-dir", str(tmp_path)]) == [0, 0]
    rows = _rows(tmp_path, "cpux2")
    runtime = [r for r in rows if r["phase"] != "indexer"]
    want = {("prefill", "transformers", 2, 64, None, 1), ("prefill", "reference", 2, 40, None, 1)}
    want |= {("decode", "transformers", 2, 40, m, b) for m in ("full", "sharded") for b in (1, 2)}
    want |= {("decode", "transformers", 1, 40, m, 1) for m in ("full", "sharded")}
    want |= {("decode", "reference", 2, 40, m, 1) for m in ("full", "sharded")}
    got = {(r["phase"], r["adapter"], r["layers"], r["context"], r["decode_mode"], r["batch"]) for r in runtime}
    assert got == want and len(runtime) == len(want)
    for r in runtime:
        assert ISSUE_KEYS <= set(r) and r["ok"] and r["error"] is None, r
        assert r["cp"] == 2 and r["kv_mode"] == "sharded_direct" and r["attention"] == "torch" and not r["graph"]
        assert r["gpu_busy_share"] is None and r["peak_mem_gb"] is None and r["attribution"] == "host"
        assert r["dtkv_ms_per_layer"] > 0 and r["kernel_ms_per_layer"] > 0
        if r["phase"] == "prefill":
            assert r["tok_s"] > 0 and r["model_tflop"] > 0 and r["roofline_share"] > 0 and r["step_ms"] is None
            parts = {"write", "indices", "attention"} | (
                {"indexer", "topk"} if r["adapter"] == "transformers" else set()
            )
            assert set(r["kernel_parts_ms"]) == parts
        else:
            assert r["step_ms"] > 0 and r["tok_s"] is None and r["model_tflop"] is None and r["steps"] >= 1
    idx = [r for r in rows if r["phase"] == "indexer"]
    assert idx and all({"tokens", "context", "ms", "tflops"} <= set(r) for r in idx if r["mode"] != "topk")
    md = next(tmp_path.glob("runtime_cpux2_*.md")).read_text()
    assert "## prefill" in md and "## decode" in md and "## Targets" in md and "cp=2" in md
    assert "torch 2." in md and "CUDA-graph switch of Runtime" in md
    pytest.importorskip("matplotlib")
    assert next(tmp_path.glob("runtime_cpux2_*.png")).stat().st_size > 0


def test_one_process_keeps_the_other_cases_when_one_fails(tmp_path, monkeypatch):
    """No process group (``python benchmarks/bench_runtime.py``): cp = 1, mode ``single``. A case that raises is a
    row with ``ok: false`` and the error; the cases after it still run."""
    bench = _load("bench_runtime")
    real = bench.Bench.prefill

    def prefill(self, case, budget_s):
        if case.adapter == "reference":
            raise RuntimeError("injected failure")
        return real(self, case, budget_s)

    monkeypatch.setattr(bench.Bench, "prefill", prefill)
    argv = [*SMOKE, "--phases", "prefill,decode", "--batches", "1", "--decode-modes", "full", "--long-layers", "0",
            "--no-profile"]  # fmt: skip
    assert bench.main([*argv, "--out-dir", str(tmp_path)]) == 0
    rows = _rows(tmp_path, "cpux1")
    bad = [r for r in rows if not r["ok"]]
    assert [(r["phase"], r["adapter"], r["error"]) for r in bad] == [
        ("prefill", "reference", "RuntimeError: injected failure")
    ]
    assert len(rows) == 4 and all(r["cp"] == 1 and r["kv_mode"] in (None, "single") for r in rows)
    ran = [r for r in rows if r["ok"]]
    assert {r["kv_mode"] for r in ran} == {"single"} and all(r["gpu_busy_share"] is None for r in ran)
    assert all(r["dtkv_ms_per_layer"] is None and r["kernel_ms_per_layer"] > 0 for r in ran)  # --no-profile
    assert "| reference | 2 | torch |  | 40 | 16 | False |" in next(tmp_path.glob("runtime_cpux1_*.md")).read_text()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--phases", "prefill,warmup"], "--phases takes names from ['indexer', 'prefill', 'decode'], got ['warmup']"),
        (["--decode-modes", "paged"], "--decode-modes takes names from ['full', 'sharded'], got ['paged']"),
        (["--kv-modes", "dense"], "--kv-modes takes names from"),
        (["--adapters", "glm5"], "--adapters takes names from ['transformers', 'reference'], got ['glm5']"),
        (["--prefill", "8192:4096"], "--prefill takes AxB pairs of positive ints separated by commas, got '8192:4096'"),
        (["--prefill", "0x16"], "--prefill takes positive ints, got '0x16'"),
        (["--layers", "0"], "--layers >= 1, --long-layers >= 0 and --decode-steps >= 1, got 0, 3, 2"),
    ],
)
def test_rejects_bad_options_naming_the_flag_and_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _load("bench_runtime").main(["--smoke", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_time_budget_skips_the_cases_it_cannot_run(tmp_path):
    bench = _load("bench_runtime")
    argv = [*SMOKE, "--phases", "prefill", "--adapters", "reference", "--budget-s", "0", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    (row,) = _rows(tmp_path, "cpux1")
    assert ISSUE_KEYS <= set(row) and not row["ok"] and row["error"].startswith("skipped: the run's time budget")


def test_a_run_cut_short_keeps_the_rows_that_ran(tmp_path, monkeypatch):
    """The JSONL file and the summary page grow row by row: a run killed at its second case (an outer timeout)
    leaves the first row and a page marked partial."""
    bench = _load("bench_runtime")
    real, calls = bench.Bench.row, []

    def row(self, case):
        calls.append(case)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal does to the process
        return real(self, case)

    monkeypatch.setattr(bench.Bench, "row", row)
    argv = [*SMOKE, "--phases", "decode", "--adapters", "reference", "--no-profile", "--no-kernels"]
    with pytest.raises(KeyboardInterrupt):
        bench.main([*argv, "--out-dir", str(tmp_path)])
    (r,) = _rows(tmp_path, "cpux1")
    assert r["ok"] and r["decode_mode"] == "full" and r["step_ms"] > 0
    assert "**partial**: 1 rows so far" in next(tmp_path.glob("runtime_cpux1_*.md")).read_text()


def test_graph_reaches_the_runtime_switch(monkeypatch):
    """``--graph`` passes ``Runtime(cuda_graphs=...)``: ``"emulate"`` on a CPU (the graph path run eagerly: rows say
    ``graph: false``, ``graph_mode: emulate``), ``False`` without the flag."""
    bench = _load("bench_runtime")
    assert bench.graph_switch() == "cuda_graphs"
    seen = []

    class Recording(bench.Runtime):
        def __init__(self, adapter, *, cuda_graphs=None, **kwargs):
            seen.append(cuda_graphs)
            super().__init__(adapter, cuda_graphs=cuda_graphs, **kwargs)

    monkeypatch.setattr(bench, "Runtime", Recording)
    parser = bench._parser()
    import torch

    outs = []
    for flags in ([*SMOKE, "--graph"], SMOKE):
        ns = parser.parse_args(flags)
        bench._defaults(ns, parser)
        b = bench.Bench(ns, bench.Group(None, torch.device("cpu")), torch.device("cpu"))
        case = bench.Case(phase="decode", adapter="reference", layers=1, context=40, batch=1, decode_mode="full")
        outs.append(b.decode(case, budget_s=float("inf")))
    assert seen == ["emulate", False]
    assert outs[0]["graph"] is False and outs[0]["graph_mode"] == "emulate" and outs[0]["step_ms"] > 0
    assert outs[0]["graph_eager_steps"] == 0 and outs[0]["graph_captures"] >= 1
    assert outs[1]["graph_mode"] == "off" and outs[1]["graph"] is False


# ------------------------------------------------------------------------------------------- the pieces
def _kernel(name, ts, dur, stream, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream,
                                                                                    "correlation": corr}}  # fmt: skip


def test_device_split_merges_streams_and_attributes_kernels_through_their_launch():
    """Busy time is the union over streams (two overlapping kernels count once); a kernel is dtkv's when its launch
    (same correlation id) lies in a ``dtkv.`` / ``dtkv::`` host range of its thread, whatever its name; a kernel
    replayed from a graph or without a launch is dtkv's by its name only."""
    trace = _load("_trace")
    host = [
        {"ph": "X", "cat": "user_annotation", "name": "dtkv.write", "ts": 0, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "dtkv::sparse_indices", "ts": 40, "dur": 5, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 10, "tid": 1},
    ]
    launches = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2, "dur": 1, "tid": 1, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 41, "dur": 1, "tid": 1, "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 21, "dur": 1, "tid": 1, "args": {"correlation": 3}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1, "tid": 2, "args": {"correlation": 4}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 3, "dur": 1, "tid": 1, "args": {"correlation": 5}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "dtkv.write", "ts": 100, "dur": 1, "args": {"correlation": 3}},
    ]  # fmt: skip
    kernels = [
        _kernel("elementwise_kernel", 100, 20, 7, 1),  # launched inside dtkv.write: dtkv's, whatever the name
        _kernel("_sparse_indices_kernel", 110, 20, 9, 2),  # inside dtkv::sparse_indices, overlaps the first: 100-130
        _kernel("nvjet_gemm", 200, 50, 7, 3),  # aten::mm: the model's
        _kernel("_indexer_logits_kernel", 300, 10, 7, 4),  # launched on another thread, outside its ranges
        _kernel("flash_fwd_mla_kernel", 400, 30, 7, 5),  # graph replay: by name
        _kernel("radixSortKVInPlace", 430, 10, 7, 5),  # graph replay, not a dtkv name (top-k is ambiguous)
        _kernel("_quantize_write_mla_fp8_kernel", 500, 5, 7, 99),  # no launch recorded: by name
    ]
    memcpy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 245, "dur": 10, "args": {"stream": 9}}
    s = trace.device_split(host + launches + kernels + [memcpy])
    assert s["busy_ms"] == pytest.approx((30 + 55 + 10 + 40 + 5) / 1e3)  # 100-130, 200-255, 300-310, 400-440, 500-505
    assert s["dtkv_ms"] == pytest.approx((30 + 30 + 5) / 1e3)
    assert (s["by_range"], s["by_name"], s["kernels"], s["attribution"]) == (2, 2, 8, "ranges+names")
    assert s["dtkv_host_ms"] == pytest.approx(15 / 1e3)
    cpu = trace.device_split(host)  # a CPU run: the host time inside dtkv's ranges
    assert cpu == {"busy_ms": None, "dtkv_ms": 0.015, "dtkv_host_ms": 0.015, "kernels": 0, "by_range": 0,
                   "by_name": 0, "attribution": "host"}  # fmt: skip


def test_dtkv_ranges_open_inside_the_block_and_are_gone_after():
    profile = _load("_runtime_profile")
    import torch

    from dtkv.model import ModelConfig, ReferenceAdapter
    from dtkv.runtime import Runtime, StepContext

    before = StepContext.write
    rt = Runtime(ReferenceAdapter(ModelConfig(num_layers=1)), num_pages=16, attention="torch")
    try:
        rt.add_request(list(range(9)))
        with profile.dtkv_ranges(rt) as names:
            assert StepContext.write is not before and "prefill" in vars(rt.attention)
        assert StepContext.write is before and "prefill" not in vars(rt.attention)
        assert {"dtkv.write", "dtkv.views", "dtkv.decode_attention", "dtkv.attention.prefill"} <= set(names)
        out = profile.profiled(lambda: rt.prefill(4), torch.device("cpu"), rt)
        assert out["attribution"] == "host" and 0 < out["dtkv_ms"] <= out["wall_ms"] and out["busy_ms"] is None
        assert StepContext.write is before
    finally:
        rt.close()


def test_flops_count_the_config_as_the_issue_defines_them():
    """DeepSeek-V3.2's attention dims, hidden 2048, 4 layers (the first dense), 8 experts top 2 + 1 shared: the
    per-token projections by hand, attention ``2 * 2048 * 128 * (2 * 512 + 64)`` per query and layer, the indexer
    ``2 * 64 * 128`` per visible key and layer."""
    models = _load("_runtime_models")
    from dtkv.integrations.transformers import tiny_config

    cfg = tiny_config("deepseek-v32", **models.transformers_dims(layers=4, hidden=2048, experts=8, active=2,
                                                                 smoke=False))  # fmt: skip
    t, steps = 1000, 3
    f = models.transformers_flops(cfg, t, steps)
    attn = 2048 * 1536 + 1536 * 128 * 192 + 2048 * 576 + 512 * 128 * 256 + 128 * 128 * 2048 + 1536 * 64 * 128
    attn += 2048 * 128 + 2048 * 64
    mlp = 3 * 2048 * 4096 + 3 * (2048 * 8 + 3 * 3 * 2048 * 1024)
    assert f["gemm"] == 2 * t * (4 * attn + mlp) + 2 * steps * 2048 * 4096
    assert f["attention"] == 2 * 4 * t * 2048 * 128 * (2 * 512 + 64)
    assert f["indexer"] == 2 * 4 * (t * (t + 1) // 2) * 64 * 128
    assert models.roofline_s(f) == pytest.approx((f["gemm"] + f["attention"]) / 700e12 + f["indexer"] / 1400e12)
    assert models.roofline_s(f, cp=2) == pytest.approx(models.roofline_s(f) / 2)


def _row(phase, **kw):
    base = {"phase": phase, "adapter": "transformers", "layers": 4, "ok": True, "error": None, "cp": 1, "graph": False,
            "gpu_busy_share": 0.95, "dtkv_ms_per_layer": 10.0, "kernel_ms_per_layer": 9.0, "roofline_share": 0.6,
            "tok_s": 1e5, "peak_mem_gb": 30.0, "step_ms": 5.0, "batch": 1, "decode_mode": None, "chunk": None}  # fmt: skip
    return {**base, **kw}


def test_target_lines_read_the_rows():
    report = _load("_runtime_report")
    rows = [
        _row("prefill", context=32768, chunk=8192),
        _row("prefill", context=131072, chunk=8192, roofline_share=0.2),
        _row("decode", context=32768, decode_mode="full", graph=True, gpu_busy_share=0.9, dtkv_ms_per_layer=0.11,
             kernel_ms_per_layer=0.1),
        _row("decode", context=131072, batch=16, decode_mode="sharded", ok=False, error="RuntimeError: x"),
        _row("decode", context=32768, decode_mode="full", dtkv_ms_per_layer=None),
        _row("decode", layers=61, context=32768, decode_mode="full", step_ms=16.0),
        {"phase": "indexer", "mode": "packed", "tokens": 4096, "context": 32768, "tflops": 450.0,
         "roofline_share": 450 / 1400, "ok": True},
    ]  # fmt: skip
    lines = report.target_lines(rows)
    assert lines[0].startswith("- TARGET prefill 32K / chunk 8192 (transformers, 4 layers): gpu_busy_share 0.95")
    assert "= 1.11 x kernels 9 (<= 1.25)" in lines[0] and lines[0].endswith("**met**")
    assert "roofline_share 0.20 (>= 0.5)" in lines[1] and lines[1].endswith("**not met**")
    assert lines[2] == "- TARGET a 128K prompt in 8K chunks runs on one GPU: runs, peak 30.0 GiB: **met**"
    assert lines[3].startswith("- TARGET indexer >= 400 TFLOP/s") and "met (slowest 450 TFLOP/s" in lines[3]
    assert (
        lines[4].startswith("- TARGET decode 32K x batch 1, full (transformers): graph true") and "= 1.10 x" in lines[4]
    )
    assert lines[4].endswith("**met**")
    assert lines[5] == "- TARGET decode 128K x batch 16, sharded (transformers): **not met** (failed: RuntimeError: x)"
    assert lines[6].endswith("**not met** (no CUDA graphs in the runtime)")
    assert lines[7] == ("- TARGET 61 layers decode a step at 32K / batch 1 (full, graph false): 16.0 ms (<= 15.0): "
                        "**not met**")  # fmt: skip


def test_markdown_and_plot_of_gpu_rows(tmp_path):
    """Rows as a GPU run writes them (busy shares, kernel categories, kernel pieces): the page shows the hardware,
    where the device time went and the targets; the plot is drawn."""
    report = _load("_runtime_report")
    cats = {"indexer": 12.5, "attention": 4.0, "gemm": 3.0}
    rows = [
        _row("prefill", context=32768, chunk=8192, categories_ms=cats, kernel_parts_ms={"write": 0.1, "indexer": 9.0}),
        _row("decode", context=32768, decode_mode="sharded", categories_ms={"other": 1.0}),
        _row("decode", context=131072, decode_mode="sharded", kernel_ms_per_layer=0.2),
    ]
    env = {
        "device": "NVIDIA H200",
        "driver": "580.1",
        "torch": "2.11.0+cu130",
        "commit": "abc1234",
        "date": "d",
        "cp": 1,
    }
    text = report.markdown(rows, env, title="t", command="python benchmarks/bench_runtime.py", seconds=5, notes=["n"])
    assert "- **Hardware / versions**: NVIDIA H200; driver 580.1, torch 2.11.0+cu130" in text
    assert (
        "- prefill transformers 4L 32768 chunk 8192: indexer 12.50, attention 4.00, gemm 3.00; kernels alone per "
        'layer: {"write": 0.1, "indexer": 9.0}' in text
    )
    assert "- decode transformers 4L 32768 x1 sharded: other 1.00" in text and "## Targets" in text
    pytest.importorskip("matplotlib")
    assert report.figure(rows, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0


def test_targets_flag_prints_a_results_file(tmp_path, capsys):
    bench = _load("bench_runtime")
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_row("decode", layers=61, context=32768, decode_mode="sharded", step_ms=9.0)) + "\n")
    assert bench.main(["--targets", str(path)]) == 0
    assert "61 layers decode a step at 32K / batch 1 (sharded, graph false): 9.0 ms (<= 15.0): **met**" in (
        capsys.readouterr().out
    )


# ------------------------------------------------------------------------------------------- shared plumbing
def test_flashmlas_kernels_count_as_attention():
    """FlashMLA's sparse prefill kernel (``legacy::sm90::prefill::sparse_fwd::sparse_attn_fwd_kernel<...cutlass...>``,
    the fp8 prefill's kernel since it dequantizes the pages) and its decode kernels are attention, not GEMMs."""
    trace = _load("_trace")
    names = [
        "void legacy::sm90::prefill::sparse_fwd::sparse_attn_fwd_kernel<legacy::sm90::prefill::sparse_fwd::"
        "KernelTemplate<576, false>, cute::TiledCopy<cutlass::bfloat16_t>>(SparseAttnFwdParams)",
        "void legacy::sm90::decode::sparse::flash_fwd_splitkv_mla_fp8_sparse_kernel<...>",
        "void legacy::smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 512, 8, 96, 256>(CombineParams)",
    ]
    assert [trace.category({"name": n, "cat": "kernel"}) for n in names] == ["attention"] * 3
    assert trace.category({"name": "nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT", "cat": "kernel"}) == "gemm"


def test_trace_summary_intervals(tmp_path):
    trace = _load("_trace")
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 50, "dur": 100, "args": {"stream": 7}},  # union 0..150
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "ts": 140, "dur": 30, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 200, "dur": 10, "args": {"stream": 9}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "ts": 1, "dur": 2},
        {"ph": "X", "cat": "kernel", "name": "_indexer_logits_kernel", "ts": 400, "dur": 50, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "c10d::symmetric_memory::barrier_kernel(", "ts": 300, "dur": 5,
         "args": {"stream": 9}},
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = trace.trace_summary(path)
    assert s["compute_stream"] == 7 and s["compute_busy_ms"] == 0.2 and s["window_ms"] == 0.45
    assert s["streams"]["9"] == {"busy_ms": 0.045, "overlap_with_compute_ms": 0.01}
    assert s["nccl_kernel_ms"] == 0.03 and s["copy_ms"] == 0.01 and s["stream_waits"] == 1
    assert s["compute_idle_ms"] == 0.25 and s["compute_gaps_top"] == [[0.25, "_indexer_logits_kernel"]]
    assert s["categories_ms"] == {"gemm": 0.2, "indexer": 0.05}  # kernel time: sums of durations
    assert s["side_categories_ms"] == {"nccl": 0.03, "memcpy_peer": 0.01, "barrier": 0.005}
    table = trace.profile_table({"replicated-none": s, "sharded_prefetch-copy_engine": s}, "replicated-none")
    assert "| indexer | 0.050 | 0.050 (+0.000) |" in table


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


def test_every_listed_benchmark_has_its_script_and_runtime_is_one(capsys):
    """``dtkv bench`` names only scripts that exist (a retired one would fail with a misleading "ships in the source
    checkout"), and ``dtkv bench runtime --help`` reaches this benchmark's options."""
    from dtkv.__main__ import BENCHMARKS, main

    assert [n for n in BENCHMARKS if not (BENCH / f"bench_{n}.py").exists()] == []
    assert "runtime" in BENCHMARKS
    assert main(["bench", "runtime", "--help"]) == 0
    assert "--smoke" in capsys.readouterr().out
