"""The fp8 DSA indexer kernel alone (``dtkv::indexer_scores``) over its launch configurations, at decode shapes.

GPU, one H200 (~2-3 minutes; the compiles take most of it)::

    python benchmarks/bench_indexer_scores.py --out-dir $OUT/sweep

(also what ``benchmarks/bench_decode.py --indexer-sweep`` runs after its scenarios). Then, on any machine, the
winners into the op's table (``LAUNCH_TABLE`` in ``ops/indexer_scores.py``)::

    python benchmarks/bench_indexer_scores.py --apply-table $OUT/sweep/indexer_sweep_h200x1_<date>.jsonl

CPU smoke (interpreter, tiny shapes; what ``tests/test_bench_indexer_scores.py`` runs)::

    TRITON_INTERPRET=1 python benchmarks/bench_indexer_scores.py --smoke --out-dir /tmp/x

The promise a tuned table keeps -- every launch gives the default launch's keys, so a table entry never changes
which keys are selected -- checked on its own (GPU, one H200, ~2 minutes; ``--smoke`` for the interpreter)::

    python benchmarks/bench_indexer_scores.py --check-launches

runs every candidate and every ``LAUNCH_TABLE`` entry on awkward shapes (1, 3, 5 and 16 queries; ragged contexts
with padding pages, partial last pages and masked keys; page sizes 64 and 16; bf16 and fp8 queries) and compares
each launch's int64 keys bitwise with the default launch's and its top-2048 positions with the default's. It
prints one line per launch and exits 1 when a table entry differs anywhere (candidates that differ are listed: the
sweep never admits them).

Scenario per shape ``N x T`` (``--shapes``; default 16 x 131072, 1 x 131072, 4 x 131072, 1 x 1048576): ``N``
queries, each reading ``T / 64`` pages of its own (random pages of one pool of ``--pool-pages`` 8448-byte
DeepSeek-V3.2 indexer pages, 277 MB by default), every key causal, ``q_fp8=True``. Where one call reads less than
the pool, disjoint page sets rotate from call to call so that no call finds its pages in L2. Each candidate launch
(:data:`CANDIDATES`, a :class:`dtkv.ops.indexer_scores.IndexerLaunch` each) is first checked: its keys against the
default launch's (``bitwise``) and against the torch reference (positions and masks exact, scores within
``2e-3`` of the row's largest, the top-2048 sets: ``topk_agree``); then timed as CUDA-graph replays of a run of
calls (events around the replays; no host launch cost). Bytes are :func:`dtkv.ops.indexer_scores.indexer_scores_bytes`
(codes, scales, output keys, queries): GB/s against the H200's 4.8 TB/s and against a measured 1 GiB device copy.

Writes ``indexer_sweep_<hw>_<date>.jsonl`` / ``.md`` into ``--out-dir`` (and ``$OUT`` when set), prints a table per
shape, the suggested ``LAUNCH_TABLE`` and the summary last.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(ROOT))

from dtkv import IndexerFp8Layout  # noqa: E402
from dtkv.ops import indexer_scores  # noqa: E402
from dtkv.ops.indexer_scores import (  # noqa: E402
    DEFAULT_LAUNCH,
    IndexerLaunch,
    indexer_scores_bytes,
    launch_bucket,
    use_launch,
)

H200_HBM_GBPS = 4800.0
"""H200 HBM3e bandwidth (spec sheet)."""
SHAPES: tuple[tuple[int, int], ...] = ((16, 131072), (1, 131072), (4, 131072), (1, 1048576))
TOPK = 2048
SCORE_TOL = 2e-3
"""Largest score difference allowed against the reference, as a fraction of the row's largest ``|score|``: e4m3
queries on the tensor cores (Hopper's fp8 accumulation keeps ~2**-13 per dot) vs the float32 reference."""
TABLE_SOURCE = ROOT / "ops" / "indexer_scores.py"


def launch_name(cfg: IndexerLaunch) -> str:
    """``pages-tma-s8-p1-c4`` style: kernel, loads, stages, pages per iteration (``merged2``: two in one tile),
    programs per SM, then ``-wN`` / ``-rN`` where warps / the register cap differ from 4 / none."""
    if cfg.kernel == "cols":
        head = f"cols-b{cfg.block_s}-s{cfg.num_stages}"
    else:
        loads = "merged" if cfg.merge else ("tma" if cfg.tma else "cpasync")
        head = f"pages-{loads}-s{cfg.num_stages}-p{cfg.pages_per_iter}"
    tail = (f"-w{cfg.num_warps}" if cfg.num_warps != 4 else "") + (f"-r{cfg.maxnreg}" if cfg.maxnreg else "")
    return f"{head}-c{cfg.ctas_per_sm}{tail}"


def _candidates() -> list[tuple[str, IndexerLaunch]]:
    """The launches the sweep times (:func:`launch_name`): the default first, TMA launches last (a launch that
    faults the device ends the sweep's use of it, so the pointer-load launches are measured first)."""
    cfgs = [DEFAULT_LAUNCH]
    cfgs += [IndexerLaunch(num_stages=st, pages_per_iter=ppi) for st in (6, 8, 12) for ppi in (1, 2)]
    cfgs += [dataclasses.replace(DEFAULT_LAUNCH, ctas_per_sm=c) for c in (1, 2, 3, 8)]
    cfgs += [IndexerLaunch(num_stages=st, ctas_per_sm=5, maxnreg=96) for st in (8, 12)]  # 5 programs per SM
    cfgs += [IndexerLaunch(merge=True, pages_per_iter=2, num_warps=w, num_stages=st, ctas_per_sm=c)
             for w, st, c in ((4, 8, 3), (4, 6, 3), (8, 8, 2), (8, 6, 4))]  # fmt: skip
    cfgs += [IndexerLaunch(kernel="cols", num_stages=4, ctas_per_sm=8), IndexerLaunch(kernel="cols", ctas_per_sm=4)]
    cfgs += [IndexerLaunch(tma=True, num_stages=st, pages_per_iter=ppi, ctas_per_sm=c)
             for st in (6, 8, 12) for ppi in (1, 2) for c in (2, 4)]  # fmt: skip
    cfgs += [IndexerLaunch(tma=True, ctas_per_sm=5, maxnreg=96)]
    out = [("default", DEFAULT_LAUNCH)]
    for c in dict.fromkeys(cfgs[1:]):
        if c != DEFAULT_LAUNCH:
            out.append((launch_name(c) + (" (first kernel)" if c.kernel == "cols" and c.num_stages == 4 else ""), c))
    return out


CANDIDATES: list[tuple[str, IndexerLaunch]] = _candidates()
SMOKE_CANDIDATES = [
    c for c in CANDIDATES if c[0] in ("default", "pages-tma-s8-p2-c4", "pages-merged-s8-p2-c2-w8", "cols-b64-s8-c4")
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_pool(num_pages: int, lay: IndexerFp8Layout, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Random e4m3 codes (no NaN) and positive scales: uint8 ``[num_pages, S * (J + 4)]``."""
    g = torch.Generator(device=device).manual_seed(seed)
    pool = torch.randint(0, 120, (num_pages, lay.page_shape[0]), dtype=torch.uint8, device=device, generator=g)
    pool[:, lay.scale_offset :].view(torch.float32).uniform_(1e-3, 2e-3, generator=g)
    return pool


def page_sets(n: int, ctx: int, pool_pages: int, lay: IndexerFp8Layout, device: torch.device, seed: int = 1):
    """Disjoint ``(ids, slots, qpos)`` sets of ``n`` queries x ``ctx`` tokens (as many as the pool holds)."""
    per_call = n * ctx // lay.page_size
    if per_call > pool_pages:
        raise ValueError(f"shape {n}x{ctx} reads {per_call} pages, the pool has {pool_pages} (--pool-pages)")
    g = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(pool_pages, device=device, generator=g).to(torch.int32)
    slots = torch.arange(ctx // lay.page_size, device=device, dtype=torch.int32).expand(n, -1).contiguous()
    qpos = torch.full((n,), ctx - 1, dtype=torch.int32, device=device)
    return [(perm[i * per_call : (i + 1) * per_call].view(n, -1), slots, qpos) for i in range(pool_pages // per_call)]


def _check(keys, ref, ref_top, default_keys, is_default: bool) -> dict:
    from dtkv.decode import unpack_keys

    sr, pr, vr = unpack_keys(ref)
    sg, pg, vg = unpack_keys(keys)
    exact = bool(torch.equal(vr, vg) and torch.equal(pr, pg))
    row_max = torch.where(vr, sr.abs(), torch.zeros_like(sr)).amax(1, keepdim=True).clamp(min=1e-30)
    err = float((torch.where(vr, (sr - sg).abs(), torch.zeros_like(sr)) / row_max).max())
    k = min(TOPK, keys.shape[1])
    top = torch.sort(unpack_keys(torch.topk(keys, k, dim=1).values)[1], dim=1).values
    agree = float((top == ref_top).all(dim=1).float().mean())
    bitwise = bool(torch.equal(keys, default_keys)) if default_keys is not None else is_default
    return {"positions_exact": exact, "max_rel_err": err, "topk_agree": agree, "bitwise": bitwise,
            "ok": exact and err <= SCORE_TOL}  # fmt: skip


def _time_calls(calls, device: torch.device, reps: int) -> float:
    """Milliseconds per call: CUDA-graph replays of the run of calls (CPU: wall clock of the calls)."""
    for c in calls:
        c()
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e3 / len(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    _sync(device)
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(out)


def kernel_us(calls, device: torch.device) -> float | None:
    """Median device time of the indexer kernels of ``calls`` (eager, under the profiler): the kernel alone, without
    the bubble between a graph's kernels that :func:`_time_calls` includes."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in calls:
            c()
        _sync(device)
    us = [e.time_range.elapsed_us() for e in prof.events()
          if e.device_type == DeviceType.CUDA and "indexer_" in e.name]  # fmt: skip
    return statistics.median(us) if us else None


def copy_gbps(device: torch.device) -> float | None:
    """GB/s of a 1 GiB device copy (read + write): what a streaming kernel reaches here."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_calls([lambda: dst.copy_(src)] * 4, device, 5)
    return 2 * src.numel() / (ms * 1e6)


def sweep(device: torch.device, *, shapes=SHAPES, candidates=None, pool_pages: int = 32768, reps: int = 5,
          heads: int = 64, lay: IndexerFp8Layout | None = None, bf16_rows: bool = True, log=print) -> list[dict]:  # fmt: skip
    """Every candidate at every shape (candidate by candidate): the checks, then the timing; then the kernel alone
    for the default and each shape's fastest checked launch. One row per (shape, candidate, q_fp8)."""
    from dtkv.decode import unpack_keys

    lay = lay or IndexerFp8Layout()
    candidates = candidates or CANDIDATES
    pool = make_pool(pool_pages, lay, device)
    cgbps = copy_gbps(device)
    g = torch.Generator(device=device).manual_seed(2)
    shape_data = []
    for n, ctx in shapes:
        sets = page_sets(n, ctx, pool_pages, lay, device)
        nbytes = indexer_scores_bytes(num_valid_keys=n * ctx, num_cols=n * ctx, num_queries=n, heads=heads,
                                      head_dim=lay.head_dim)  # fmt: skip
        shape_data.append({
            "sets": sets, "nbytes": nbytes, "refs": {}, "defaults": {}, "timed": {},
            "q": torch.randn(n, heads, lay.head_dim, device=device, dtype=torch.bfloat16, generator=g),
            "w": torch.rand(n, heads, device=device, generator=g),
            "base": {"queries": n, "context": ctx, "shape": f"{n}x{ctx}", "bytes": nbytes,
                     "bucket": list(launch_bucket(n, ctx)), "calls_per_replay": max(4, len(sets))},
        })  # fmt: skip
    runs = [(c, True) for c in candidates] + ([(candidates[0], False)] if bf16_rows else [])
    rows = []
    for (name, cfg), q_fp8 in runs:
        for sd in shape_data:
            row = {**sd["base"], "name": name, "config": dataclasses.asdict(cfg), "q_fp8": q_fp8}

            def call(s, q_fp8=q_fp8, q=sd["q"], w=sd["w"]):
                ids, slots, qpos = s
                return indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="triton")

            try:
                if q_fp8 not in sd["refs"]:
                    ids, slots, qpos = sd["sets"][0]
                    ref = indexer_scores(sd["q"], sd["w"], pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8,
                                         backend="torch")  # fmt: skip
                    top = torch.sort(unpack_keys(torch.topk(ref, min(TOPK, ref.shape[1]), dim=1).values)[1], dim=1)
                    sd["refs"][q_fp8] = (ref, top.values)
                with use_launch(cfg):
                    keys = call(sd["sets"][0])
                    row.update(_check(keys, *sd["refs"][q_fp8], sd["defaults"].get(q_fp8), name == "default"))
                    if name == "default":
                        sd["defaults"][q_fp8] = keys
                    calls = [lambda s=s: call(s) for s in (sd["sets"] * 4)[: row["calls_per_replay"]]]
                    ms = _time_calls(calls, device, reps)
                if q_fp8:
                    sd["timed"][name] = (cfg, calls)
            except Exception as e:  # a launch that does not compile or run: report it, keep sweeping
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                log(f"{row['shape']:>12} {name:<34} error {row['error'][:120]}")
                continue
            gbps = sd["nbytes"] / (ms * 1e6)
            row.update(ms=ms, gbps=gbps, hbm_fraction=gbps / H200_HBM_GBPS, copy_gbps=cgbps,
                       copy_fraction=(gbps / cgbps) if cgbps else None)  # fmt: skip
            rows.append(row)
            log(f"{row['shape']:>12} {name:<34} fp8={int(q_fp8)} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s "
                f"{gbps / H200_HBM_GBPS:4.0%} bitwise={int(row['bitwise'])} ok={int(row['ok'])} "
                f"err={row['max_rel_err']:.1e} topk={row['topk_agree']:.2f}")  # fmt: skip
    for sd in shape_data:  # the kernel alone (profiler device time): the default and the fastest checked launch
        here = [r for r in rows if r["shape"] == sd["base"]["shape"] and "gbps" in r and r["q_fp8"] and r["ok"]
                and r["bitwise"]]  # fmt: skip
        picks = [r for r in here if r["name"] == "default"] + ([max(here, key=lambda x: x["gbps"])] if here else [])
        for r in {id(r): r for r in picks}.values():
            cfg, calls = sd["timed"][r["name"]]
            try:
                with use_launch(cfg):
                    us = kernel_us(calls, device)
            except Exception as e:  # the profiler is a nicety: never lose the sweep to it
                log(f"{r['shape']:>12} {r['name']:<34} kernel alone: profiler failed ({type(e).__name__}: {e})")
                us = None
            if us:
                kg = sd["nbytes"] / (us * 1e3)
                r.update(kernel_us=us, kernel_gbps=kg, kernel_hbm_fraction=kg / H200_HBM_GBPS)
                log(f"{r['shape']:>12} {r['name']:<34} kernel alone {us:8.1f} us {kg:7.0f} GB/s "
                    f"{kg / H200_HBM_GBPS:4.0%}")  # fmt: skip
    order = {sd["base"]["shape"]: i for i, sd in enumerate(shape_data)}
    return sorted(rows, key=lambda r: order[r["shape"]])


CHECK_SHAPES: tuple[tuple[int, int], ...] = ((1, 4096), (3, 20000), (5, 70000), (16, 8192))
"""``(queries, longest context)`` of :func:`check_launches`; the other queries read shorter, ragged contexts."""


def _check_inputs(n: int, ctx: int, heads: int, lay: IndexerFp8Layout, device: torch.device, seed: int):
    """Random fp8 pages and a ragged batch: query ``i`` reads ``ctx - i * 37`` tokens' pages in a random order,
    with about 5% padding columns (-1 or past the pool), its position mid-page, a few columns wholly past it."""
    ps = lay.page_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = -(-ctx // ps) + 2
    num_pages = n * width + 3
    pool = make_pool(num_pages, lay, device, seed=seed)
    ids = torch.randperm(num_pages, generator=g)[: n * width].view(n, width)
    slots = torch.stack([torch.randperm(width, generator=g) for _ in range(n)])
    pad = torch.rand(n, width, generator=g) < 0.05
    ids = torch.where(pad, torch.where(torch.rand(n, width, generator=g) < 0.5, -1, num_pages + 1), ids)
    qpos = torch.tensor([max(0, ctx - 1 - 37 * i) for i in range(n)])
    q = torch.randn(n, heads, lay.head_dim, generator=g).to(torch.bfloat16)
    w = torch.rand(n, heads, generator=g) - 0.2
    return [t.to(device) for t in (q, w, pool, ids.to(torch.int32), slots.to(torch.int32), qpos.to(torch.int32))]


def check_launches(device: torch.device, *, shapes=CHECK_SHAPES, layouts=None, heads: int = 64, candidates=None,
                   log=print) -> list[dict]:  # fmt: skip
    """Every launch (the candidates and the table's entries) against the default launch, bitwise, on every shape,
    layout and query precision: one row per launch with ``bitwise`` (every call's keys equal), ``topk_equal``
    (every call's top-2048 positions equal), ``in_table`` and the first differing case."""
    from dtkv.decode import unpack_keys
    from dtkv.ops.indexer_scores import LAUNCH_TABLE

    layouts = layouts or (IndexerFp8Layout(), IndexerFp8Layout(page_size=16))
    named = list(candidates or CANDIDATES)
    table = {cfg for cfg in LAUNCH_TABLE.values()}
    for cfg in table:
        if all(cfg != c for _, c in named):
            named.append((launch_name(cfg) + " (table)", cfg))
    cases = []
    for li, lay in enumerate(layouts):
        for si, (n, ctx) in enumerate(shapes):
            args = _check_inputs(n, ctx, heads, lay, device, seed=100 * li + si)
            for q_fp8 in (True, False):
                with use_launch(DEFAULT_LAUNCH):
                    keys = indexer_scores(*args, layout=lay, q_fp8=q_fp8, backend="triton")
                top = unpack_keys(torch.topk(keys, min(TOPK, keys.shape[1]), dim=1).values)[1]
                cases.append((f"S={lay.page_size} {n}x{ctx} fp8={int(q_fp8)}", lay, args, q_fp8, keys, top))
    rows = []
    for name, cfg in named:
        row = {"name": name, "config": dataclasses.asdict(cfg), "in_table": cfg in table, "bitwise": True,
               "topk_equal": True, "first_difference": None, "cases": len(cases)}  # fmt: skip
        try:
            for label, lay, args, q_fp8, base, base_top in cases:
                with use_launch(cfg):
                    keys = indexer_scores(*args, layout=lay, q_fp8=q_fp8, backend="triton")
                same = bool(torch.equal(keys, base))
                top = unpack_keys(torch.topk(keys, base_top.shape[1], dim=1).values)[1]
                same_top = bool(torch.equal(top, base_top))
                if not same and row["first_difference"] is None:
                    row["first_difference"] = f"{label}: {int((keys != base).sum())} of {keys.numel()} keys differ"
                row["bitwise"] &= same
                row["topk_equal"] &= same_top
        except Exception as e:  # a launch that does not compile or run: report it, check the others
            row.update(bitwise=False, topk_equal=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        verdict = "same keys" if row["bitwise"] else (row.get("error") or row["first_difference"])
        log(f"{name:<40} {'table' if row['in_table'] else '     '} {verdict}")
    return rows


def best_table(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """Per bucket, the fastest fp8 launch that passed its checks with the default's bits: ``{bucket: row}``."""
    best: dict[tuple[int, int], dict] = {}
    for r in rows:
        if "gbps" not in r or not r.get("q_fp8") or not r.get("ok") or not r.get("bitwise"):
            continue
        b = tuple(r["bucket"])
        if b not in best or r["gbps"] > best[b]["gbps"]:
            best[b] = r
    return best


def table_source(best: dict[tuple[int, int], dict]) -> str:
    """The ``LAUNCH_TABLE`` block for ``ops/indexer_scores.py`` (between its BEGIN/END markers): each cell's launch
    with the fields that differ from ``IndexerLaunch()``, its measurement as a comment above it."""
    default = dataclasses.asdict(IndexerLaunch())
    lines = ["LAUNCH_TABLE: dict[tuple[int, int], IndexerLaunch] = {"]
    for b in sorted(best):
        r = best[b]
        args = ", ".join(f"{k}={v!r}" for k, v in r["config"].items() if default.get(k) != v)
        lines.append(f"    # {r['shape']}: {r['name']}, {r['gbps']:.0f} GB/s = {r['hbm_fraction']:.0%} of 4.8 TB/s "
                     f"({r.get('date', '?')})")  # fmt: skip
        lines.append(f"    {b}: IndexerLaunch({args}),")
    return "\n".join(lines + ["}"]) if best else "LAUNCH_TABLE: dict[tuple[int, int], IndexerLaunch] = {}"


_BLOCK = re.compile(r"(# BEGIN LAUNCH_TABLE[^\n]*\n)(.*?)(\n# END LAUNCH_TABLE)", re.S)


def apply_table(results: Path, source: Path = TABLE_SOURCE) -> str:
    """Rewrite the ``LAUNCH_TABLE`` block of ``source`` from a sweep's results; returns the new block."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    block = table_source(best_table(rows))
    text = source.read_text()
    if not _BLOCK.search(text):
        raise ValueError(f"{source} has no '# BEGIN LAUNCH_TABLE' ... '# END LAUNCH_TABLE' block")
    source.write_text(_BLOCK.sub(lambda m: m.group(1) + block + m.group(3), text, count=1))
    return block


def markdown(rows: list[dict], command: str = "") -> str:
    """One table per shape, fastest first."""
    out = []
    if command:
        out += [f"- **Command**: `{command}`", ""]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = sorted((r for r in rows if r["shape"] == shape), key=lambda r: -r.get("gbps", 0.0))
        out += [f"**{shape}** (queries x tokens, bucket {rs[0]['bucket']}):", "",
                "| launch | q_fp8 | us | GB/s | of 4.8 TB/s | of 1 GiB copy | kernel alone (profiler) | bitwise vs "
                "default | max rel err | top-k agree |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rs:
            if "error" in r:
                out.append(f"| {r['name']} | {r['q_fp8']} | error: {r['error'][:80]} | | | | | | | |")
                continue
            cf = r.get("copy_fraction")
            ka = (f"{r['kernel_us']:.1f} us, {r['kernel_gbps']:.0f} GB/s = {r['kernel_hbm_fraction']:.0%}"
                  if r.get("kernel_us") else "-")  # fmt: skip
            out.append(f"| {r['name']} | {r['q_fp8']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | "
                       f"{r['hbm_fraction']:.0%} | {'-' if cf is None else format(cf, '.0%')} | {ka} | {r['bitwise']} | "
                       f"{r['max_rel_err']:.1e} | {r['topk_agree']:.2f} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    lines = ["summary (best checked fp8 launch per shape; default in brackets):"]
    for r in rows:
        if r.get("name") == "default" and ("error" in r or not r.get("ok")):
            lines.append(f"  THE DEFAULT LAUNCH FAILED at {r['shape']} (q_fp8={r['q_fp8']}): "
                         f"{r.get('error') or 'checks failed'}; no row is 'bitwise' there")  # fmt: skip
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ok = [r for r in rows if r["shape"] == shape and "gbps" in r and r["q_fp8"] and r["ok"] and r["bitwise"]]
        dft = [r for r in rows if r["shape"] == shape and r["name"] == "default" and r["q_fp8"] and "gbps" in r]
        if not ok:
            lines.append(f"  {shape:>12}: no launch passed its checks")
            continue
        b = max(ok, key=lambda r: r["gbps"])
        d = f" [default {dft[0]['gbps']:.0f} GB/s]" if dft else ""
        k = f", kernel alone {b['kernel_gbps']:.0f} GB/s = {b['kernel_hbm_fraction']:.0%}" if b.get("kernel_us") else ""
        lines.append(f"  {shape:>12}: {b['name']} {b['gbps']:.0f} GB/s = {b['hbm_fraction']:.0%} of 4.8 TB/s{k}{d}")
    bad = [r for r in rows if "gbps" in r and isinstance(r.get("config"), dict) and not (r["ok"] and r["bitwise"])]
    errs = [r for r in rows if "error" in r]
    lines.append(f"  {len(bad)} rows failed a check (not eligible), {len(errs)} errors")
    return "\n".join(lines)


def write(rows: list[dict], out_dir: Path, tag: str, command: str) -> list[Path]:
    date = time.strftime("%Y-%m-%d")
    for r in rows:
        r.setdefault("date", date)
    paths = []
    dirs = [out_dir] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for d in dict.fromkeys(dirs):
        d.mkdir(parents=True, exist_ok=True)
        stem = d / f"indexer_sweep_{tag}_{date}"
        stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        stem.with_suffix(".md").write_text(f"# Indexer kernel sweep -- {date}\n\n" + markdown(rows, command))
        paths += [stem.with_suffix(".jsonl"), stem.with_suffix(".md")]
    return paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(f"{n}x{t}" for n, t in SHAPES), help="QUERIESxTOKENS, comma separated")
    p.add_argument("--pool-pages", type=int, default=32768, help="pages of the pool (8448 B each)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", metavar="REGEX", help="time only the candidates whose name matches (the default always)")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--apply-table", metavar="JSONL", help="write a sweep's winners into ops/indexer_scores.py")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny geometry, four launches")
    p.add_argument("--check-launches", action="store_true",
                   help="check that every launch gives the default launch's keys bitwise (exit 1 if a table entry "
                        "does not); no timing")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.apply_table:
        print(apply_table(Path(ns.apply_table)))
        print(f"wrote the block above into {TABLE_SOURCE}")
        return 0
    if ns.check_launches:
        return _main_check(ns)
    args = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"python benchmarks/bench_indexer_scores.py {args}".strip()
    if ns.smoke:
        device = torch.device("cpu")
        lay = IndexerFp8Layout(page_size=16, head_dim=32)
        rows = sweep(device, shapes=((2, 64), (1, 160)), candidates=SMOKE_CANDIDATES, pool_pages=24, reps=1,
                     heads=4, lay=lay)  # fmt: skip
        tag = "cpux1"
    else:
        if not torch.cuda.is_available():
            print("error: needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 1
        device = torch.device("cuda", torch.cuda.current_device())
        shapes = [tuple(int(x) for x in s.split("x")) for s in ns.shapes.split(",")]
        cands = [c for c in CANDIDATES if c[0] == "default" or not ns.only or re.search(ns.only, c[0])]
        rows = sweep(device, shapes=shapes, candidates=cands, pool_pages=ns.pool_pages, reps=ns.reps)
        name = torch.cuda.get_device_name(device).lower()
        tag = next((f"{m}x1" for m in ("h200", "h100", "b200") if m in name), "gpux1")
    for path in write(rows, Path(ns.out_dir), tag, command):
        print(f"wrote {path}")
    print(markdown(rows))
    print("suggested table (apply with --apply-table <the jsonl above>):")
    print(table_source(best_table(rows)))
    print(summary(rows))
    return 0


def _main_check(ns) -> int:
    """``--check-launches``: the rows as JSON lines on stdout (after the per-launch lines), the verdict last."""
    if ns.smoke:
        device = torch.device("cpu")
        rows = check_launches(device, shapes=((2, 100), (3, 37)), layouts=(IndexerFp8Layout(page_size=16, head_dim=32),),
                              heads=4, candidates=SMOKE_CANDIDATES)  # fmt: skip
    else:
        if not torch.cuda.is_available():
            print("error: --check-launches needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 1
        rows = check_launches(torch.device("cuda", torch.cuda.current_device()))
    for r in rows:
        print(json.dumps(r))
    bad_table = [r["name"] for r in rows if r["in_table"] and not r["bitwise"]]
    other = [r["name"] for r in rows if not r["in_table"] and not r["bitwise"]]
    print(f"check-launches: {len(rows)} launches, {len(rows) - len(bad_table) - len(other)} give the default's keys; "
          f"table entries that differ: {bad_table or 'none'}; other launches that differ: {other or 'none'}")  # fmt: skip
    return 1 if bad_table else 0


if __name__ == "__main__":
    sys.exit(main())
