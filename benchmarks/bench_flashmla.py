"""What dtkv's attention seam costs: FlashMLA on hand-built indices vs FlashMLA through :mod:`dtkv.attention`.

One command, one GPU (about a minute on an H200; FlashMLA installed with ``pip install --no-deps sgl-flash-mla==1.0.0``)::

    python benchmarks/bench_flashmla.py

DeepSeek-V3.2 shapes: 128 heads, top-k 2048, ``d_qk`` 576, ``d_v`` 512, pages of 64 tokens. Every shape has its KV in
a pool whose pages are shuffled (a page table that is not the identity, as an engine's), and per query 2048 key
positions drawn from its causal range.

- **raw**: FlashMLA called on token slots built by hand before timing (``page * 64 + offset``, int32), with its
  metadata from one ``get_mla_metadata()`` warmed up once.
- **dtkv**: the same kernel through the seam, everything included: ``backend.indices(locs, kv, page_map=...)``
  (logical token locations -> bounded, padded int32 slots: one ``dtkv::sparse_indices`` launch), the planned
  :class:`dtkv.attention.DecodeSchedule` and the kernel. Decode over a view or a replicated pool is not merged, so
  its schedule is planned with ``merge_lse=False``; decode rows also report ``dtkv_merged_ms`` / ``ratio_merged``:
  the schedule of a sharded rank's partial (``merge_lse=True``), which adds the seam's in-place ``lse`` fix
  (FlashMLA's ``+inf`` for an empty query -> ``-inf``, what :func:`dtkv.decode.combine_partials` needs).

``sparse_prefill``: ``flash_mla_sparse_fwd`` over bf16 latent pages, ``tokens`` queries (8K-64K) of one request of
``context`` tokens; eager, paired CUDA-event timings (raw and dtkv back to back, median) of the device's work: a spin
kernel runs before each start event so that the host's launches (Python, the custom op's dispatch) overlap it, as
they overlap the previous layer in a model. Prefill rows also report ``indices_ms`` / ``indices_gbps`` (the
translation launch alone, and the bytes it moves per second), ``host_raw_us`` / ``host_dtkv_us`` (the host's
launch time of each path) and ``eager_ratio`` (the same pair timed with the host's launches inside the timing). ``sparse_decode``:
``flash_mla_with_kvcache`` on the 656-byte fp8 pages, ``batch`` requests of ``context`` tokens (32K-1M; one query each),
timed as CUDA-graph replays of ``--layers`` calls per graph (as a decode step runs), paired, median per call.
``ratio = raw_ms / dtkv_ms``; ``bitwise``: the two paths' ``out`` and ``lse`` equal bit for bit. Targets: ratio >= 0.95
for every prefill row and >= 0.90 for every decode row.

Also measured, once: what FlashMLA returns for a query whose indices are all ``-1`` (``out``, ``lse``), raw and through
the seam.

Results: ``flashmla_<hw>_<date>.jsonl`` (one row per (kernel, shape)) and ``.md`` in ``benchmarks/results/`` and, when
set, ``$OUT`` (or ``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_bench as db  # noqa: E402

from dtkv import MLAFp8Layout, MLALatentLayout  # noqa: E402
from dtkv.attention import AttentionSpec, availability, resolve_attention  # noqa: E402
from dtkv.attention._fit import flashmla_module  # noqa: E402

HEADS, TOPK, PS, D_QK, D_V = 128, 2048, 64, 576, 512
SCALE = D_QK**-0.5
PREFILL_TARGET, DECODE_TARGET = 0.95, 0.90
RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------- inputs
def _positions(n: int, query_pos: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """int64 ``[n, k]`` key positions, each drawn from ``[0, query_pos[i]]`` (causal)."""
    r = torch.rand(n, k, generator=g, device=query_pos.device)
    return torch.minimum((r * (query_pos[:, None] + 1)).long(), query_pos[:, None])


def _slots(locs: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Hand-built token slots: ``perm[loc // 64] * 64 + loc % 64`` (int32)."""
    return (perm.long()[locs // PS] * PS + locs % PS).to(torch.int32)


def _fp8_pages(num_pages: int, dev, g: torch.Generator) -> torch.Tensor:
    """``[num_pages, 64, 656]`` uint8 valid fp8 rows (random latent, scales in [0.25, 2], bf16 rope): a template of
    512 pages, repeated."""
    tpl_pages = min(512, num_pages)
    rows = tpl_pages * PS
    tpl = torch.empty(rows, 656, dtype=torch.uint8, device=dev)
    tpl[:, :512] = (torch.randn(rows, 512, generator=g, device=dev) / 4).to(torch.float8_e4m3fn).view(torch.uint8)
    tpl[:, 512:528] = (0.25 + 1.75 * torch.rand(rows, 4, generator=g, device=dev)).view(torch.uint8)
    tpl[:, 528:] = (torch.randn(rows, 64, generator=g, device=dev) / 4).to(torch.bfloat16).view(torch.uint8)
    kc = torch.empty(num_pages, PS, 656, dtype=torch.uint8, device=dev)
    kc.view(-1, tpl_pages, PS, 656)[:] = tpl.view(1, tpl_pages, PS, 656)
    return kc


# ------------------------------------------------------------------------------------------- timing
HIDE_HOST_CYCLES = 4_000_000
"""GPU clock cycles of a spin kernel queued before each eager prefill timing (about 2 ms on an H200): the host
launches the timed calls while it spins, as a model's host runs ahead of its GPU, so the events time the device."""


def _paired(fns, reps: int, *, hide_host: bool = False) -> list[list[float]]:
    """Milliseconds of each of ``fns`` run back to back ``reps`` times (the order rotating), CUDA events.

    ``hide_host``: a spin kernel runs before each start event (:data:`HIDE_HOST_CYCLES`), so what is timed is the
    device's work alone; :func:`_host_us` measures the host side."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(reps):
        for j in [(i + k) % len(fns) for k in range(len(fns))]:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hide_host:
                torch.cuda._sleep(HIDE_HOST_CYCLES)
            s.record()
            fns[j]()
            e.record()
            e.synchronize()
            times[j].append(s.elapsed_time(e))
    return times


def _host_us(fn, reps: int) -> float:
    """Median host microseconds to launch ``fn`` (behind a spin kernel, so no launch waits on the device)."""
    out = []
    for _ in range(reps):
        torch.cuda._sleep(HIDE_HOST_CYCLES)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def _graph(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


# ------------------------------------------------------------------------------------------- cases
def prefill_case(n: int, context: int, dev, reps: int, g: torch.Generator) -> dict:
    fm, _ = flashmla_module()
    num_pages = context // PS
    kv = (torch.randn(num_pages, PS, D_QK, generator=g, device=dev) / 4).to(torch.bfloat16)
    perm = torch.randperm(num_pages, generator=g, device=dev).to(torch.int32)  # logical page -> pool page
    q = (torch.randn(n, HEADS, D_QK, generator=g, device=dev) / 8).to(torch.bfloat16)
    locs = _positions(n, torch.arange(context - n, context, device=dev), TOPK, g)  # the last n tokens' top-k
    raw_idx = _slots(locs, perm).view(n, 1, TOPK)
    kv_flat = kv.view(-1, 1, D_QK)
    backend = resolve_attention("flashmla", spec=AttentionSpec(num_heads=HEADS, layout=MLALatentLayout(page_size=PS),
                                                               topk=TOPK), device=dev)  # fmt: skip
    res = {}

    def raw():
        out, _, lse = fm.flash_mla_sparse_fwd(q, kv_flat, raw_idx, SCALE, d_v=D_V, use_legacy=True)
        res["raw"] = (out, lse)

    def seam():
        res["dtkv"] = backend.prefill(q, kv, backend.indices(locs, kv, page_map=perm), softmax_scale=SCALE)

    def translate():
        res["idx"] = backend.indices(locs, kv, page_map=perm)

    raw(), seam(), translate()
    torch.cuda.synchronize()
    t_raw, t_dtkv, t_idx = _paired([raw, seam, translate], reps, hide_host=True)
    t_eager_raw, t_eager_dtkv = _paired([raw, seam], reps)  # the host's launches inside the timing
    bitwise = all(torch.equal(a, b) for a, b in zip(res["raw"], res["dtkv"])) and torch.equal(res["idx"], raw_idx[:, 0])
    row = _row("sparse_prefill", n, 1, context, t_raw, t_dtkv, bitwise, flops=2.0 * n * HEADS * TOPK * (D_QK + D_V))
    idx_ms = statistics.median(t_idx)
    idx_bytes = locs.numel() * locs.element_size() + res["idx"].numel() * 4
    eager_raw, eager_dtkv = statistics.median(t_eager_raw), statistics.median(t_eager_dtkv)
    row.update(
        indices_ms=round(idx_ms, 5), indices_gbps=round(idx_bytes / idx_ms / 1e6, 1),
        host_raw_us=round(_host_us(raw, reps), 1), host_dtkv_us=round(_host_us(seam, reps), 1),
        eager_raw_ms=round(eager_raw, 5), eager_dtkv_ms=round(eager_dtkv, 5), eager_ratio=round(eager_raw / eager_dtkv, 4),
    )  # fmt: skip
    return row


def decode_case(batch: int, context: int, dev, rounds: int, layers: int, g: torch.Generator) -> dict:
    fm, _ = flashmla_module()
    num_pages = batch * context // PS
    kc = _fp8_pages(num_pages, dev, g)
    perm = torch.randperm(num_pages, generator=g, device=dev).to(torch.int32)
    q = (torch.randn(batch, HEADS, D_QK, generator=g, device=dev) / 8).to(torch.bfloat16)
    pos = _positions(batch, torch.full((batch,), context - 1, device=dev), TOPK, g)
    locs = torch.arange(batch, device=dev)[:, None] * context + pos  # request b's logical tokens: [b*T, (b+1)*T)
    raw_idx = _slots(locs, perm).view(batch, 1, TOPK)
    kc4, q4 = kc.unsqueeze(2), q.view(batch, 1, HEADS, D_QK)
    meta = fm.get_mla_metadata()[0]
    spec = AttentionSpec(num_heads=HEADS, layout=MLAFp8Layout(page_size=PS), topk=TOPK)
    backend = resolve_attention("flashmla", spec=spec, device=dev)
    # decode of a view or a replicated pool is not merged: its schedule skips the lse rewrite (the headline row);
    # a sharded rank's partial is merged, so its schedule rewrites FlashMLA's +inf (reported beside it)
    schedule = backend.plan_decode(batch, backend.index_width(TOPK), merge_lse=False)
    merged = backend.plan_decode(batch, backend.index_width(TOPK), merge_lse=True)
    res = {}

    def raw():
        for _ in range(layers):
            res["raw"] = fm.flash_mla_with_kvcache(q4, kc4, None, None, D_V, meta, softmax_scale=SCALE,
                                                   is_fp8_kvcache=True, indices=raw_idx, use_legacy=True)  # fmt: skip

    def seam(key="dtkv", sched=schedule):
        for _ in range(layers):
            idx = backend.indices(locs, kc, page_map=perm)
            res[key] = backend.decode(q, kc, idx, softmax_scale=SCALE, schedule=sched)

    def seam_merged():
        seam("merged", merged)

    raw(), seam(), seam_merged()  # warm-up: every metadata built on the device
    graphs = [_graph(raw), _graph(seam), _graph(seam_merged)]
    t_raw, t_dtkv, t_merged = _paired([gr.replay for gr in graphs], rounds)
    out_raw, lse_raw = res["raw"]
    bitwise = all(
        torch.equal(out_raw.view(batch, HEADS, D_V), res[k][0]) and torch.equal(lse_raw.view(batch, HEADS), res[k][1])
        for k in ("dtkv", "merged")
    )
    del graphs
    per_call = lambda ts: [t / layers for t in ts]  # noqa: E731
    row = _row("sparse_decode", batch, batch, context, per_call(t_raw), per_call(t_dtkv), bitwise,
               flops=2.0 * batch * HEADS * TOPK * (D_QK + D_V), layers=layers)  # fmt: skip
    merged_ms = statistics.median(per_call(t_merged))
    row.update(dtkv_merged_ms=round(merged_ms, 5), ratio_merged=round(row["raw_ms"] / merged_ms, 4))
    return row


def _row(kernel, tokens, batch, context, t_raw, t_dtkv, bitwise, *, flops, layers=None) -> dict:
    raw_ms, dtkv_ms = statistics.median(t_raw), statistics.median(t_dtkv)
    ratios = sorted(a / b for a, b in zip(t_raw, t_dtkv))
    row = {
        "kernel": kernel, "tokens": tokens, "batch": batch, "context": context,
        "raw_ms": round(raw_ms, 5), "dtkv_ms": round(dtkv_ms, 5), "ratio": round(raw_ms / dtkv_ms, 4),
        "bitwise": bool(bitwise), "paired_ratio_median": round(statistics.median(ratios), 4),
        "paired_ratio_min": round(ratios[0], 4), "samples": len(t_raw), "heads": HEADS, "topk": TOPK,
        "kv": "bf16" if kernel == "sparse_prefill" else "fp8", "raw_tflops": round(flops / raw_ms / 1e9, 1),
    }  # fmt: skip
    if layers:
        row["calls_per_graph"] = layers
    return row


def empty_query_convention(dev) -> dict:
    """What FlashMLA returns for a query whose indices are all ``-1`` (raw), and what the seam returns."""
    fm, _ = flashmla_module()
    g = torch.Generator(device=dev).manual_seed(7)
    kc = _fp8_pages(8, dev, g)
    q = (torch.randn(2, HEADS, D_QK, generator=g, device=dev) / 8).to(torch.bfloat16)
    idx = torch.randint(0, 8 * PS, (2, TOPK), generator=g, device=dev, dtype=torch.int32)
    idx[0] = -1
    out, lse = fm.flash_mla_with_kvcache(q.view(2, 1, HEADS, D_QK), kc.unsqueeze(2), None, None, D_V,
                                         fm.get_mla_metadata()[0], softmax_scale=SCALE, is_fp8_kvcache=True,
                                         indices=idx.view(2, 1, TOPK), use_legacy=True)  # fmt: skip
    kv = (torch.randn(8 * PS, 1, D_QK, generator=g, device=dev) / 4).to(torch.bfloat16)
    p_out, _, p_lse = fm.flash_mla_sparse_fwd(q, kv, idx.view(2, 1, TOPK), SCALE, d_v=D_V, use_legacy=True)
    backend = resolve_attention("flashmla", spec=AttentionSpec(num_heads=HEADS, layout=MLAFp8Layout(), topk=TOPK),
                                device=dev)  # fmt: skip
    s_out, s_lse = backend.decode(q, kc, idx, softmax_scale=SCALE)
    f = lambda t: float(t.float().abs().max())  # noqa: E731
    return {
        "decode_raw_out_absmax": f(out[0]), "decode_raw_lse": sorted({float(x) for x in lse[0].flatten()}),
        "prefill_raw_out_absmax": f(p_out[0]), "prefill_raw_lse": sorted({float(x) for x in p_lse[0].flatten()}),
        "seam_out_absmax": f(s_out[0]), "seam_lse": sorted({float(x) for x in s_lse[0].flatten()}),
        "seam_other_query_finite": bool(torch.isfinite(s_lse[1]).all()),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------- outputs
def summary(rows: list[dict], empty: dict, title: str, extra: str) -> str:
    lines = [f"# {title}", "", extra, "",
             "| kernel | tokens | batch | context | raw ms | dtkv ms | ratio | paired ratio (median, min) | bitwise | "
             "raw TFLOP/s |", "|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]  # fmt: skip
    for r in rows:
        plain = f" ({r['ratio_merged']:.3f} with the lse rewrite of a merged partial)" if "ratio_merged" in r else ""
        lines.append(f"| {r['kernel']} | {r['tokens']} | {r['batch']} | {r['context']} | {r['raw_ms']:.4f} | "
                     f"{r['dtkv_ms']:.4f} | {r['ratio']:.3f}{plain} | {r['paired_ratio_median']:.3f}, "
                     f"{r['paired_ratio_min']:.3f} | {r['bitwise']} | {r['raw_tflops']} |")  # fmt: skip
    pre = [r for r in rows if "indices_ms" in r]
    if pre:
        lines += ["", "Prefill's seam, split: the index translation alone (device), the host's launch time of each path, "
                  "and the ratio with the host's launches inside the timing (no spin kernel ahead).", "",
                  "| tokens | indices ms | indices GB/s | host raw us | host dtkv us | eager ratio |",
                  "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['tokens']} | {r['indices_ms']:.4f} | {r['indices_gbps']} | {r['host_raw_us']} | "
                  f"{r['host_dtkv_us']} | {r['eager_ratio']:.3f} |" for r in pre]  # fmt: skip
    lines += ["", "## Targets", ""] + target_lines(rows)
    lines += ["", "## A query whose indices are all -1", "", f"`{json.dumps(empty)}`", ""]
    return "\n".join(lines) + "\n"


def target_lines(rows: list[dict]) -> list[str]:
    out = []
    for kernel, target in (("sparse_prefill", PREFILL_TARGET), ("sparse_decode", DECODE_TARGET)):
        sel = [r for r in rows if r["kernel"] == kernel]
        if not sel:
            continue
        worst = min(sel, key=lambda r: r["ratio"])
        ok = all(r["ratio"] >= target for r in sel)
        out.append(f"- TARGET {kernel} ratio >= {target:.2f} on every row: worst {worst['ratio']:.3f} "
                   f"(tokens {worst['tokens']}, batch {worst['batch']}, context {worst['context']}): "
                   f"**{'met' if ok else 'not met'}**")  # fmt: skip
    out.append(
        f"- TARGET bitwise equal outputs on every row: **{'met' if all(r['bitwise'] for r in rows) else 'not met'}**"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--prefill-context", type=int, default=131072, help="tokens of the request's KV (default 128K)")
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--decode-contexts", type=int, nargs="*", default=[32768, 131072, 1048576])
    ap.add_argument("--max-decode-tokens", type=int, default=2**24, help="skip decode shapes past batch x context")
    ap.add_argument("--layers", type=int, default=8, help="decode calls per CUDA graph (default 8)")
    ap.add_argument("--reps", type=int, default=5, help="paired prefill timings per shape (default 5)")
    ap.add_argument("--rounds", type=int, default=30, help="paired decode graph replays per shape (default 30)")
    ap.add_argument("--out-dir", help="also write results here (default: $OUT when set)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_flashmla needs a CUDA device: nothing to measure here", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    why = availability("flashmla", dev)
    if why:
        print(f"bench_flashmla needs FlashMLA: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in args.prefill_tokens:
        rows.append(prefill_case(n, max(args.prefill_context, n), dev, args.reps, g))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    for t in args.decode_contexts:
        for b in args.decode_batches:
            if b * t > args.max_decode_tokens:
                continue
            rows.append(decode_case(b, t, dev, args.rounds, args.layers, g))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    empty = empty_query_convention(dev)
    fm, _ = flashmla_module()
    meta = {"device": torch.cuda.get_device_name(dev), "flash_mla": getattr(fm, "__version__", "?"), **db.versions()}
    rows = [{**r, **meta} for r in rows]
    name = f"flashmla_{db.hardware_tag(dev, 1).removesuffix('x1')}_{db.today()}"
    extra = (f"{meta}; {HEADS} heads, top-k {TOPK}, d_qk {D_QK}, pages of {PS}; prefill reps {args.reps}, decode "
             f"{args.rounds} paired replays of graphs of {args.layers} calls; command: `{' '.join(sys.argv)}`; "
             f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    text = summary(rows, empty, name, extra)
    dirs = {RESULTS} | {Path(p) for p in (args.out_dir, os.environ.get("OUT")) if p}
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        db.write_jsonl(d / f"{name}.jsonl", rows)
        (d / f"{name}.md").write_text(text)
    print(text)
    print(f"wrote {name}.jsonl and .md to {', '.join(str(d) for d in sorted(dirs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
