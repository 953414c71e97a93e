"""The decode step's selection alone: ``dtkv::keys_topk`` (a radix select over many programs a row) against the
path it replaces, ``torch.topk`` of the packed keys then the kept columns' slots (:func:`dtkv.ops.indexer_topk`).

GPU, one H100 / H200 (under a minute)::

    python benchmarks/bench_keys_topk.py --out-dir $OUT             # add --sweep to time launch candidates

CPU smoke (tiny shapes; with ``TRITON_INTERPRET=1`` the kernels under the interpreter; what
``tests/test_bench_keys_topk.py`` runs)::

    TRITON_INTERPRET=1 python benchmarks/bench_keys_topk.py --smoke --out-dir /tmp/x

Case ``rows x context`` (``--cases``; default 1 and 16 rows at 8K, 32K and 128K: the decode step at batch 1 and 16,
``index_topk`` 2048): random scores packed as :func:`dtkv.ops.selection_keys.selection_keys` with the columns as
positions, every column visible, a slot table ``[N, K]`` (the runtime's full-view bucket). Rows, one per case and
``mode``:

- ``packed``: :func:`dtkv.ops.indexer_topk` and the slots gathered (the runtime's decode before);
- ``keys_topk``: :func:`dtkv.ops.keys_topk` with the slots (``bitwise``: the packed path's result exactly).

Each row is timed two ways: ``ms`` (median of ``--reps`` CUDA-event timings of eager calls) and ``graph_ms`` (the
same call captured once in a CUDA graph, the median of ``--reps`` replays: how the decode step runs it, launch
costs gone). ``gbps``: the keys read once over ``graph_ms``; ``ceiling_ms``: that read at the device's HBM bandwidth
(``--hbm-gbps``, default 3350: H100 SXM), the floor of any top-k that reads its keys. ``speedup`` (``keys_topk``):
the packed path's ``graph_ms`` over its own. ``--sweep`` times :data:`CANDIDATES` (rows ``mode: "sweep"``,
each checked ``bitwise``).

Writes ``keys_topk_<hw>_<date>.jsonl`` and ``.md`` into ``--out-dir`` and prints a closing ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(ROOT))

from dtkv.ops import indexer_topk, keys_topk  # noqa: E402
from dtkv.ops.selection_keys import selection_keys  # noqa: E402

_mod = sys.modules["dtkv.ops.keys_topk"]
TOPK = 2048
CASES = [(1, 8192), (1, 32768), (1, 131072), (16, 8192), (16, 32768), (16, 131072)]
SMOKE_CASES = [(1, 37), (3, 300)]
CANDIDATES = [
    {"chunk": 512, "block": 512},
    {"chunk": 1024, "block": 1024},
    {"chunk": 2048, "block": 1024},
    {"chunk": 4096, "block": 1024},
    {"chunk": 1024, "block": 1024, "num_warps": 8},
    {"chunk": 1024, "block": 512, "num_warps": 2},
    {"digit_bits": 11, "chunk": 1024, "block": 1024},
    {"digit_bits": 6, "chunk": 1024, "block": 1024},
    {"chunk": 1024, "block": 1024, "rank_rows": 32, "rank_cols": 128},
    {"chunk": 1024, "block": 1024, "rank_rows": 128, "rank_cols": 32},
    {"chunk": 1024, "block": 1024, "rank_rows": 16, "rank_cols": 128},
    {"chunk": 1024, "block": 1024, "rank_rows": 16, "rank_cols": 256},
    {"chunk": 1024, "block": 1024, "rank_rows": 8, "rank_cols": 256},
    {"chunk": 1024, "block": 1024, "rank_rows": 8, "rank_cols": 512},
    {"chunk": 1024, "block": 1024, "rank_rows": 4, "rank_cols": 512},
]
SMOKE_CANDIDATES = [{"chunk": 64, "block": 32, "digit_bits": 11}, {"rank_rows": 16, "rank_cols": 32}]


def _case(n: int, context: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(n * 7 + context)
    scores = torch.randn(n, context, generator=g)
    cols = torch.arange(context)
    keys = selection_keys(scores, cols.expand(n, context)).to(device)
    slots = torch.randint(0, 2**30, (n, context), generator=g).to(device)
    return {"keys": keys, "slots": slots}


def _packed(c: dict, k: int):
    def run():
        cols, valid = indexer_topk(c["keys"], k)
        return torch.where(valid, c["slots"].gather(1, cols.clamp(min=0)), torch.full_like(cols, -1))

    return run


def _new(c: dict, k: int, backend: str):
    return lambda: keys_topk(c["keys"], k, key_slots=c["slots"], backend=backend)


def _timed(fn, device: torch.device, reps: int) -> tuple[float, float, torch.Tensor]:
    """``(eager median ms, graph-replay median ms or nan on a CPU, result)``."""
    out = fn()
    if device.type != "cuda":
        ms = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            ms.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ms), float("nan"), out
    torch.cuda.synchronize(device)
    eager, replay = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        eager.append(a.elapsed_time(b))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        replay.append(a.elapsed_time(b))
    assert torch.equal(captured, out), "a replay gave another result than the eager call"
    return statistics.median(eager), statistics.median(replay), out


def run_cases(cases, device: torch.device, *, reps: int, hbm_gbps: float, log=print) -> list[dict]:
    backend = "triton" if device.type == "cuda" else "auto"
    rows = []
    for n, context in cases:
        c = _case(n, context, device)
        want = None
        for mode, fn in (("packed", _packed(c, TOPK)), ("keys_topk", _new(c, TOPK, backend))):
            row = {"phase": "decode_topk", "mode": mode, "rows": n, "context": context, "k": TOPK, "ok": True}
            try:
                ms, graph_ms, out = _timed(fn, device, reps)
                t = graph_ms if graph_ms == graph_ms else ms
                nbytes = c["keys"].numel() * 8
                row |= {"ms": ms, "graph_ms": graph_ms, "gbps": nbytes / t / 1e6,
                        "ceiling_ms": nbytes / hbm_gbps / 1e6}  # fmt: skip
                if mode == "packed":
                    want, packed_t = out, t
                else:
                    row |= {"bitwise": bool(torch.equal(out, want)), "speedup": packed_t / t,
                            "config": dict(_mod.KERNEL_CONFIG)}  # fmt: skip
                    row["ok"] = row["bitwise"]
            except Exception as e:  # noqa: BLE001 - a failed case is a row, the others still run
                row |= {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            log(_line(row))
            rows.append(row)
    return rows


def sweep(cases, device: torch.device, cands: list[dict], *, reps: int, log=print) -> list[dict]:
    backend = "triton" if device.type == "cuda" else "auto"
    rows = []
    default = dict(_mod.KERNEL_CONFIG)
    try:
        for n, context in cases:
            c = _case(n, context, device)
            want = _packed(c, TOPK)()
            for cand in cands:
                _mod.KERNEL_CONFIG = {**default, **cand}
                row = {"phase": "decode_topk", "mode": "sweep", "rows": n, "context": context, "k": TOPK,
                       "config": dict(_mod.KERNEL_CONFIG), "ok": True}  # fmt: skip
                try:
                    ms, graph_ms, out = _timed(_new(c, TOPK, backend), device, reps)
                    row |= {"ms": ms, "graph_ms": graph_ms, "bitwise": bool(torch.equal(out, want))}
                    row["ok"] = row["bitwise"]
                except Exception as e:  # noqa: BLE001
                    row |= {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
                log(_line(row))
                rows.append(row)
    finally:
        _mod.KERNEL_CONFIG = default
    return rows


def _line(r: dict) -> str:
    if not r["ok"] and "error" in r:
        return f"{r['mode']:>10} {r['rows']}x{r['context']}: FAILED {r['error']}"
    extra = f" x{r['speedup']:.2f} bitwise={r['bitwise']}" if "speedup" in r else ""
    cfg = f" {r['config']}" if r["mode"] == "sweep" else ""
    return (
        f"{r['mode']:>10} {r['rows']}x{r['context']}: {r['ms']:.3f} ms eager, {r['graph_ms']:.3f} ms graph{extra}{cfg}"
    )


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "", "| mode | rows x context | eager ms | graph ms | GB/s | ceiling ms | speedup | bitwise |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        if r["mode"] == "sweep" or "ms" not in r:
            continue
        sp = f"{r['speedup']:.2f}" if "speedup" in r else ""
        lines.append(f"| {r['mode']} | {r['rows']} x {r['context']} | {r['ms']:.3f} | {r['graph_ms']:.3f} | "
                     f"{r['gbps']:.0f} | {r['ceiling_ms']:.4f} | {sp} | {r.get('bitwise', '')} |")  # fmt: skip
    sw = [r for r in rows if r["mode"] == "sweep" and "ms" in r]
    if sw:
        lines += ["", "| sweep: rows x context | config | eager ms | graph ms | bitwise |", "|---|---|---:|---:|---|"]
        lines += [f"| {r['rows']} x {r['context']} | `{r['config']}` | {r['ms']:.3f} | {r['graph_ms']:.3f} | "
                  f"{r['bitwise']} |" for r in sw]  # fmt: skip
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    new = [r for r in rows if r["mode"] == "keys_topk"]
    bad = [r for r in rows if not r.get("ok")]
    parts = [f"{r['rows']}x{r['context']}: {r['graph_ms']:.3f} ms (x{r['speedup']:.2f})" for r in new if "ms" in r]
    return f"SUMMARY keys_topk vs the packed path: {'; '.join(parts) or 'nothing ran'}; {len(bad)} failed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--cases", default=None, help="rows x context pairs, e.g. 1x32768,16x131072")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm-gbps", type=float, default=3350.0, help="the device's HBM bandwidth (H200: 4800)")
    ap.add_argument("--sweep", action="store_true", help="time the launch candidates at 1x32768 and 16x131072")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes (the kernels need TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.cases:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    else:
        cases = SMOKE_CASES if args.smoke else CASES
    reps = 1 if args.smoke else args.reps
    command = "python benchmarks/bench_keys_topk.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run_cases(cases, device, reps=reps, hbm_gbps=args.hbm_gbps)
    if args.sweep:
        at = SMOKE_CASES[-1:] if args.smoke else [(1, 32768), (16, 131072)]
        rows += sweep(at, device, SMOKE_CANDIDATES if args.smoke else CANDIDATES, reps=reps)
    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
    tag = "cpux1" if device.type == "cpu" else next((f"{m}x1" for m in ("h200", "h100", "b200") if m in name), "gpux1")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"keys_topk_{tag}_{datetime.date.today().isoformat()}"
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    header = f"# The decode step's selection, {tag}, torch {torch.__version__}\n\n"
    stem.with_suffix(".md").write_text(header + markdown(rows, command))
    print(summary(rows))
    print(f"wrote {stem}.jsonl, {stem}.md")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
