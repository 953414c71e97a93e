"""What sharding costs: CP prefill of DSA layers at DeepSeek-V3.2 dimensions, replicated vs sharded KV.

One command (2 GPUs; about 3-4 minutes for the whole sweep on 2 H200s, most of it Triton compilation and setup)::

    torchrun --nproc-per-node 2 benchmarks/bench_prefill.py --json [--profile]

and on a CPU machine the same command runs a tiny gloo smoke (``--tiny`` sizes: it checks that every mode stores the
same KV bytes and computes the same activations). The layer stack is described in ``_dsa_layer.py``: projections,
fused fp8 KV writes, the indexer over the whole index-K, top-k remapped into view coordinates, sparse MLA attention,
an FFN with the active experts' FLOPs, ``--layers`` of them (default 4), ``cp`` = the number of ranks.

What is timed, per context ``T`` (default 32K, 64K, 128K, 256K) and mode: one request, chunked prefill with chunks
of ``--chunk`` tokens (default 8192). The history before the timed chunks is not computed: its pages are filled with
valid fp8 pages (the same bytes, by logical page, in every mode). The last ``--warmup-chunks + --timed-chunks`` chunks
of the context then run back to back (the host planning each step while the GPU runs the previous one), and the step
times of the last ``--timed-chunks`` are reported (median, p90): the history is longest there, which is what the
history gather scales with. ``exposed_gather_ms_per_layer``: time the compute stream waited inside
``Materializer.view`` (device events around it). Modes: ``replicated`` (every rank stores the whole pool),
``sharded_prefetch`` (the history view of layer ``l + 1`` gathered while layer ``l`` computes, on its own stream),
``sharded`` (gathered when needed). Modes run one after another on the same inputs.

Before the sweep (GPU), the indexer's launch configuration is picked by timing, and the sparse-attention kernel is
timed against a same-FLOP stand-in (two dense bf16 GEMMs per slab): ``--attention auto`` keeps the Triton kernel
when it reaches half of FlashMLA's published 640 TFLOP/s, else the stand-in; both throughputs are reported.

Results (rank 0): ``prefill_<hw>_<date>.jsonl``, ``.md`` and ``.png`` (overhead vs context) under ``$OUT`` when set,
else ``benchmarks/results/``; with ``--profile`` a ``torch.profiler`` trace per mode at the largest context and a
summary (``prefill_profile_<hw>_<date>.md``: kernel overlap between streams, NCCL kernels' time, copy-engine time,
stream waits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_bench as db  # noqa: E402
import _dsa_kernels as K  # noqa: E402
from _dsa_layer import MODES, TINY, Dims, Runner, Weights, template_pages  # noqa: E402


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
    return out


# ------------------------------------------------------------------------------------------- one context
def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def run_context(T: int, args, d: Dims, w: Weights, dev, cal: dict, history_group) -> list[dict]:
    world = dist.get_world_size()
    C, ps = args.chunk, d.page_size
    steps = args.warmup_chunks + args.timed_chunks
    prefixes = [T - (steps - s) * C for s in range(steps) if T - (steps - s) * C >= 0]
    warm = max(0, len(prefixes) - args.timed_chunks)
    num_pages = -(-(-(-T // ps) + world) // world) * world
    g = torch.Generator(device=dev).manual_seed(11)
    base = torch.randn(C, d.hidden, generator=g, device=dev).to(args.dtype)
    templates = template_pages(d, dev)
    rows = []
    runs = [(m, b) for m in args.modes for b in (args.backend if m != "replicated" else ["-"])]
    for mode, backend in runs:
        runner = Runner(mode, d, w, num_layers=args.layers, num_pages=num_pages, group=dist.group.WORLD, device=dev,
                        attention=cal["attention"], indexer_config=cal.get("indexer_config"),
                        backend="auto" if backend == "-" else backend, history_group=history_group)  # fmt: skip
        runner.fill_history(templates)
        if runner.sharded:  # size the copy-engine workspace for the largest view now, not mid-run
            runner.plan(prefixes[-1], C)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        db.barrier(dev)
        marks, x, backend_used = [], None, "none"
        for s, prefix in enumerate(prefixes):
            plan = runner.plan(prefix, C)
            backend_used = plan.mat.backend if plan.mat is not None else "none"
            marks.append(_mark(dev))
            x = runner.step(plan, base[: plan.positions.numel()], record=s >= warm)
        marks.append(_mark(dev))
        db.sync(dev)
        times = [_elapsed(a, b) for a, b in zip(marks[warm:-1], marks[warm + 1 :])]
        exposed = runner.exposed_ms_per_layer()
        row = {
            "context": T, "cp": world, "mode": mode, "chunk": C, "layers": args.layers,
            "timed_chunks": len(times), "step_ms_median": round(statistics.median(times), 3),
            "step_ms_p90": round(db.p90(times), 3), "overhead_vs_replicated": None,
            "exposed_gather_ms_per_layer": round(statistics.median(exposed), 4) if exposed else 0.0,
            "view_gathered_bytes_per_step": runner.stats["gathered_bytes"] if runner.sharded else 0,
            "kv_rows_gathered_bytes_per_step": args.layers * world * (C // world + ps) * d.row_dim * 2,
            "kv_bytes_per_rank": runner.pool.bytes_per_rank(), "kv_bytes_replicated": runner.pool.replicated_bytes(),
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "scratch_bytes": runner.stats["scratch_bytes"],
            "view_bytes_per_layer": runner.stats["gathered_bytes"] // args.layers if runner.sharded else 0,
            "materialize_backend": backend_used, **{k: v for k, v in cal.items() if k != "indexer_config"},
        }  # fmt: skip
        if args.verify:
            row["x_digest"] = _digest(x)
            row["kv_digest"] = _pool_digest(runner)
        if args.profile and T == max(args.contexts):
            _profile(runner, prefixes[-1], C, base, dev, args, f"{mode}-{backend_used}", T)
        rows.append(row)
        del runner, plan
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    ref = next((r for r in rows if r["mode"] == "replicated"), None)
    for r in rows:
        if ref is not None:
            r["overhead_vs_replicated"] = round(r["step_ms_median"] / ref["step_ms_median"] - 1, 4)
    return rows


def _mark(dev):
    if dev.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _pool_digest(runner: Runner) -> str:
    """Digest of every stored byte in logical page order (collective in the sharded modes)."""
    h = hashlib.sha256()
    for layer in range(runner.num_layers):
        full = runner.pool.gather_full(layer)
        for name in sorted(full):
            h.update(full[name].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------- profile
def _profile(runner: Runner, prefix: int, C: int, base, dev, args, mode: str, T: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    plan = runner.plan(prefix, C)
    db.barrier(dev)
    with profile(activities=acts) as prof:
        runner.step(plan, base[: plan.positions.numel()], record=False)
        db.sync(dev)
    if dist.get_rank() == 0:
        out = db.out_dir(args.out_dir) / f"prefill_trace_{mode}_{T}.json"
        prof.export_chrome_trace(str(out))
        args.profiles[mode] = trace_summary(out)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersect(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_summary(path: Path) -> dict:
    """Per stream busy time and overlap with the compute stream, NCCL kernel time, copies, stream waits (ms)."""
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams = defaultdict(list)
    for e in gpu:
        streams[e.get("args", {}).get("stream", -1)].append((e["ts"], e["ts"] + e["dur"]))
    unions = {s: _union(iv) for s, iv in streams.items()}
    main = max(unions, key=lambda s: _length(unions[s])) if unions else None
    window = (
        (max(b for iv in unions.values() for _, b in iv) - min(a for iv in unions.values() for a, _ in iv))
        if (unions)
        else 0.0
    )
    waits = [e for e in events if e.get("ph") == "X" and "StreamWaitEvent" in e.get("name", "")]
    return {
        "window_ms": round(window / 1e3, 3),
        "compute_stream": main,
        "compute_busy_ms": round(_length(unions.get(main, [])) / 1e3, 3),
        "streams": {
            str(s): {
                "busy_ms": round(_length(iv) / 1e3, 3),
                "overlap_with_compute_ms": round(_intersect(iv, unions[main]) / 1e3, 3),
            }
            for s, iv in unions.items()
            if s != main
        },  # fmt: skip
        "nccl_kernel_ms": round(sum(e["dur"] for e in gpu if "nccl" in e["name"].lower()) / 1e3, 3),
        "copy_ms": round(sum(e["dur"] for e in gpu if e.get("cat") == "gpu_memcpy") / 1e3, 3),
        "stream_waits": len(waits),
        "stream_wait_host_ms": round(sum(e["dur"] for e in waits) / 1e3, 3),
    }


# ------------------------------------------------------------------------------------------- outputs
def summary(rows: list[dict], title: str, extra: str = "") -> str:
    lines = [f"# {title}", "", extra, "",
             "| context | mode | backend | step ms (median) | p90 | overhead vs replicated | exposed gather ms/layer | "
             "view MB/layer | gathered MB/step (views + KV rows) | KV GB/rank | peak GB | scratch / view |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ov = "" if r["overhead_vs_replicated"] is None else f"{100 * r['overhead_vs_replicated']:+.2f}%"
        view = r["view_bytes_per_layer"]
        ratio = f"{r['scratch_bytes'] / view:.2f}" if view else ""
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.2f}"
        gathered = (r["view_gathered_bytes_per_step"] + r["kv_rows_gathered_bytes_per_step"]) / 1e6
        lines.append(
            f"| {r['context']} | {r['mode']} | {r['materialize_backend']} | {r['step_ms_median']} | {r['step_ms_p90']} | {ov} | "
            f"{r['exposed_gather_ms_per_layer']} | {view / 1e6:.1f} | {gathered:.1f} | "
            f"{r['kv_bytes_per_rank'] / 1e9:.3f} | {peak} | {ratio} |"
        )
    lines += ["", "## Targets", ""]
    pf = [r for r in rows if r["mode"] == "sharded_prefetch" and r["context"] >= 65536]
    if pf:
        worst = max(r["overhead_vs_replicated"] or 0 for r in pf)
        lines.append(f"- sharded with prefetch, 64K-256K: worst overhead {100 * worst:+.2f}% (target <= +1.0%): "
                     f"**{'met' if worst <= 0.01 else 'not met'}**")  # fmt: skip
    sh = [r for r in rows if r["mode"] != "replicated"]
    rep = {r["context"]: r for r in rows if r["mode"] == "replicated"}
    if sh and rep:
        ok = all(r["kv_bytes_per_rank"] * r["cp"] == rep[r["context"]]["kv_bytes_per_rank"] for r in sh)
        lines.append(f"- KV bytes per rank = 1/cp of replicated: **{'met' if ok else 'not met'}**")
        ratio = max(r["scratch_bytes"] / r["view_bytes_per_layer"] for r in sh if r["view_bytes_per_layer"])
        lines.append(f"- materialization scratch <= 2 layers of view: {ratio:.2f} layers: "
                     f"**{'met' if ratio <= 2.0 + 1e-9 else 'not met'}**")  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, backend in sorted({(r["mode"], r["materialize_backend"]) for r in rows if r["mode"] != "replicated"}):
        pts = sorted((r["context"], r["overhead_vs_replicated"]) for r in rows
                     if (r["mode"], r["materialize_backend"]) == (mode, backend))  # fmt: skip
        if pts and all(p[1] is not None for p in pts):
            ax.plot([p[0] / 1024 for p in pts], [100 * p[1] for p in pts], marker="o", label=f"{mode} ({backend})")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="target +1%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("step time overhead vs replicated (%)")
    ax.set_title(f"CP prefill, cp={rows[0]['cp']}, chunk {rows[0]['chunk']}, {rows[0]['layers']} DSA layers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="*", help="tokens (default GPU: 32K 64K 128K 256K)")
    ap.add_argument("--chunk", type=int, help="tokens per prefill chunk (default GPU 8192)")
    ap.add_argument("--layers", type=int, default=None, help="DSA layers (default 4; --tiny 2)")
    ap.add_argument("--timed-chunks", type=int, help="chunks timed per context and mode (default 6; --tiny 2)")
    ap.add_argument("--warmup-chunks", type=int, help="chunks run before them (default 2; --tiny 1)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument(
        "--backend",
        nargs="*",
        default=["auto"],
        help="Materializer backends the sharded modes run with: auto, all_gather, copy_engine",
    )
    ap.add_argument("--attention", default="auto", choices=["auto", "triton", "standin", "torch"])
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
    args.warmup_chunks = (1 if tiny else 2) if args.warmup_chunks is None else args.warmup_chunks
    args.dtype = torch.bfloat16
    args.profiles = {}
    t0 = time.perf_counter()
    w = Weights(d, dev, args.dtype)
    cal = {"attention": "torch" if not gpu else args.attention}
    if gpu:
        n = args.chunk // world
        cal.update(calibrate(d, dev, n, max(args.contexts)))
        if args.attention == "auto":
            good = cal["triton_attention_tflops"] >= 0.5 * K.FLASHMLA_SPARSE_PREFILL_TFLOPS
            cal["attention"] = "triton" if good else "standin"
        cal["attention_tflops"] = cal[f"{'triton' if cal['attention'] == 'triton' else 'standin'}_attention_tflops"]
        if rank == 0:
            print(f"calibration: {json.dumps(cal)}", flush=True)
    history_group = dist.new_group(list(range(world))) if args.dedicated and world > 1 else None
    rows = []
    for T in args.contexts:
        new = run_context(T, args, d, w, dev, cal, history_group)
        rows += new
        if rank == 0:
            for r in new:
                print(json.dumps(r) if args.json else
                      f"T={r['context']} {r['mode']}: {r['step_ms_median']} ms ({r['overhead_vs_replicated']})",
                      flush=True)  # fmt: skip
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(dev) if gpu else "cpu", **db.versions()}
        rows = [{**r, **meta} for r in rows]
        name = f"prefill_{db.hardware_tag(dev, world)}_{db.today()}"
        out = db.out_dir(args.out_dir)
        db.write_jsonl(out / f"{name}.jsonl", rows)
        extra = (f"dims: {'tiny' if tiny else 'DeepSeek-V3.2'} ({d}); chunk {args.chunk}; {args.layers} layers; "
                 f"cp={world}; attention: {cal['attention']}; calibration: {json.dumps(cal)}; command: "
                 f"`{' '.join(sys.argv)}`; {time.perf_counter() - t0:.0f} s")  # fmt: skip
        text = summary(rows, name, extra)
        (out / f"{name}.md").write_text(text)
        figure(rows, out / f"{name}.png")
        if args.profiles:
            prof = [f"# {name} profile (one step at {max(args.contexts)} tokens, rank 0)", ""]
            for mode, s in args.profiles.items():
                prof.append(f"- **{mode}**: `{json.dumps(s)}`")
            (out / f"prefill_profile_{db.hardware_tag(dev, world)}_{db.today()}.md").write_text("\n".join(prof) + "\n")
        print(text)
        print(f"wrote {out / name}.jsonl, .md and .png")
    db.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
