"""Sweep the launch configurations of the ``dtkv.ops`` Triton kernels on one GPU; keep the best per op and size.

    python benchmarks/tune_ops.py --out $OUT/tuned.json          # the sweep (one H200: about 5 minutes)
    python benchmarks/tune_ops.py --write-table $OUT/tuned.json  # rewrite the TUNED block of ops/_tuned.py from it

The method is ``benchmarks/bench_ops.py``'s, on its scenarios: for each op of ``ops/_tuned.py`` and each token count
(64K, 256K, 1M) the inputs are built once; every candidate configuration (:data:`CANDIDATES`) is then checked
bitwise against the torch backend on each scenario's first input set (a candidate that fails or does not compile is
reported and dropped), its calls are captured as CUDA graphs over the rotating input sets, and all candidates of
that op and size are replayed interleaved with the same-size copies of every scenario (median of ``--reps``).

A candidate's score is the smallest, over the op's scenarios, of its share of the same-size copy divided by the
scenario's target (0.90, or 0.75 for the row-interleaved owner filter), so one configuration serves every scenario
of an op (token order and round-robin rows for the owner filter; fp8 and bf16 rows for the direct write). The
winner per (op, size) goes to the JSON's ``tuned`` map, the one ``--write-table`` turns into ``ops/_tuned.py``;
every candidate's numbers go to the JSON and to a markdown table beside it. ``--budget-s`` stops the sweep before
an op and size that would start past the budget (the rest keep their current configuration). Runs on a CPU too,
under ``TRITON_INTERPRET=1`` with ``--tokens 70 --ops remap``-like sizes (a dry run of the checks, no timing value).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ops as B  # noqa: E402  (makes the dtkv/ops link of a checkout without the editable install)

from dtkv.ops import _tuned  # noqa: E402

TABLE = B.ROOT / "ops" / "_tuned.py"
BEGIN, END = "# BEGIN TUNED", "# END TUNED"


def _grid(**axes) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# Candidates per op (each completed from DEFAULTS, so every one is a full configuration). The grids are pruned by
# what decides each kernel's speed on an H200 (a memory-bound copy: bytes in flight per SM, tile size against
# registers, lanes wasted on masks): about 110 kernels to compile in all (~1-2 s each), 136 candidates.
CANDIDATES: dict[str, list[dict]] = {
    # owner filter, 656-byte rows (82 words: chunks 64+16+2): "tile" keeps today's one-tile-per-program kernel
    # (empty tiles skip their copy); "compact" gathers a window's kept rows into dense tiles (a round-robin chunk
    # keeps 1 row in 4 in every tile), one window per program or a persistent grid prefetching the next window
    # (4 to 16 programs per SM: one grid size, no recompile). window * block_r <= 8192: the [block_r, window]
    # comparison that finds the kept rows of scattered windows must stay in registers.
    "write_owned": _grid(variant=["tile"], block_r=[16, 32, 64], num_warps=[4, 8])
    + [
        {"variant": "compact", "window": w, "block_r": r, "num_warps": nw, "programs_per_sm": p}
        for (w, r) in [(64, 16), (64, 32), (128, 16), (128, 32), (256, 16), (256, 32)]
        for nw in (4, 8)
        for p in (0, 4, 8, 16)
    ],
    # direct write, 656-byte (82 words) and 1152-byte (144 words) rows: rows per program against registers
    # (all chunks of a tile are loaded before any store), and one masked chunk (82 of 128 lanes) as a control.
    "direct_write": _grid(block_r=[8, 16, 32, 64], num_warps=[4, 8], chunk_w=[128])
    + _grid(block_r=[8, 16], num_warps=[4], chunk_w=[0]),
    # [block_r, 4, 128] bf16 tiles: 2 to 16 rows of 1152 bytes per program
    "quantize_write_mla_fp8": _grid(block_r=[2, 4, 8, 16], num_warps=[2, 4, 8]),
    # [block_r, 128] bf16 tiles: 8 to 64 keys of 256 bytes per program
    "quantize_write_indexer_fp8": _grid(block_r=[8, 16, 32, 64], num_warps=[2, 4, 8]),
    # 41 984-byte pages (5248 words): a page per program in 3 chunks (4096+1024+128) or 4 (2048+2048+1024+128),
    # halves or quarters of a page per program, two pages per program
    "pack_owned_pages": _grid(rows=[1, 2], parts=[1, 2], chunk_w=[4096], num_warps=[4, 8])
    + _grid(rows=[1], parts=[4], chunk_w=[4096], num_warps=[4, 8])
    + _grid(rows=[1], parts=[1], chunk_w=[2048], num_warps=[4, 8]),
    # the same for a layer's two layouts (5248 and 1056 words per page) in one launch
    "pack_layer_pages": _grid(rows=[1, 2], parts=[1, 2], chunk_w=[4096], num_warps=[4, 8])
    + _grid(rows=[1], parts=[4], chunk_w=[4096], num_warps=[4, 8])
    + _grid(rows=[1], parts=[1], chunk_w=[2048], num_warps=[4, 8]),
    # int32 top-k: indices per program, and how page_map stays in L1 (a 2-byte copy of it, indices past L1);
    # at 1M tokens the int32 map is 256 KiB, more than an SM's L1
    "remap": _grid(block=[1024, 2048, 4096], num_warps=[4, 8], map16=["never", "always"], idx_cg=[0, 1]),
}
ORDER = [
    "write_owned",
    "remap",
    "direct_write",
    "quantize_write_mla_fp8",
    "pack_owned_pages",
    "quantize_write_indexer_fp8",
    "pack_layer_pages",
]
"""Sweep order: the rows furthest from their targets first (a budget cut leaves the others as they are)."""


def full(op: str, cand: dict) -> dict:
    return {**_tuned.DEFAULTS[op], **cand}


def label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def sweep_one(op: str, n: int, dev: torch.device, reps: int, log) -> list[dict]:
    """Every candidate of ``op`` at ``n`` tokens: checked, captured, timed with the same-size copies."""
    scenarios = [make(n, dev) for make in B.SCENARIOS[op]]
    entries, replays = [], []
    for i, cand in enumerate(CANDIDATES[op]):
        cfg = full(op, cand)
        entry = {"op": op, "tokens": n, "size": scenarios[0].size, "config": cfg, "error": None}
        t0 = time.perf_counter()
        try:
            with _tuned.override(op, **cfg):
                why = [w for w in (s.verify() for s in scenarios) if w]
                if why:
                    raise AssertionError("; ".join(why))
                rep = [(B.capture(s.calls, dev), len(s.calls)) for s in scenarios]
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or to match is reported, dropped
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"    {i + 1}/{len(CANDIDATES[op])} {cand}: FAILED {entry['error']}")
            entries.append(entry)
            continue
        log(f"    {i + 1}/{len(CANDIDATES[op])} {cand}: checked and captured in {time.perf_counter() - t0:.1f}s")
        entries.append(entry)
        replays.append((entry, rep))
    copies = []
    for s in scenarios:
        groups = B.copy_groups(s.bytes_moved // 2, dev)
        copies.append([(B.capture(g, dev), len(g)) for g in groups])
    flat = [r for _, rep in replays for r in rep] + [r for c in copies for r in c]
    times = B.time_replays(flat, dev, reps) if flat else []
    copy_us = []
    k = sum(len(rep) for _, rep in replays)
    for c in copies:
        copy_us.append(min(times[k : k + len(c)]))
        k += len(c)
    k = 0
    for entry, rep in replays:
        rows = []
        for s, us, cu in zip(scenarios, times[k : k + len(rep)], copy_us):
            rows.append({"op": s.op, "us": us, "copy_us": cu, "share": cu / us, "target": s.target})
        k += len(rep)
        entry["scenarios"] = rows
        entry["score"] = min(r["share"] / r["target"] for r in rows)
    del scenarios, replays, copies, flat
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return entries


def render_markdown(results: list[dict]) -> str:
    lines = ["| op | tokens | config | score | scenarios (us, % of same-size copy) |", "|---|---:|---|---:|---|"]
    for e in results:
        cfg = ", ".join(f"{k}={v}" for k, v in e["config"].items())
        if e["error"]:
            lines.append(f"| {e['op']} | {e['tokens']} | {cfg} | failed | {e['error']} |")
            continue
        scen = "; ".join(f"{r['op']}: {r['us']:.1f} us, {100 * r['share']:.1f}%" for r in e.get("scenarios", []))
        lines.append(f"| {e['op']} | {e['tokens']} | {cfg} | {e.get('score', float('nan')):.3f} | {scen} |")
    return "\n".join(lines)


def run_sweep(args) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = args.tokens or ([65536, 262144, 1048576] if dev.type == "cuda" else [70])
    reps = args.reps or (20 if dev.type == "cuda" else 1)
    ops = args.ops or ORDER
    unknown = sorted(set(ops) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"--ops must name ops of {ORDER}, got {unknown}")
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    log(f"tune_ops on {name}: ops {ops}, tokens {tokens}, {sum(len(CANDIDATES[o]) for o in ops)} candidates")
    results, tuned, skipped = [], {}, []
    for op in ops:
        for n in tokens:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{op}@{label(n)}")
                log(f"{op} {label(n)}: skipped (past the {args.budget_s:.0f}s budget)")
                continue
            log(f"{op} {label(n)}: {len(CANDIDATES[op])} candidates")
            entries = sweep_one(op, n, dev, reps, log)
            results += entries
            ok = [e for e in entries if not e["error"]]
            if not ok:
                log(f"{op} {label(n)}: no candidate passed")
                continue
            best = max(ok, key=lambda e: e["score"])
            tuned.setdefault(op, {})[str(best["size"])] = best["config"]
            shares = ", ".join(f"{r['op']} {100 * r['share']:.1f}%" for r in best["scenarios"])
            log(f"{op} {label(n)}: best {best['config']} score {best['score']:.3f} ({shares})")
    doc = {
        "device": name,
        "torch": torch.__version__,
        "triton": B._triton_version(),
        "date": datetime.date.today().isoformat(),
        "commit": B._commit(),
        "tokens": tokens,
        "tuned": tuned,
        "skipped": skipped,
        "results": results,
    }
    out = Path(args.out or (Path(os.environ.get("OUT", ".")) / "tuned.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"tune_ops on {name}, {doc['date']}\n\n" + render_markdown(results) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    print("\nSummary (winner per op and size; score = min over scenarios of share of same-size copy / target):")
    for op in ops:
        for n in tokens:
            mine = [e for e in results if e["op"] == op and e["tokens"] == n and not e["error"]]
            if not mine:
                print(f"  {op:28s} {label(n):>5s}: {'skipped' if f'{op}@{label(n)}' in skipped else 'none passed'}")
                continue
            best = max(mine, key=lambda e: e["score"])
            shares = ", ".join(
                f"{r['op'].removeprefix(op).strip() or op} {100 * r['share']:.0f}%"
                f"{'' if r['share'] >= r['target'] else ' (miss)'}"
                for r in best["scenarios"]
            )
            fails = sum(1 for e in results if e["op"] == op and e["tokens"] == n and e["error"])
            print(f"  {op:28s} {label(n):>5s}: {shares}; {best['config']}" + (f"; {fails} failed" if fails else ""))


# ----------------------------------------------------------------------------------------- table writer
def _value(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(int(v))


def render_table(doc: dict) -> str:
    """The TUNED block of ``ops/_tuned.py`` for a sweep's JSON (validated against ``DEFAULTS``)."""
    tuned = doc.get("tuned", {})
    get = {k: doc.get(k, "?") for k in ("device", "torch", "triton", "date", "commit")}
    origin = f"{get['device']}, torch {get['torch']}, triton {get['triton']}, {get['date']} (dtkv {get['commit']})"
    lines = [
        f"{BEGIN}: written by `python benchmarks/tune_ops.py --write-table <json>`; do not edit by hand",
        "# fmt: off",
        f"TUNED_ON = {json.dumps(origin)}",
        "TUNED: dict[str, dict[int, Config]] = {",
    ]
    for op in sorted(tuned):
        if op not in _tuned.DEFAULTS:
            raise ValueError(f"tuned op {op!r} is not an op of ops/_tuned.py ({sorted(_tuned.DEFAULTS)})")
        lines.append(f"    {json.dumps(op)}: {{")
        for size in sorted(tuned[op], key=int):
            cfg = tuned[op][size]
            bad = sorted(set(cfg) - set(_tuned.DEFAULTS[op]))
            if bad:
                raise ValueError(f"tuned config of {op!r} at {size} has unknown keys {bad}")
            items = [f"{json.dumps(k)}: {_value(v)}" for k, v in cfg.items()]
            one = f"        {int(size)}: {{{', '.join(items)}}},"
            if len(one) <= 120:
                lines.append(one)
            else:
                lines.append(f"        {int(size)}: {{")
                lines += [f"            {item}," for item in items]
                lines.append("        },")
        lines.append("    },")
    lines += ["}", "# fmt: on", END]
    return "\n".join(lines)


def write_table(json_path: str, table: Path = TABLE) -> str:
    doc = json.loads(Path(json_path).read_text())
    block = render_table(doc)
    text = table.read_text()
    i, j = text.index(BEGIN), text.index(END)
    table.write_text(text[:i] + block + text[j + len(END) :])
    return block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON of the sweep (default $OUT/tuned.json, else ./tuned.json)")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default 64K 256K 1M)")
    ap.add_argument("--ops", nargs="*", help=f"ops to sweep (default all, in this order: {ORDER})")
    ap.add_argument("--reps", type=int, default=0, help="timed replays per candidate (default 20)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no op and size past this many seconds")
    ap.add_argument("--write-table", metavar="JSON", help="rewrite ops/_tuned.py's TUNED block from a sweep's JSON")
    args = ap.parse_args()
    if args.write_table:
        print(write_table(args.write_table))
        print(f"wrote {TABLE}")
        return
    run_sweep(args)


if __name__ == "__main__":
    main()
