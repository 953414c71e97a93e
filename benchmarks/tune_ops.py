"""Sweep the launch configurations of the ``dtkv.ops`` Triton kernels on one GPU; keep the best per op and size.

    python benchmarks/tune_ops.py --out $OUT/tuned.json          # the sweep (one H200: about 5 minutes)
    python benchmarks/tune_ops.py --write-table $OUT/tuned.json  # rewrite the TUNED block of ops/_tuned.py from it

The method is ``benchmarks/bench_ops.py``'s, on its scenarios: for each op of ``ops/_tuned.py`` and each token count
(64K, 256K, 1M) the inputs are built once; every candidate configuration (:data:`CANDIDATES`) is then checked
bitwise against the torch backend on every input set it will be timed on (a candidate that fails or does not
compile is reported and dropped), its calls are captured as CUDA graphs over the rotating input sets, and all
candidates of that op and size are replayed interleaved with the same-size copies of every scenario (median of
``--reps``), each replay synchronized and checked on its own.

Each (op, size) runs in a child process of its own. A candidate that takes the CUDA context down (an illegal memory
access poisons it for the whole process) costs only that child: the parent learns from the child's event log which
candidate was running (the one being checked, captured or replayed), records it as failed, and runs the child again
without it (at most :data:`MAX_CRASHES` times per op and size).

A candidate's score is the smallest, over the op's scenarios, of its share of the same-size copy divided by the
scenario's target (0.90, or 0.75 for the row-interleaved owner filter), so one configuration serves every scenario
of an op (token order and round-robin rows for the owner filter; fp8 and bf16 rows for the direct write). The
winner per (op, size) goes to the JSON's ``tuned`` map, the one ``--write-table`` turns into ``ops/_tuned.py``;
every candidate's numbers go to the JSON and to a markdown table beside it (both rewritten after each op and size,
so a sweep cut short keeps what it measured). ``--budget-s`` starts no op and size past that many seconds (the rest
keep their current configuration) and ``--deadline-s`` stops a child still running then. Runs on a CPU too, under
``TRITON_INTERPRET=1`` with ``--tokens 70 --ops remap``-like sizes (a dry run of the checks, no timing value).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ops as B  # noqa: E402  (makes the dtkv/ops link of a checkout without the editable install)

from dtkv.ops import _tuned  # noqa: E402

TABLE = B.ROOT / "ops" / "_tuned.py"
BEGIN, END = "# BEGIN TUNED", "# END TUNED"
MAX_CRASHES = 4
"""Child processes of one op and size that may die (each losing one candidate) before the size is given up."""
CRASH_EXIT = 3
"""Exit status of a child that found its CUDA context lost (its event log names the candidate)."""


def _grid(**axes) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# Candidates per op (each completed from DEFAULTS, so every one is a full configuration). The grids are pruned by
# what decides each kernel's speed on an H200 (a memory-bound copy: bytes in flight per SM, tile size against
# registers, lanes wasted on masks): about 100 kernels to compile in all (~1-2 s each), 124 candidates.
CANDIDATES: dict[str, list[dict]] = {
    # owner filter, 656-byte rows (82 words: chunks 64+16+2): "tile" keeps today's one-tile-per-program kernel
    # (empty tiles skip their copy); "compact" gathers a window's kept rows into dense tiles (a round-robin chunk
    # keeps 1 row in 4 in every tile), one window per program or a persistent grid prefetching the next window
    # (4 or 8 programs per SM: one grid size, no recompile; 16 programs of 4 warps already fill an SM's 64 warp
    # slots, which is what one window per program gets). window * block_r <= 8192: the [block_r, window]
    # comparison that finds the kept rows of scattered windows must stay in registers.
    "write_owned": _grid(variant=["tile"], block_r=[16, 32, 64], num_warps=[4, 8])
    + [
        {"variant": "compact", "window": w, "block_r": r, "num_warps": nw, "programs_per_sm": p}
        for (w, r) in [(64, 16), (64, 32), (128, 16), (128, 32), (256, 16), (256, 32)]
        for nw in (4, 8)
        for p in (0, 4, 8)
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


# ----------------------------------------------------------------------------------------- child: one op and size
class _Events:
    """The child's event log: one JSON object per line, flushed at once (what a parent reads after a crash)."""

    def __init__(self, path: str | None) -> None:
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 - closed at exit

    def __call__(self, **event) -> None:
        if self._f is not None:
            self._f.write(json.dumps(event) + "\n")
            self._f.flush()


def _fault(inject: str | None, cand: int, stage: str) -> None:
    """Fault injection for the tests: ``inject = "K:STAGE,..."`` ends the process abruptly (as a lost CUDA context
    ends a child) when candidate ``K`` reaches ``STAGE`` (``check`` or ``time``)."""
    if inject and f"{cand}:{stage}" in inject.split(","):
        os._exit(86)


def sweep_one(op: str, n: int, dev: torch.device, reps: int, log, *, skip=(), events=None, inject=None) -> list[dict]:
    """Every candidate of ``op`` at ``n`` tokens but those in ``skip``: checked on every input set, captured, timed
    with the same-size copies. ``events`` (a :class:`_Events`) hears of each step; when the CUDA context is lost
    the event names the candidate and the process exits with :data:`CRASH_EXIT`."""
    events = events or _Events(None)

    def crash(cand, stage: str, e: BaseException) -> None:
        events(event="crash", cand=cand, stage=stage, error=_first_line(e))
        log(f"    CUDA context lost at candidate {cand} ({stage}): {_first_line(e)}")
        sys.stdout.flush()
        os._exit(CRASH_EXIT)

    scenarios = [make(n, dev) for make in B.SCENARIOS[op]]
    entries, replays = [], []
    count = len(CANDIDATES[op])
    for i, cand in enumerate(CANDIDATES[op]):
        if i in skip:
            continue
        cfg = full(op, cand)
        entry = {"op": op, "tokens": n, "size": scenarios[0].size, "config": cfg, "error": None, "cand": i}
        t0 = time.perf_counter()
        events(event="begin", cand=i, stage="check")
        try:
            _fault(inject, i, "check")
            with _tuned.override(op, **cfg):
                why = [f"{s.op}: {w}" for s, w in ((s, s.verify()) for s in scenarios) if w]
                if why:
                    raise AssertionError("; ".join(why))
                rep = [(B.capture(s.calls, dev), len(s.calls)) for s in scenarios]
            B._sync(dev)
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or to match is reported, dropped
            if not B.context_ok(dev):
                crash(i, "check", e)
            entry["error"] = _first_line(e)
            events(event="failed", cand=i, error=entry["error"])
            log(f"    {i + 1}/{count} {cand}: FAILED {entry['error']}")
            entries.append(entry)
            continue
        log(f"    {i + 1}/{count} {cand}: checked on every input set and captured in {time.perf_counter() - t0:.1f}s")
        entries.append(entry)
        replays.append((entry, rep))
    events(event="begin", cand=None, stage="copies")
    copies = []
    for s in scenarios:
        groups = B.copy_groups(s.bytes_moved // 2, dev)
        copies.append([(B.capture(g, dev), len(g)) for g in groups])  # each Replay keeps its tensors alive
    flat = [r for _, rep in replays for r in rep] + [r for c in copies for r in c]
    owner = [entry["cand"] for entry, rep in replays for _ in rep] + [None] * sum(len(c) for c in copies)

    def before(j: int) -> None:  # the event log names the replay in flight, should the process die in it
        events(event="begin", cand=owner[j], stage="time")
        if owner[j] is not None:
            _fault(inject, owner[j], "time")

    try:
        times = B.time_replays(flat, dev, reps, before=before) if flat else []
    except B.ReplayError as e:
        if not B.context_ok(dev):
            crash(owner[e.index], "time", e)
        raise
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
    return entries


def child_main(args) -> None:
    """``--child OP N``: one op and size, its results as the ``done`` event of ``--events``."""
    op, n = args.child[0], int(args.child[1])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = args.reps or (20 if dev.type == "cuda" else 1)
    t0 = args.t0 or time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    events = _Events(args.events)
    skip = set(args.exclude or ())
    if args.candidates:
        skip |= set(range(len(CANDIDATES[op]))) - set(args.candidates)
    entries = sweep_one(op, n, dev, reps, log, skip=skip, events=events, inject=args.inject_fault)
    events(event="done", entries=entries)


# ----------------------------------------------------------------------------------------- parent: every op and size
def _read_events(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by the child's death
                break
    return out


def sweep_isolated(op: str, n: int, args, t_start: float, log) -> tuple[list[dict], list[str]]:
    """:func:`sweep_one` in child processes: re-run without the candidate a dead child was running.

    Returns every candidate's entry (in :data:`CANDIDATES` order; failed and lost ones with their ``error``) and
    notes on what was lost."""
    count = len(CANDIDATES[op])
    wanted = set(args.candidates) if args.candidates else set(range(count))
    dropped: dict[int, str] = {}  # candidate -> why: a non-fatal failure of an earlier child, or the crash
    notes: list[str] = []
    done = None
    for _ in range(MAX_CRASHES + 1):
        left = args.deadline_s - (time.time() - t_start)
        if left < 5:
            notes.append(f"{op}@{label(n)}: stopped at the {args.deadline_s:.0f}s deadline")
            break
        with tempfile.TemporaryDirectory() as tmp:
            ev_path = Path(tmp) / "events.jsonl"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", op, str(n), "--events", str(ev_path),
                   "--t0", repr(t_start), "--reps", str(args.reps)]  # fmt: skip
            skip = sorted(set(dropped) | (set(range(count)) - wanted))
            if skip:
                cmd += ["--exclude", *map(str, skip)]
            if args.inject_fault:
                cmd += ["--inject-fault", args.inject_fault]
            try:
                rc = subprocess.run(cmd, timeout=left, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = None
            events = _read_events(ev_path)
        for e in events:
            if e["event"] == "failed":
                dropped[e["cand"]] = e["error"]
        done = next((e for e in events if e["event"] == "done"), None)
        if done is not None:  # every result is in (whatever the exit status)
            break
        if rc is None:
            notes.append(f"{op}@{label(n)}: the child passed the {args.deadline_s:.0f}s deadline and was stopped")
            break
        last = next((e for e in reversed(events) if e["event"] in ("crash", "begin")), None)
        culprit = None if last is None else last.get("cand")
        if culprit is None:
            stage = "building the inputs" if last is None else last.get("stage")
            notes.append(f"{op}@{label(n)}: the child died (exit {rc}) while {stage}, not in a candidate; size lost")
            break
        why = last.get("error") or f"the process died (exit {rc})"
        dropped[culprit] = f"crashed the process ({last.get('stage')}): {why}"
        notes.append(
            f"{op}@{label(n)}: candidate {culprit} {CANDIDATES[op][culprit]} {dropped[culprit]}; rerun without it"
        )
        log(f"{op} {label(n)}: candidate {culprit} crashed the child ({why}); running the others again")
    else:
        notes.append(f"{op}@{label(n)}: {MAX_CRASHES + 1} children died; size given up")
    by_cand = {e["cand"]: e for e in (done["entries"] if done else [])}
    entries = []
    size = next((e["size"] for e in by_cand.values()), None)
    for i in sorted(wanted):
        if i in by_cand:
            entries.append(by_cand[i])
        else:
            why = dropped.get(i, "not run (the child did not finish)")
            entries.append({"op": op, "tokens": n, "size": size, "config": full(op, CANDIDATES[op][i]),
                            "error": why, "cand": i})  # fmt: skip
    return entries, notes


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


def _write(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"tune_ops on {doc['device']}, {doc['date']}\n\n" + render_markdown(doc["results"]) + "\n"
    )


def run_sweep(args) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = args.tokens or ([65536, 262144, 1048576] if dev.type == "cuda" else [70])
    args.reps = args.reps or (20 if dev.type == "cuda" else 1)
    ops = args.ops or ORDER
    unknown = sorted(set(ops) - set(CANDIDATES))
    if unknown:
        raise SystemExit(f"--ops must name ops of {ORDER}, got {unknown}")
    if args.candidates and len(ops) != 1:
        raise SystemExit(f"--candidates picks candidates of one op, got --ops {ops}")
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    log(f"tune_ops on {name}: ops {ops}, tokens {tokens}, {sum(len(CANDIDATES[o]) for o in ops)} candidates")
    results, tuned, skipped, notes = [], {}, [], []
    out = Path(args.out or (Path(os.environ.get("OUT", ".")) / "tuned.json"))
    doc = {
        "device": name,
        "torch": torch.__version__,
        "triton": B._triton_version(),
        "date": datetime.date.today().isoformat(),
        "commit": B._commit(),
        "tokens": tokens,
        "tuned": tuned,
        "skipped": skipped,
        "notes": notes,
        "results": results,
    }
    for op in ops:
        for n in tokens:
            if time.time() - t_start > args.budget_s:
                skipped.append(f"{op}@{label(n)}")
                log(f"{op} {label(n)}: skipped (past the {args.budget_s:.0f}s budget)")
                continue
            log(f"{op} {label(n)}: {len(args.candidates or CANDIDATES[op])} candidates")
            entries, lost = sweep_isolated(op, n, args, t_start, log)
            results += entries
            notes += lost
            ok = [e for e in entries if not e["error"]]
            if not ok:
                log(f"{op} {label(n)}: no candidate passed")
            else:
                best = max(ok, key=lambda e: e["score"])
                tuned.setdefault(op, {})[str(best["size"])] = best["config"]
                shares = ", ".join(f"{r['op']} {100 * r['share']:.1f}%" for r in best["scenarios"])
                log(f"{op} {label(n)}: best {best['config']} score {best['score']:.3f} ({shares})")
            _write(out, doc)
    _write(out, doc)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    print("\nSummary (winner per op and size; score = min over scenarios of share of same-size copy / target):")
    for op in ops:
        for n in tokens:
            mine = [e for e in results if e["op"] == op and e["tokens"] == n]
            ok = [e for e in mine if not e["error"]]
            if not ok:
                print(f"  {op:28s} {label(n):>5s}: {'skipped' if f'{op}@{label(n)}' in skipped else 'none passed'}")
            else:
                best = max(ok, key=lambda e: e["score"])
                shares = ", ".join(
                    f"{r['op'].removeprefix(op).strip() or op} {100 * r['share']:.0f}%"
                    f"{'' if r['share'] >= r['target'] else ' (miss)'}"
                    for r in best["scenarios"]
                )
                fails = len(mine) - len(ok)
                print(f"  {op:28s} {label(n):>5s}: {shares}; {best['config']}" + (f"; {fails} failed" if fails else ""))
            for e in mine:
                if e["error"]:
                    print(f"      failed {CANDIDATES[op][e['cand']]}: {e['error']}")
    for note in notes:
        print(f"  note: {note}")
    return doc


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
    ap.add_argument("--candidates", type=int, nargs="*", help="only these candidate indices (one op)")
    ap.add_argument("--reps", type=int, default=0, help="timed replays per candidate (default 20)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no op and size past this many seconds")
    ap.add_argument("--deadline-s", type=float, default=530.0, help="stop a child still running at this time")
    ap.add_argument("--write-table", metavar="JSON", help="rewrite ops/_tuned.py's TUNED block from a sweep's JSON")
    ap.add_argument("--child", nargs=2, metavar=("OP", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--events", help=argparse.SUPPRESS)
    ap.add_argument("--exclude", type=int, nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--inject-fault", metavar="CAND:STAGE,...", help=argparse.SUPPRESS)  # tests: a child dies there
    args = ap.parse_args()
    if args.write_table:
        print(write_table(args.write_table))
        print(f"wrote {TABLE}")
        return
    if args.child:
        child_main(args)
        return
    run_sweep(args)


if __name__ == "__main__":
    main()
