"""What sharding costs: CP prefill of DSA layers at DeepSeek-V3.2 dimensions, replicated vs sharded KV.

One command (2 GPUs; about 2-3 minutes for the default sweep on 2 H200s, most of it Triton compilation and setup)::

    torchrun --nproc-per-node 2 benchmarks/bench_prefill.py --json [--profile]

and on a CPU machine the same command runs a tiny gloo smoke (``--tiny`` sizes: it checks that every mode stores the
same KV bytes and computes the same activations). The layer stack is described in ``_dsa_layer.py``: projections,
fused fp8 KV writes, the indexer over the whole index-K, top-k turned into cache locations, sparse MLA attention,
an FFN with the active experts' FLOPs, ``--layers`` of them (default 4), ``cp`` = the number of ranks.

What is timed, per context ``T`` (default 32K, 64K, 128K, 256K): one request, chunked prefill with chunks of
``--chunk`` tokens (default 8192). The history before a timed chunk is not computed: its pages are filled with valid
fp8 pages (the same bytes, by logical page, in every mode). The steps timed are those of the last ``--timed-chunks``
chunks of the context (the history is longest there, which is what the history gather scales with), taken in turn.

The modes run interleaved: every mode has its own pool and Materializer, and for each sample ``i`` (``--samples``
per mode) every mode runs the same step (same chunk, same inputs) back to back, in an order that rotates with ``i``.
Step time is measured with device events from the end of the previous step (planning included: the host plans a
step while the device still runs the one before, with no host-device synchronization). The overhead of a mode is
the median over samples of ``t_mode[i] / t_replicated[i] - 1`` -- paired, so that clock and power drift over the run
(10% on one kernel within a run on H200s) cancels -- with a 95% bootstrap interval of that median; a target is
*met* when the whole interval is at or below it, *not met* when the whole interval is above it, else
*inconclusive*. ``exposed_gather_ms_per_layer``: time the compute stream waited inside ``Materializer.view`` (device
events around it). Modes: ``replicated`` (every rank stores the whole pool), ``sharded_prefetch`` (the history view
of layer ``l + 1`` gathered while layer ``l`` computes, on its own stream), ``sharded`` (gathered when needed).

Before the sweep (GPU), the indexer's launch configuration is picked by timing, and the sparse-attention kernels are
timed: FlashMLA through :mod:`dtkv.attention` (its fp8 sparse kernel over the pages, indices built by the seam),
dtkv's Triton ``dtkv::sparse_mla`` and a same-FLOP stand-in (two dense bf16 GEMMs per slab). ``--attention auto``
runs FlashMLA wherever it is installed (``pip install --no-deps sgl-flash-mla==1.0.0``) and fits, else the Triton
kernel when it reaches half of FlashMLA's published 640 TFLOP/s, else the stand-in; every throughput is reported
and the attention used is named in the results. One GPU works too (``torchrun --nproc-per-node 1``: cp = 1, every
mode on one rank, the views gathered from itself).

Results (rank 0): ``prefill_<hw>_<date>.jsonl``, ``.md`` and ``.png`` (overhead vs context, with the intervals)
under ``$OUT`` when set, else ``benchmarks/results/``; with ``--profile`` a ``torch.profiler`` trace per mode of one
step at the largest context, and ``prefill_profile_<hw>_<date>.md``: per mode the compute stream's busy and idle
time, kernel time per category and its difference from ``replicated``, the longest NCCL wait, the other streams'
overlap with the compute stream (also printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_bench as db  # noqa: E402
import _dsa_kernels as K  # noqa: E402
from _dsa_layer import MODES, TINY, Dims, Runner, Weights, template_pages  # noqa: E402
from _trace import profile_table, trace_summary  # noqa: E402

from dtkv.attention import availability, fit_errors, resolve_attention  # noqa: E402

__all__ = ["main", "profile_table", "run_context", "summary", "trace_summary"]

OVERHEAD_TARGET = 0.01
"""Sharded with prefetch: at most +1.0% step time over replicated at 64K-256K tokens."""


# ------------------------------------------------------------------------------------------- calibration
def _time(fn, dev, reps: int = 3) -> float:
    fn()
    db.sync(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def calibrate(d: Dims, dev: torch.device, n: int, kv_len: int) -> dict:
    """Indexer launch configuration and throughput; sparse-attention kernel vs stand-in throughput (one rank)."""
    g = torch.Generator(device=dev).manual_seed(3)
    tpl = template_pages(d, dev)
    num_pages = -(-kv_len // d.page_size)
    pages = tpl["index"].index_select(0, torch.arange(num_pages, device=dev) % tpl["index"].shape[0])
    q = torch.randn(n, d.index_heads, d.index_dim, generator=g, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(n, d.index_heads, generator=g, device=dev)
    pos = torch.arange(kv_len - n, kv_len, device=dev)
    pt = torch.arange(num_pages, device=dev, dtype=torch.int32)
    out = {"indexer_config": None, "indexer_tflops": 0.0}
    flops = K.indexer_flops(pos, d.index_heads, d.index_dim)
    for cfg in K.INDEXER_CONFIGS:
        ms = _time(lambda cfg=cfg, pages=pages: K.indexer_logits(q.view(torch.uint8), w, pages, pt, pos, kv_len,
                                                                   d.page_size, config=cfg), dev)  # fmt: skip
        if flops / ms / 1e9 > out["indexer_tflops"]:
            out.update(indexer_config=cfg, indexer_tflops=round(flops / ms / 1e9, 1))
    del pages
    rows = tpl["kv"].reshape(-1, d.kv_layout.row_bytes).repeat(max(1, kv_len // (64 * d.page_size)), 1)
    locs = torch.randint(0, rows.shape[0], (n, d.top_k), generator=g, device=dev, dtype=torch.int32)
    qf = torch.randn(n, d.heads, d.kv_lora + d.rope, generator=g, device=dev, dtype=torch.bfloat16)
    flops = K.sparse_mla_flops(n, d.heads, d.top_k, d.kv_lora, d.rope)
    args = (qf, rows, locs, 0.07, d.kv_lora, d.rope, d.quant_block)
    try:
        out["triton_attention_tflops"] = round(flops / _time(lambda: K.sparse_mla(*args), dev) / 1e9, 1)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build is reported, and the stand-in used
        out["triton_attention_tflops"], out["triton_attention_error"] = 0.0, f"{type(e).__name__}: {e}"[:300]
    out["standin_attention_tflops"] = round(flops / _time(lambda: K.sparse_mla_standin(*args), dev) / 1e9, 1)
    why = availability("flashmla", dev) or "; ".join(fit_errors("flashmla", d.attention_spec, device=dev))
    if why:
        out["flashmla_attention_tflops"], out["flashmla_unavailable"] = 0.0, why[:300]
    else:  # through the seam, as the layers call it: indices (one launch) + the fp8 sparse kernel over the pages
        fm = resolve_attention("flashmla", spec=d.attention_spec, device=dev)
        pages = rows[: rows.shape[0] // d.page_size * d.page_size].view(-1, d.page_size, d.kv_layout.row_bytes)
        locs_fm = locs.remainder(pages.shape[0] * d.page_size)

        def run_fm():
            fm.prefill(qf, pages, fm.indices(locs_fm, pages), softmax_scale=0.07)

        out["flashmla_attention_tflops"] = round(flops / _time(run_fm, dev) / 1e9, 1)
    return out


# ------------------------------------------------------------------------------------------- one context
def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def _mark(dev):
    if dev.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _allocated(dev) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _pool_digest(runner: Runner) -> str:
    """Digest of every stored byte in logical page order (collective in the sharded modes)."""
    h = hashlib.sha256()
    for layer in range(runner.num_layers):
        full = runner.pool.gather_full(layer)
        for name in sorted(full):
            h.update(full[name].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _step(runner: Runner, prefix: int, chunk: int, base: torch.Tensor, *, record: bool) -> torch.Tensor:
    """Plan (host) and run one step; returns the layer stack's output for this rank's tokens."""
    plan = runner.plan(prefix, chunk)
    return runner.step(plan, base[: plan.positions.numel()], record=record)


def schedule(runs: list, num_samples: int, prefixes: list[int]) -> list[tuple[int, int, object]]:
    """``(sample, prefix, run)`` in execution order: per sample every run once, the order rotating with the sample
    (each run is first, second, ... equally often), the prefixes taken in turn."""
    out = []
    for i in range(num_samples):
        k = i % len(runs)
        out += [(i, prefixes[i % len(prefixes)], run) for run in runs[k:] + runs[:k]]
    return out


def run_context(T: int, args, d: Dims, w: Weights, dev, cal: dict, history_group) -> list[dict]:
    world = dist.get_world_size()
    C, ps = args.chunk, d.page_size
    prefixes = [T - k * C for k in range(args.timed_chunks, 0, -1) if T - k * C >= 0]
    num_pages = -(-(-(-T // ps) + world) // world) * world
    g = torch.Generator(device=dev).manual_seed(11)
    base = torch.randn(C, d.hidden, generator=g, device=dev).to(args.dtype)
    templates = template_pages(d, dev)
    runs = [(m, b) for m in args.modes for b in (args.backend if m != "replicated" else ["-"])]
    runners, persistent = {}, {}
    baseline = _allocated(dev)
    for mode, backend in runs:
        before = _allocated(dev)
        runner = Runner(mode, d, w, num_layers=args.layers, num_pages=num_pages, group=dist.group.WORLD, device=dev,
                        attention=cal["attention"], indexer_config=cal.get("indexer_config"),
                        backend="auto" if backend == "-" else backend, history_group=history_group)  # fmt: skip
        runner.fill_history(templates)
        runner.prepare(prefixes[-1], C)  # views sized for the largest step: nothing allocated while timing
        runners[(mode, backend)] = runner
        persistent[(mode, backend)] = _allocated(dev) - before
    for _ in range(args.warmup_chunks):
        for runner in runners.values():
            _step(runner, prefixes[-1], C, base, record=False)
    for runner in runners.values():
        runner.exposed_ms_per_layer()  # drop the warm-up's events
    db.barrier(dev)
    marks: dict[tuple, list] = {run: [] for run in runs}
    last_x = {}
    for _, prefix, run in schedule(runs, args.samples, prefixes):
        runner = runners[run]
        start = _mark(dev)
        last_x[run] = _step(runner, prefix, C, base, record=True)
        marks[run].append((start, _mark(dev)))
    db.sync(dev)
    times = {run: [_elapsed(a, b) for a, b in m] for run, m in marks.items()}
    transient = {}
    for run, runner in runners.items():  # peak memory of each mode alone: its state plus one step's temporaries
        db.sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        before = _allocated(dev)
        _step(runner, prefixes[-1], C, base, record=False)
        db.sync(dev)
        transient[run] = (torch.cuda.max_memory_allocated(dev) - before) if dev.type == "cuda" else None
    rows = []
    ref = times.get(("replicated", "-"))
    for run, runner in runners.items():  # replicated: overhead 0 by definition, no interval
        mode, _ = run
        t, exposed = times[run], runner.exposed_ms_per_layer()
        row = {
            "context": T, "cp": world, "mode": mode, "chunk": C, "layers": args.layers,
            "timed_chunks": len(prefixes), "samples": len(t), "step_ms_median": round(statistics.median(t), 3),
            "step_ms_p90": round(db.p90(t), 3), "overhead_ci95": None,
            "overhead_vs_replicated": 0.0 if mode == "replicated" and ref is not None else None,
            "overhead_ratio_of_medians": None, "overhead_stdev": None, "verdict_1pct": None,
            "exposed_gather_ms_per_layer": round(statistics.median(exposed), 4) if exposed else 0.0,
            "view_gathered_bytes_per_step": runner.stats["gathered_bytes"] if runner.sharded else 0,
            "kv_rows_gathered_bytes_per_step": args.layers * world * (C // world + ps) * d.row_dim * 2,
            "kv_bytes_per_rank": runner.pool.bytes_per_rank(), "kv_bytes_replicated": runner.pool.replicated_bytes(),
            "peak_bytes": None if transient[run] is None else baseline + persistent[run] + transient[run],
            "scratch_bytes": runner.stats["scratch_bytes"],
            "view_bytes_per_layer": runner.stats["gathered_bytes"] // args.layers if runner.sharded else 0,
            "materialize_backend": runner.mat.backend if runner.mat is not None else "none",
            "step_ms_samples": [round(x, 3) for x in t],
            **{k: v for k, v in cal.items() if k != "indexer_config"},
        }  # fmt: skip
        if ref is not None and mode != "replicated":
            stats = db.paired_overhead(t, ref)
            row.update(overhead_vs_replicated=round(stats["overhead"], 5),
                       overhead_ci95=[round(x, 5) for x in stats["ci95"]],
                       overhead_ratio_of_medians=round(statistics.median(t) / statistics.median(ref) - 1, 5),
                       overhead_stdev=round(stats["stdev"], 5),
                       verdict_1pct=db.verdict(stats["ci95"], OVERHEAD_TARGET))  # fmt: skip
        if args.verify:
            row["x_digest"] = _digest(last_x[run])
            row["kv_digest"] = _pool_digest(runner)
        rows.append(row)
    if args.profile and T == max(args.contexts):
        for run, runner in runners.items():
            used = runner.mat.backend if runner.mat is not None else "none"
            _profile(runner, prefixes[-1], C, base, dev, args, f"{run[0]}-{used}", T)
    del runners
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------- profile
def _profile(runner: Runner, prefix: int, C: int, base, dev, args, mode: str, T: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    db.barrier(dev)
    with profile(activities=acts) as prof:
        _step(runner, prefix, C, base, record=False)
        db.sync(dev)
    if dist.get_rank() == 0:
        out = db.out_dir(args.out_dir) / f"prefill_trace_{mode}_{T}.json"
        prof.export_chrome_trace(str(out))
        args.profiles[mode] = trace_summary(out)


# ------------------------------------------------------------------------------------------- outputs
def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.2f}%"


def summary(rows: list[dict], title: str, extra: str = "") -> str:
    lines = [f"# {title}", "", extra, "",
             "| context | mode | backend | step ms (median) | p90 | overhead vs replicated (paired median) | 95% CI | "
             "ratio of medians | exposed gather ms/layer | view MB/layer | gathered MB/step (views + KV rows) | "
             "KV GB/rank | peak GB | scratch / view |",
             "|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        view = r["view_bytes_per_layer"]
        ratio = f"{r['scratch_bytes'] / view:.2f}" if view else ""
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.2f}"
        gathered = (r["view_gathered_bytes_per_step"] + r["kv_rows_gathered_bytes_per_step"]) / 1e6
        ci = "" if r["overhead_ci95"] is None else f"[{_pct(r['overhead_ci95'][0])}, {_pct(r['overhead_ci95'][1])}]"
        lines.append(
            f"| {r['context']} | {r['mode']} | {r['materialize_backend']} | {r['step_ms_median']} | "
            f"{r['step_ms_p90']} | {_pct(r['overhead_vs_replicated'])} | {ci} | {_pct(r['overhead_ratio_of_medians'])} "
            f"| {r['exposed_gather_ms_per_layer']} | {view / 1e6:.1f} | {gathered:.1f} | "
            f"{r['kv_bytes_per_rank'] / 1e9:.3f} | {peak} | {ratio} |"
        )
    return "\n".join(lines + ["", "## Targets", ""] + target_lines(rows)) + "\n"


def target_lines(rows: list[dict]) -> list[str]:
    """The issue's targets, one line each (also printed at the end of the run)."""
    lines = []
    pf = [r for r in rows if r["mode"] == "sharded_prefetch" and r["context"] >= 65536 and r["overhead_ci95"]]
    for r in pf:
        lines.append(f"- TARGET overhead, sharded_prefetch ({r['materialize_backend']}), {r['context'] // 1024}K: "
                     f"{_pct(r['overhead_vs_replicated'])} [95% CI {_pct(r['overhead_ci95'][0])}, "
                     f"{_pct(r['overhead_ci95'][1])}], n={r['samples']} (target <= +1.0%): **{r['verdict_1pct']}**")  # fmt: skip
    if pf:
        verdicts = {r["verdict_1pct"] for r in pf}
        worst = max(pf, key=lambda r: r["overhead_vs_replicated"])
        overall = "not met" if "not met" in verdicts else "inconclusive" if "inconclusive" in verdicts else "met"
        lines.append(f"- TARGET overhead, sharded_prefetch, 64K-256K: worst median {_pct(worst['overhead_vs_replicated'])} "
                     f"at {worst['context'] // 1024}K: **{overall}**")  # fmt: skip
    sh = [r for r in rows if r["mode"] != "replicated"]
    rep = {r["context"]: r for r in rows if r["mode"] == "replicated"}
    if sh and rep:
        ok = all(r["kv_bytes_per_rank"] * r["cp"] == rep[r["context"]]["kv_bytes_per_rank"] for r in sh
                 if r["context"] in rep)  # fmt: skip
        lines.append(f"- TARGET KV bytes per rank = 1/cp of replicated: **{'met' if ok else 'not met'}**")
        ratios = [r["scratch_bytes"] / r["view_bytes_per_layer"] for r in sh if r["view_bytes_per_layer"]]
        if ratios:
            ratio = max(ratios)
            lines.append(f"- TARGET materialization scratch <= 2 layers of view: {ratio:.3f} layers: "
                         f"**{'met' if ratio <= 2.0 + 1e-9 else 'not met'}**")  # fmt: skip
    return lines


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, backend in sorted({(r["mode"], r["materialize_backend"]) for r in rows if r["mode"] != "replicated"}):
        pts = sorted((r["context"], r["overhead_vs_replicated"], r["overhead_ci95"]) for r in rows
                     if (r["mode"], r["materialize_backend"]) == (mode, backend))  # fmt: skip
        if pts and all(p[1] is not None for p in pts):
            xs, ys = [p[0] / 1024 for p in pts], [100 * p[1] for p in pts]
            err = [[100 * (p[1] - p[2][0]) for p in pts], [100 * (p[2][1] - p[1]) for p in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{mode} ({backend})")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="target +1%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("step time overhead vs replicated (%)")
    ax.set_title(f"CP prefill, cp={rows[0]['cp']}, chunk {rows[0]['chunk']}, {rows[0]['layers']} DSA layers\n"
                 "paired median, 95% CI", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="*", help="tokens (default GPU: 32K 64K 128K 256K)")
    ap.add_argument("--chunk", type=int, help="tokens per prefill chunk (default GPU 8192)")
    ap.add_argument("--layers", type=int, default=None, help="DSA layers (default 4; --tiny 2)")
    ap.add_argument("--timed-chunks", type=int, help="last chunks of each context whose steps are timed (default 6)")
    ap.add_argument("--samples", type=int, help="timed steps per mode and context (default GPU 30; --tiny 3)")
    ap.add_argument("--warmup-chunks", type=int, help="untimed steps per mode and context first (default 1)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument(
        "--backend",
        nargs="*",
        default=["auto"],
        help="Materializer backends the sharded modes run with: auto, all_gather, copy_engine",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "flashmla", "triton", "standin", "torch"],
        help="the layers' sparse attention (dtkv.attention): auto = FlashMLA where it is installed and fits, else "
        "Triton if it reaches half of FlashMLA's published throughput, else the same-FLOP stand-in (labelled); "
        "CPU runs use torch (or the stand-in when asked for)",
    )
    ap.add_argument(
        "--no-dedicated-history-group",
        dest="dedicated",
        action="store_false",
        help="gather history views on the model's communicator (default: a dedicated one)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions (the CPU default): a smoke run")
    ap.add_argument("--verify", action="store_true", help="digest every mode's stored KV and activations")
    ap.add_argument("--profile", action="store_true", help="torch.profiler trace per mode at the largest context")
    ap.add_argument("--json", action="store_true", help="print one JSON object per (context, mode)")
    ap.add_argument("--out-dir", help="where results go (default $OUT, else benchmarks/results)")
    args = ap.parse_args(argv)
    rank, world, dev = db.init()
    gpu = dev.type == "cuda"
    tiny = args.tiny or not gpu
    d = TINY if tiny else Dims()
    args.contexts = args.contexts or ([48, 64] if tiny else [32768, 65536, 131072, 262144])
    args.chunk = args.chunk or (8 if tiny else 8192)
    args.layers = args.layers or (2 if tiny else 4)
    args.timed_chunks = args.timed_chunks or (2 if tiny else 6)
    args.samples = args.samples or (3 if tiny else 30)
    args.warmup_chunks = 1 if args.warmup_chunks is None else args.warmup_chunks
    args.dtype = torch.bfloat16
    args.profiles = {}
    t0 = time.perf_counter()
    w = Weights(d, dev, args.dtype)
    cal = {"attention": args.attention if gpu else ("standin" if args.attention == "standin" else "torch")}
    if gpu:
        n = args.chunk // world
        cal.update(calibrate(d, dev, n, max(args.contexts)))
        if args.attention == "auto":
            good = cal["triton_attention_tflops"] >= 0.5 * K.FLASHMLA_SPARSE_PREFILL_TFLOPS
            fm = cal["flashmla_attention_tflops"] > 0
            cal["attention"] = "flashmla" if fm else "triton" if good else "standin"
        cal["attention_tflops"] = cal.get(f"{cal['attention']}_attention_tflops")
        if rank == 0:
            print(f"calibration: {json.dumps(cal)}", flush=True)
    history_group = dist.new_group(list(range(world))) if args.dedicated and world > 1 else None
    rows = []
    for T in args.contexts:
        new = run_context(T, args, d, w, dev, cal, history_group)
        rows += new
        if rank == 0:
            for r in new:
                brief = {k: v for k, v in r.items() if k != "step_ms_samples"}
                print(json.dumps(brief) if args.json else
                      f"T={r['context']} {r['mode']}: {r['step_ms_median']} ms ({_pct(r['overhead_vs_replicated'])} "
                      f"CI {r['overhead_ci95']})", flush=True)  # fmt: skip
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(dev) if gpu else "cpu", **db.versions()}
        rows = [{**r, **meta} for r in rows]
        name = f"prefill_{db.hardware_tag(dev, world)}_{db.today()}"
        out = db.out_dir(args.out_dir)
        db.write_jsonl(out / f"{name}.jsonl", rows)
        extra = (f"dims: {'tiny' if tiny else 'DeepSeek-V3.2'} ({d}); chunk {args.chunk}; {args.layers} layers; "
                 f"cp={world}; modes interleaved, {args.samples} paired samples per mode and context over the last "
                 f"{args.timed_chunks} chunks; attention: {cal['attention']}; calibration: {json.dumps(cal)}; "
                 f"command: `{' '.join(sys.argv)}`; {time.perf_counter() - t0:.0f} s")  # fmt: skip
        text = summary(rows, name, extra)
        (out / f"{name}.md").write_text(text)
        figure(rows, out / f"{name}.png")
        if args.profiles:
            ref = next((m for m in args.profiles if m.startswith("replicated")), None)
            prof = [f"# {name} profile (one step at {max(args.contexts)} tokens, rank 0)", "",
                    profile_table(args.profiles, ref), ""]  # fmt: skip
            prof += [f"- **{mode}**: `{json.dumps(s)}`" for mode, s in args.profiles.items()]
            text_prof = "\n".join(prof) + "\n"
            (out / f"prefill_profile_{db.hardware_tag(dev, world)}_{db.today()}.md").write_text(text_prof)
            print(text_prof)
        print(text)
        print(f"wrote {out / name}.jsonl, .md and .png")
    db.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
