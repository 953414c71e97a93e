"""Full views against the wire: ``Materializer.view`` vs the raw all-gather of the same bytes, alone and overlapped.

One command each (2 GPUs; on a CPU machine the same commands run a small gloo smoke)::

    torchrun --nproc-per-node 2 benchmarks/bench_materialize.py --check   # bitwise checks of every path, then exit
                                                                          # (also replan and interleaved Materializers)
    torchrun --nproc-per-node 2 benchmarks/bench_materialize.py           # the sweep (about 2 minutes on 2 H200s)
    python benchmarks/bench_materialize.py --summary FILE.jsonl           # markdown summary of a results file

Geometry: DeepSeek-V3.2 KV, the 656-byte fp8 MLA row and the 8448-byte indexer page, page size 64; one request of
``T`` tokens whose pages are all history (prefetchable), ``interleave`` ownership; 128K tokens is about 103 MB of view
per layer (the overlap target's size). ``in_order``: the request's pages were allocated in order, so each rank's
pages sit in its pool in send order (all-gather: the send buffer is a pool slice; copy engines: one ``copy_`` per
layout into this rank's rows of its view; no pack kernel); ``shuffled``: a random page order (one pack launch per
layer for both layouts).

What is timed (device events, median over ``--reps``, every rank starting together):

- ``view_ms``: ``L`` layers of ``view(l)`` (with ``prefetch``: ``prefetch(0)`` then ``prefetch(l + 1); view(l)``),
  nothing else running; ``raw_allgather_ms``: ``L`` ``all_gather_into_tensor`` calls of the same per-rank bytes;
  ``efficiency_vs_raw = raw_allgather_ms / view_ms``. ``graphs``: after ``Materializer.capture()``.
- ``host_us_per_layer``: wall-clock time of the Python calls per layer (the GPU is not waited for).
- Overlap (``L = max(--layers)``, prefetch on): GEMM-bound layers of 3 bf16 GEMMs ``4096 x 7168 x 14336``. Each
  layer runs GEMM 1 (the projections, before attention needs the view), ``view(l)``, ``prefetch(l + 1)``, GEMMs 2
  and 3: ``overlap_overhead_vs_compute`` is that time over the GEMMs alone, minus 1 (the first layer's gather
  overlaps GEMM 1 of layer 0). ``overlap_overhead_first_exposed`` uses the probes' order instead
  (``prefetch(l + 1); view(l)`` before all three GEMMs: the first gather is exposed). Both are medians of the
  ratios of interleaved repetitions, so clock drift cancels; ``overlap_ci95`` is the 95% bootstrap interval of the
  first. The summary ends with one ``TARGET`` line per target (view speed and host time per size, eager and graphs;
  overlap at 50-200 MB per layer: met when the whole interval is at or below +1.0%).

Results (rank 0): ``materialize_<hw>_<date>.jsonl`` and ``.md`` under ``$OUT`` (when set), else
``benchmarks/results/``. Keys: ``tokens``, ``layers``, ``backend``, ``order``, ``prefetch``, ``graphs``,
``view_MB_per_layer``, ``view_ms``, ``raw_allgather_ms``, ``efficiency_vs_raw``, ``host_us_per_layer``,
``overlap_overhead_vs_compute``, ``overlap_ci95``, ``overlap_overhead_first_exposed``, ``gemm_ms``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_bench as db  # noqa: E402

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership, ShardedKVPool  # noqa: E402
from dtkv._log import phase  # noqa: E402
from dtkv.materialize import Materializer, plan_materialize  # noqa: E402

PS = 64


def layouts(page_size: int = PS):
    return {"kv": MLAFp8Layout(page_size=page_size), "index": IndexerFp8Layout(page_size=page_size)}


def _capture(mat, rank: int) -> bool:
    """``mat.capture()``; False (and the reason printed) where this torch build cannot capture the gathers."""
    try:
        mat.capture()
    except RuntimeError as e:
        if rank == 0:
            print(f"capture() failed for backend {mat.backend}: {type(e).__name__}: {e}", flush=True)
        return False
    return True


# ------------------------------------------------------------------------------------------- --check
def _reference(own: PageOwnership, num_layers: int, seed: int, lays) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.randint(0, 256, (num_layers, own.num_pages, *lay.page_shape), generator=g, dtype=torch.uint8)
        for n, lay in sorted(lays.items())
    }


def _fill(pool, ref, own, rank) -> None:
    mine = own.local_pages(rank)
    for n, full in ref.items():
        pool.buffer(n).copy_(full[:, mine].to(pool.device))


def _views_ok(mats, plans, refs, num_layers: int, prefetch: bool, busy) -> bool:
    """View every layer of each Materializer (interleaved layer by layer when there are several, ``busy()`` on the
    compute stream between layers) and compare every mapped row with the reference."""
    ok = True
    if prefetch:
        for mat in mats:
            mat.prefetch(0)
    for layer in range(num_layers):
        for mat, plan, ref in zip(mats, plans, refs):
            if prefetch:
                mat.prefetch(layer + 1)
            views = mat.view(layer)
            busy()
            rows = plan.page_map[plan.pages].long()
            for n, full in ref.items():
                ok &= torch.equal(views[n][rows].view(torch.uint8).cpu(), full[layer, plan.pages.cpu()])
    return ok


def _agreed(ok: bool, dev: torch.device) -> bool:
    flag = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check(rank: int, world: int, dev: torch.device, backends: list[str]) -> bool:
    """Bitwise equality of every view row with the owners' bytes, for every backend and path (collective).

    Besides one Materializer per plan shape: ``replan`` (one Materializer serving three plans of different shapes,
    growing past its capacity once, recaptured after each replan with graphs) and ``interleaved`` (two Materializers
    on two pools, their gathers alternating layer by layer) -- both with a GEMM on the compute stream between views.
    """
    lays = layouts(16)
    num_layers = 3
    shuffled = torch.randperm(41, generator=torch.Generator().manual_seed(0))[:29].tolist()
    cases = {
        "in_order": ("interleave", 40, list(range(30)), list(range(30, 37)), False),
        "shuffled": ("interleave", 41, shuffled, [40, 3, 39], False),
        "empty_rank": ("block", max(1, world - 1), list(range(max(0, world - 2))), [max(0, world - 2)], False),
        "empty_current": ("block", 23, list(range(5, 19)), [], False),
        "write_current": ("interleave", 40, list(range(31)), list(range(31, 35)), True),
    }  # fmt: skip
    results = []
    history_group = dist.new_group(list(range(world)))  # prefetches on their own communicator (graphs need it)
    busy = _gemms(dev, 2048, 2048, 2048) if dev.type == "cuda" else (lambda: None)
    graph_modes = (False, True) if dev.type == "cuda" else (False,)
    for case, (scheme, num_pages, hist, cur, write_current) in cases.items():
        own = PageOwnership(world, num_pages, scheme)
        pool = ShardedKVPool(lays, own, num_layers=num_layers, group=dist.group.WORLD, device=dev)
        plan = plan_materialize(hist, cur, own, rank, device=dev, group=dist.group.WORLD, write_current=write_current)
        for backend in backends:
            for graphs in graph_modes:
                for prefetch in (False, True):
                    mat = Materializer(pool, plan, backend=backend, history_group=history_group)
                    if graphs and not _capture(mat, rank):
                        results.append((case, f"{backend} -> {mat.backend}", prefetch, graphs, False))
                        continue
                    ok = True
                    for seed in (1, 2):  # a second fill proves captured graphs read the live pool
                        ref = _reference(own, num_layers, seed, lays)
                        _fill(pool, ref, own, rank)
                        ok &= _views_ok([mat], [plan], [ref], num_layers, prefetch, lambda: None)
                    results.append((case, f"{backend} -> {mat.backend}", prefetch, graphs, _agreed(ok, dev)))
                    del mat
    own = PageOwnership(world, 41, "interleave")
    shapes = [(list(range(30)), list(range(30, 37)), False), (shuffled, [40, 3, 39], False),
              (list(range(36)), list(range(36, 41)), True)]  # fmt: skip
    for backend in backends:
        for graphs in graph_modes:
            pool = ShardedKVPool(lays, own, num_layers=num_layers, group=dist.group.WORLD, device=dev)
            plans = [plan_materialize(h, c, own, rank, device=dev, group=dist.group.WORLD, write_current=w)
                     for h, c, w in shapes]  # fmt: skip
            mat = Materializer(pool, plans[0], backend=backend, history_group=history_group,
                               max_view_pages=plans[1].num_view_pages)  # fmt: skip
            ok, used = True, mat.backend
            for i, plan in enumerate(plans):
                mat.replan(plan)
                if graphs and not _capture(mat, rank):
                    ok = False
                    break
                for seed in (3 + i, 13 + i):
                    ref = _reference(own, num_layers, seed, lays)
                    _fill(pool, ref, own, rank)
                    ok &= _views_ok([mat], [plan], [ref], num_layers, bool(i % 2 == 0), busy)
            results.append(("replan", f"{backend} -> {used}", "both", graphs, _agreed(ok, dev)))
            del mat, pool
            pools = [ShardedKVPool(lays, own, num_layers=num_layers, group=dist.group.WORLD, device=dev)
                     for _ in range(2)]  # fmt: skip
            plan = plans[0]
            mats = [Materializer(p, plan, backend=backend, history_group=history_group) for p in pools]
            ok = all(_capture(m, rank) for m in mats) if graphs else True
            for seed in (7, 8):
                refs = [_reference(own, num_layers, seed + 10 * k, lays) for k in range(2)]
                for p, ref in zip(pools, refs):
                    _fill(p, ref, own, rank)
                ok &= _views_ok(mats, [plan, plan], refs, num_layers, True, busy)
            results.append(("interleaved", f"{backend} -> {mats[0].backend}", True, graphs, _agreed(ok, dev)))
            del mats, pools
    if rank == 0:
        print("| case | backend (asked -> used) | prefetch | graphs | views equal the owners' bytes |")
        print("|---|---|---|---|---|")
        for case, backend, prefetch, graphs, ok in results:
            print(f"| {case} | {backend} | {prefetch} | {graphs} | {'yes' if ok else 'NO'} |")
    return all(r[-1] for r in results)


# ------------------------------------------------------------------------------------------- sweep
def _gemms(dev: torch.device, m: int, k: int, n: int):
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    w = torch.randn(k, n, device=dev, dtype=a.dtype)
    c = torch.empty(m, n, device=dev, dtype=a.dtype)
    return lambda: torch.mm(a, w, out=c)


def sweep(rank: int, world: int, dev: torch.device, args) -> list[dict]:
    group = dist.group.WORLD
    lays = layouts()
    per_page = sum(lay.page_bytes for lay in lays.values())
    max_layers = max(args.layers)
    mm = _gemms(dev, *args.gemm)
    history_group = dist.new_group(list(range(world)))  # prefetches on their own communicator (graphs need it)
    rows = []
    for tokens in args.tokens:
        pages = -(-tokens // PS)
        own = PageOwnership(world, pages + world, "interleave")
        pool = ShardedKVPool(lays, own, num_layers=max_layers, group=group, device=dev)
        for n in lays:
            pool.buffer(n).random_(0, 256)
        gen = torch.Generator().manual_seed(tokens)
        orders = {"in_order": torch.arange(pages), "shuffled": torch.randperm(pages, generator=gen)}
        rows_per_rank = -(-pages // world)
        raw_src = torch.empty(rows_per_rank * per_page, dtype=torch.uint8, device=dev)
        raw_out = torch.empty(world * raw_src.numel(), dtype=torch.uint8, device=dev)
        raw_ms = {}
        for num_layers in args.layers:

            def raw(num_layers=num_layers, raw_out=raw_out, raw_src=raw_src):
                for _ in range(num_layers):
                    dist.all_gather_into_tensor(raw_out, raw_src, group=group)

            raw()
            raw_ms[num_layers] = db.median_ms(raw, dev, args.reps)
        for order in args.orders:
            plan = plan_materialize(orders[order], [], own, rank, device=dev, group=group)
            for backend in args.backends:
                for graphs in (False, True) if (dev.type == "cuda" and args.graphs) else (False,):
                    mat = Materializer(pool, plan, backend=backend, history_group=history_group)
                    if graphs and not _capture(mat, rank):
                        continue
                    for num_layers in args.layers:
                        for prefetch in (False, True):
                            rows.append(_measure(mat, tokens, num_layers, prefetch, graphs, order, raw_ms, dev, args))
                            rows[-1]["view_MB_per_layer"] = round(plan.num_view_pages * per_page / 1e6, 1)
                            rows[-1]["requested_backend"] = backend
                    ov = _overlap(mat, max_layers, mm, dev, args.overlap_reps)
                    for r in rows:
                        if (r["tokens"], r["order"], r["backend"], r["graphs"]) == (tokens, order, mat.backend, graphs):
                            if r["requested_backend"] != backend:
                                continue
                            if r["layers"] == max_layers and r["prefetch"]:
                                r.update(ov)
                    if rank == 0:
                        last = [r for r in rows if r["tokens"] == tokens and r["order"] == order][-1]
                        print(f"T={tokens} {order} {mat.backend} graphs={graphs}: view {last['view_ms']} ms "
                              f"raw {last['raw_allgather_ms']} ms eff {last['efficiency_vs_raw']} "
                              f"host {last['host_us_per_layer']} us/layer overlap "
                              f"{last.get('overlap_overhead_vs_compute')}", flush=True)  # fmt: skip
                    del mat
                    gc.collect()
        del pool
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure(mat, tokens, num_layers, prefetch, graphs, order, raw_ms, dev, args) -> dict:
    def run():
        if prefetch:
            mat.prefetch(0)
        for layer in range(num_layers):
            if prefetch and layer + 1 < num_layers:
                mat.prefetch(layer + 1)
            mat.view(layer)

    run()
    view_ms = db.median_ms(run, dev, args.reps)
    host = []
    for _ in range(3):
        db.barrier(dev)
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e6 / num_layers)
    db.sync(dev)
    return {
        "tokens": tokens,
        "layers": num_layers,
        "backend": mat.backend,
        "order": order,
        "prefetch": prefetch,
        "graphs": graphs,
        "view_ms": round(view_ms, 4),
        "raw_allgather_ms": round(raw_ms[num_layers], 4),
        "efficiency_vs_raw": round(raw_ms[num_layers] / view_ms, 3),
        "host_us_per_layer": round(statistics.median(host), 1),
        "overlap_overhead_vs_compute": None,
        "overlap_ci95": None,
        "overlap_overhead_first_exposed": None,
        "gemm_ms": None,
    }


def _overlap(mat, num_layers, mm, dev, reps) -> dict:
    def gemm_only():
        for _ in range(num_layers):
            mm(), mm(), mm()

    def overlapped():  # the view is needed after the layer's first GEMM (its projections)
        mat.prefetch(0)
        for layer in range(num_layers):
            mm()
            mat.view(layer)
            if layer + 1 < num_layers:
                mat.prefetch(layer + 1)
            mm(), mm()

    def first_exposed():  # the probes' order: the view before all of the layer's GEMMs
        mat.prefetch(0)
        for layer in range(num_layers):
            if layer + 1 < num_layers:
                mat.prefetch(layer + 1)
            mat.view(layer)
            mm(), mm(), mm()

    for fn in (gemm_only, overlapped, first_exposed):
        fn()
    g, a, b = [], [], []
    for _ in range(reps):
        g.append(db.time_once(gemm_only, dev))
        a.append(db.time_once(overlapped, dev))
        b.append(db.time_once(first_exposed, dev))
    ov, first = db.paired_overhead(a, g), db.paired_overhead(b, g)
    return {
        "gemm_ms": round(statistics.median(g), 3),
        "overlap_overhead_vs_compute": round(ov["overhead"], 5),
        "overlap_ci95": [round(x, 5) for x in ov["ci95"]],
        "overlap_overhead_first_exposed": round(first["overhead"], 5),
    }


# ------------------------------------------------------------------------------------------- summary
OVERLAP_TARGET = 0.01
"""Overlapped with GEMM-bound layers, ~100 MB views per layer: at most +1.0% over the GEMMs alone."""


def _best_overlap(rows: list[dict]) -> dict | None:
    ov = [r for r in rows if r.get("overlap_overhead_vs_compute") is not None]
    return min(ov, key=lambda r: r["overlap_overhead_vs_compute"]) if ov else None


def target_lines(rows: list[dict]) -> list[str]:
    """The issue's targets, one line each (also printed at the end of the sweep)."""

    def pct(x):
        return f"{100 * x:+.2f}%"

    lines = []
    for tokens in sorted({r["tokens"] for r in rows}):
        sub = [r for r in rows if r["tokens"] == tokens]
        mb = sub[0]["view_MB_per_layer"]
        for graphs in (False, True):
            part = [r for r in sub if r["graphs"] == graphs and r["layers"] == max(x["layers"] for x in sub)]
            if not part:
                continue
            best = max(part, key=lambda r: r["efficiency_vs_raw"])
            host = min(r["host_us_per_layer"] for r in part)
            ok = best["efficiency_vs_raw"] >= 0.9 and host <= 100
            lines.append(
                f"- TARGET view speed, {tokens // 1024}K tokens ({mb} MB/layer), {'graphs' if graphs else 'eager'}: "
                f"efficiency {best['efficiency_vs_raw']} ({best['backend']}, {best['order']}, prefetch="
                f"{best['prefetch']}; target >= 0.9), host {host} us/layer (target <= 100): **{'met' if ok else 'not met'}**"
            )
        ovb = _best_overlap(sub)
        if ovb is not None and 50 <= mb <= 200:
            ci = ovb.get("overlap_ci95")
            ci_s = f" [95% CI {pct(ci[0])}, {pct(ci[1])}]" if ci else ""
            verdict = db.verdict(tuple(ci), OVERLAP_TARGET) if ci else (
                "met" if ovb["overlap_overhead_vs_compute"] <= OVERLAP_TARGET else "not met")  # fmt: skip
            lines.append(
                f"- TARGET overlap, {tokens // 1024}K tokens ({mb} MB/layer): {pct(ovb['overlap_overhead_vs_compute'])}"
                f"{ci_s} ({ovb['backend']}, {ovb['order']}, graphs={ovb['graphs']}; target <= +1.0%): **{verdict}**"
            )
    return lines


def summary(rows: list[dict], title: str) -> str:
    """Markdown: every row, then the issue's targets evaluated on the best configuration per size."""
    out = [f"# {title}", "", "| tokens | view MB/layer | backend | order | graphs | layers | prefetch | view ms | "
           "raw all-gather ms | efficiency | host us/layer | overlap overhead | first exposed |",
           "|---:|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def pct(x):
        return "" if x is None else f"{100 * x:+.2f}%"

    for r in rows:
        out.append(
            f"| {r['tokens']} | {r['view_MB_per_layer']} | {r['backend']} | {r['order']} | {r['graphs']} | "
            f"{r['layers']} | {r['prefetch']} | {r['view_ms']} | {r['raw_allgather_ms']} | {r['efficiency_vs_raw']} | "
            f"{r['host_us_per_layer']} | {pct(r['overlap_overhead_vs_compute'])} | "
            f"{pct(r['overlap_overhead_first_exposed'])} |"
        )
    out += ["", "## Targets", "", "| tokens | view MB/layer | best efficiency (config) | host us/layer (eager, best) | "
            "host us/layer (graphs, best) | overlap overhead (best, 95% CI) |", "|---:|---:|---|---:|---:|---|"]  # fmt: skip
    for tokens in sorted({r["tokens"] for r in rows}):
        sub = [r for r in rows if r["tokens"] == tokens]
        best = max(sub, key=lambda r: r["efficiency_vs_raw"])
        eager = [r["host_us_per_layer"] for r in sub if not r["graphs"]]
        graphs = [r["host_us_per_layer"] for r in sub if r["graphs"]]
        ovb = _best_overlap(sub)
        ov_s = ""
        if ovb:
            ci = ovb.get("overlap_ci95")
            ci_s = f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else ""
            ov_s = f"{pct(ovb['overlap_overhead_vs_compute'])}{ci_s} ({ovb['backend']}, {ovb['order']}, graphs={ovb['graphs']})"
        out.append(
            f"| {tokens} | {sub[0]['view_MB_per_layer']} | {best['efficiency_vs_raw']} ({best['backend']}, "
            f"{best['order']}, graphs={best['graphs']}, L={best['layers']}, prefetch={best['prefetch']}) | "
            f"{min(eager) if eager else ''} | {min(graphs) if graphs else ''} | {ov_s} |"
        )
    out += ["", *target_lines(rows)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="bitwise checks of every backend and path, then exit")
    ap.add_argument("--summary", help="print the markdown summary of a results file and exit (no process group)")
    ap.add_argument("--tokens", type=int, nargs="*", help="history tokens (default GPU: 32K 128K 256K 1M; CPU: 2K)")
    ap.add_argument("--layers", type=int, nargs="*", help="layer counts (default GPU: 1 8; CPU: 1 2)")
    ap.add_argument("--backends", nargs="*", help="default GPU: all_gather copy_engine; CPU: all_gather")
    ap.add_argument("--orders", nargs="*", default=["in_order", "shuffled"])
    ap.add_argument("--reps", type=int, help="timed repetitions (default GPU 10, CPU 3)")
    ap.add_argument("--overlap-reps", type=int, help="interleaved overlap repetitions (default GPU 10, CPU 2)")
    ap.add_argument("--gemm", type=int, nargs=3, help="M K N of the GEMMs (default GPU 4096 7168 14336)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph variants")
    ap.add_argument("--out-dir", help="where results go (default $OUT, else benchmarks/results)")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(db.read_jsonl(Path(args.summary)), Path(args.summary).stem))
        return 0
    rank, world, dev = db.init()
    gpu = dev.type == "cuda"
    if args.check:
        with phase("bitwise checks of every backend and path"):
            ok = check(rank, world, dev, args.backends or ["all_gather", "copy_engine"])
        db.finish()
        return 0 if ok else 1
    args.backends = args.backends or (["all_gather", "copy_engine"] if gpu else ["all_gather"])
    args.tokens = args.tokens or ([32768, 131072, 262144, 1048576] if gpu else [2048])  # 128K: ~103 MB per layer
    args.layers = args.layers or ([1, 8] if gpu else [1, 2])
    args.reps = args.reps or (10 if gpu else 3)
    args.overlap_reps = args.overlap_reps or (10 if gpu else 2)
    args.gemm = args.gemm or ([4096, 7168, 14336] if gpu else [128, 128, 128])
    t0 = time.perf_counter()
    with phase(f"sweep: tokens {args.tokens}, layers {args.layers}, backends {args.backends}"):
        rows = sweep(rank, world, dev, args)
    if rank == 0:
        meta = {"world": world, "pg_backend": dist.get_backend(), **db.versions()}
        rows = [{**r, **meta} for r in rows]
        name = f"materialize_{db.hardware_tag(dev, world)}_{db.today()}"
        out = db.out_dir(args.out_dir)
        db.write_jsonl(out / f"{name}.jsonl", rows)
        text = summary(rows, name) + f"\nCommand: `{' '.join(sys.argv)}`; {time.perf_counter() - t0:.0f} s.\n"
        (out / f"{name}.md").write_text(text)
        print(text)
        print(f"wrote {out / name}.jsonl and .md")
    db.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
