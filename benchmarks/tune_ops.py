"""Sweep the launch configurations of the ``dtkv.ops`` Triton kernels on one GPU; keep the best per op and size.

    python benchmarks/tune_ops.py --out $OUT/tuned.json          # the sweep (one H200: about 2 minutes)
    python benchmarks/tune_ops.py --ops remap --tokens 1048576   # some ops and sizes (--op-tokens: per op)
    python benchmarks/tune_ops.py --write-table $OUT/tuned.json  # merge its winners into ops/_tuned.py

The method is ``benchmarks/bench_ops.py``'s, on its scenarios: for each op of ``ops/_tuned.py`` and each token count
(64K, 256K, 1M) the inputs are built once; every candidate configuration (:data:`CANDIDATES`) is then checked
bitwise against the torch backend on every input set it will be timed on (a candidate that fails or does not
compile is reported and dropped, with the compiler's whole message, innermost cause first, in the log, the JSON and
the markdown), its calls are captured as CUDA graphs over the rotating input sets, and all candidates of that op and
size are replayed interleaved with the same-size copies of every scenario (median of ``--reps``), each replay
synchronized and checked on its own.

The sweep runs in a child process that takes each op and size in turn (the process start and the CUDA context are
paid once). A candidate that takes the CUDA context down (an illegal memory access poisons it for the whole
process) costs only that child: the parent learns from the child's event log which candidate was running, of which
op and size (the one being checked, captured or replayed), records it as failed, and runs a child again for what
is not finished, without it (at most :data:`MAX_CRASHES` times per op and size).

A candidate's score is the smallest, over the op's scenarios, of its share of the same-size copy divided by the
scenario's target (0.90, or 0.75 for the row-interleaved owner filter), so one configuration serves every scenario
of an op (token order and round-robin rows for the owner filter; fp8 and bf16 rows for the direct write). The
winner per (op, size) goes to the JSON's ``tuned`` map, which ``--write-table`` merges into ``ops/_tuned.py`` (the
entries of other ops and sizes stay); every candidate's numbers go to the JSON and to a markdown table beside it
(what a child finished is kept when a later one dies or the deadline stops it). ``--budget-s`` starts no op or size
past that many seconds (the rest keep their current configuration) and ``--deadline-s`` stops a child still running
then. Runs on a CPU too, under ``TRITON_INTERPRET=1`` with ``--tokens 70 --ops remap``-like sizes (a dry run of the
checks, no timing value).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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


_PACK_PAGES = [
    {"rows": 1, "parts": 2, "chunk_w": 4096, "num_warps": 8},
    {"rows": 1, "parts": 2, "chunk_w": 4096, "num_warps": 4},
    {"rows": 1, "parts": 1, "chunk_w": 4096, "num_warps": 8},
    {"rows": 1, "parts": 4, "chunk_w": 4096, "num_warps": 4},
    {"rows": 1, "parts": 4, "chunk_w": 4096, "num_warps": 8},
    {"rows": 2, "parts": 2, "chunk_w": 4096, "num_warps": 8},
]
"""The page-pack candidates: pages (rows) and parts of a page per program, words per chunk, warps."""


# Candidates per op (each completed from DEFAULTS, so every one is a full configuration). The first H200 sweep
# (benchmarks/results/tune_ops_h200_2026-12-01.md) showed, for the row copies: fewer words per thread is faster at
# the same bytes per program (direct fp8: 2.6 words/thread 86%, 5 words 82%, 10 words 81%, 20 words 78%, 41
# words 73%); one wide masked chunk per row beats three (64 + 16 + 2 words) at the same registers; registers past
# ~40 cost occupancy (compiled offline: benchmarks/compile_ops.py --sass). The compacting owner filter lost every
# size to the plain tile (78-80% in token order): 80-127 registers for its [block_r, window] search, and its
# window loop copied a page's run in serial steps; it is replaced by the "window" kernel (kept rows found from
# [window] vectors alone, 40 registers, one program per tile of a window side by side). These lists hold each
# op's winner of that sweep (the control) and the configurations those trends point to.
CANDIDATES: dict[str, list[dict]] = {
    # owner filter, 656-byte rows (82 words), token order (runs of 64 rows) and round robin (every 4th row kept)
    "write_owned": [
        {"variant": "tile", "layout": "rows", "block_r": 16, "chunk_w": 128, "num_warps": 4},  # 2026-12-01 winner
        {"variant": "tile", "layout": "flat", "block_r": 16, "chunk_w": 1024, "num_warps": 4},
        {"variant": "tile", "layout": "flat", "block_r": 8, "chunk_w": 512, "num_warps": 4},
        {"variant": "window", "layout": "rows", "window": 64, "block_r": 16, "chunk_w": 128, "num_warps": 4},
        {"variant": "window", "layout": "flat", "window": 64, "block_r": 16, "chunk_w": 1024, "num_warps": 4},
        {"variant": "window", "layout": "flat", "window": 64, "block_r": 16, "chunk_w": 1024, "num_warps": 8},
        {"variant": "window", "layout": "rows", "window": 32, "block_r": 8, "chunk_w": 128, "num_warps": 4},
        {"variant": "window", "layout": "flat", "window": 32, "block_r": 8, "chunk_w": 512, "num_warps": 4},
    ],
    # direct write, 656-byte (82 words) and 1152-byte (144 words) rows; flat tiles of 8 rows: 656 words in chunks
    # 512 + 128 + 16 (every lane busy) at 2.6 words per thread with 8 warps
    "direct_write": [
        {"layout": "rows", "block_r": 8, "chunk_w": 0, "num_warps": 4},  # 2026-12-01 winner
        {"layout": "rows", "block_r": 8, "chunk_w": 128, "num_warps": 8},
        {"layout": "rows", "block_r": 4, "chunk_w": 0, "num_warps": 4},
        {"layout": "flat", "block_r": 4, "chunk_w": 512, "num_warps": 4},
        {"layout": "flat", "block_r": 8, "chunk_w": 512, "num_warps": 4},
        {"layout": "flat", "block_r": 8, "chunk_w": 512, "num_warps": 8},
        {"layout": "flat", "block_r": 16, "chunk_w": 1024, "num_warps": 8},
        {"layout": "flat", "block_r": 16, "chunk_w": 1024, "num_warps": 4},
    ],
    # [block_r, 4, 128] bf16 tiles of 1152-byte rows: smaller tiles and fewer warps won (2 rows / 2 warps: 88%,
    # 4 / 4: 85%, 8 rows: 79-81%, 16 rows: 60%); one row per program, and 1 warp, are the next steps
    "quantize_write_mla_fp8": [
        {"block_r": 2, "num_warps": 2},  # 2026-12-01 winner
        {"block_r": 1, "num_warps": 1},
        {"block_r": 1, "num_warps": 2},
        {"block_r": 2, "num_warps": 1},
        {"block_r": 4, "num_warps": 2},
        {"block_r": 4, "num_warps": 4},
    ],
    # [block_r, 128] bf16 tiles: 8 to 64 keys of 256 bytes per program (met its target at every size)
    "quantize_write_indexer_fp8": _grid(block_r=[8, 16, 32, 64], num_warps=[2, 4, 8]),
    # 41 984-byte pages (5248 words), never timed (none compiled on Triton 3.6 before the fix): halves of a page
    # per program (the default; main's kernel, two 4096-word blocks per page, reached 90-93%), whole pages, quarters
    "pack_owned_pages": _PACK_PAGES,
    # the same for a layer's two layouts (5248 and 1056 words per page) in one launch
    "pack_layer_pages": _PACK_PAGES,
    # int32 top-k at 1M tokens (64M indices, a 256 KiB int32 map: the 2-byte copy is what keeps it in L1): 8
    # indices per thread won at every block size (1024/4 warps 89.9%, 2048/8 89%, 4096/8 at 16 per thread 63%)
    "remap": [
        {"block": 1024, "num_warps": 4, "map16": "always", "idx_cg": 0},  # 2026-12-01 winner at 1M
        {"block": 512, "num_warps": 2, "map16": "always", "idx_cg": 0},
        {"block": 2048, "num_warps": 8, "map16": "always", "idx_cg": 0},
        {"block": 4096, "num_warps": 16, "map16": "always", "idx_cg": 0},
        {"block": 1024, "num_warps": 4, "map16": "always", "idx_cg": 1},
    ],
    # fp8 rows (656 bytes) to bf16 rows (1152 bytes): [block_r, 4, 128] tiles of codes, 16 to 64 values a thread
    "dequantize_mla_rows": _grid(block_r=[2, 4, 8, 16], num_warps=[2, 4, 8]),
    # 64-dim bf16 rope rows (128 bytes read, 128 written): 8 to 64 rows a program
    "rope_interleave_into": _grid(block_r=[8, 16, 32, 64], num_warps=[2, 4, 8]),
}
ORDER = [
    "write_owned",
    "remap",
    "direct_write",
    "quantize_write_mla_fp8",
    "pack_owned_pages",
    "quantize_write_indexer_fp8",
    "pack_layer_pages",
    "dequantize_mla_rows",
    "rope_interleave_into",
]
"""Sweep order: the rows furthest from their targets first (a budget cut leaves the others as they are)."""


def full(op: str, cand: dict) -> dict:
    return {**_tuned.DEFAULTS[op], **cand}


def label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _tail(text: str, last: int = 40) -> str:
    """The last ``last`` lines of an error text, indented for the log."""
    return "\n".join("        " + t for t in text.splitlines()[-last:])


# ----------------------------------------------------------------------------------------- child: one op, its sizes
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
    ends a child) when candidate ``K`` reaches ``STAGE`` (``check`` or ``time``), at every size; ``K:raise`` makes
    its check raise a chained error, as a kernel that does not compile does (the cause inside a called function)."""
    if not inject:
        return
    if f"{cand}:{stage}" in inject.split(","):
        os._exit(86)
    if stage == "check" and f"{cand}:raise" in inject.split(","):
        try:
            raise AssertionError("Mismatched type for m between then block and else block (injected)")
        except AssertionError as e:
            raise RuntimeError("at 34:8: the call site (injected)") from e


def sweep_one(op: str, n: int, dev: torch.device, reps: int, log, *, skip=(), events=None, inject=None) -> list[dict]:
    """Every candidate of ``op`` at ``n`` tokens but those in ``skip``: checked on every input set, captured, timed
    with the same-size copies. ``events`` (a :class:`_Events`) hears of each step; when the CUDA context is lost
    the event names the candidate and the process exits with :data:`CRASH_EXIT`. A candidate that fails keeps its
    error as one line (``error``) and in full, innermost cause first (``error_detail``: a Triton compile error's
    own message, with the line of the kernel or helper it points at)."""
    events = events or _Events(None)

    def crash(cand, stage: str, e: BaseException) -> None:
        events(event="crash", tokens=n, cand=cand, stage=stage, error=B.error_summary(e), detail=B.error_text(e))
        log(f"    CUDA context lost at candidate {cand} ({stage}): {B.error_summary(e)}\n{_tail(B.error_text(e))}")
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
        events(event="begin", tokens=n, cand=i, stage="check")
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
            entry["error"], entry["error_detail"] = B.error_summary(e), B.error_text(e)
            events(event="failed", tokens=n, cand=i, error=entry["error"], detail=entry["error_detail"])
            log(f"    {i + 1}/{count} {cand}: FAILED {entry['error']}\n{_tail(entry['error_detail'])}")
            entries.append(entry)
            continue
        log(f"    {i + 1}/{count} {cand}: checked on every input set and captured in {time.perf_counter() - t0:.1f}s")
        entries.append(entry)
        replays.append((entry, rep))
    events(event="begin", tokens=n, cand=None, stage="copies")
    copies = []
    for s in scenarios:
        groups = B.copy_groups(s.bytes_moved // 2, dev)
        copies.append([(B.capture(g, dev), len(g)) for g in groups])  # each Replay keeps its tensors alive
    flat = [r for _, rep in replays for r in rep] + [r for c in copies for r in c]
    owner = [entry["cand"] for entry, rep in replays for _ in rep] + [None] * sum(len(c) for c in copies)

    def before(j: int) -> None:  # the event log names the replay in flight, should the process die in it
        events(event="begin", tokens=n, cand=owner[j], stage="time")
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


def _skips(specs) -> dict[tuple[str, int], set[int]]:
    """``--exclude OP:N:K ...`` as ``{(OP, N): {K, ...}}`` (candidate ``K`` of ``OP`` at ``N`` tokens)."""
    out: dict[tuple[str, int], set[int]] = {}
    for spec in specs or ():
        op, n, k = spec.split(":")
        out.setdefault((op, int(n)), set()).add(int(k))
    return out


def _plan_arg(plan: list[tuple[str, int]]) -> str:
    return ";".join(f"{op}={n}" for op, n in plan)


def _parse_plan(text: str) -> list[tuple[str, int]]:
    return [(op, int(n)) for op, n in (item.split("=") for item in text.split(";"))]


def child_main(args) -> None:
    """``--child "OP=N;OP=N;..."``: each op and size of the plan in turn, each one's results as a ``done`` event of
    ``--events`` (one started past ``--budget-s`` is a ``skipped`` event)."""
    plan = _parse_plan(args.child)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = args.reps or (20 if dev.type == "cuda" else 1)
    t0 = args.t0 or time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    events = _Events(args.events)
    skips = _skips(args.exclude)
    for op, n in plan:
        if time.time() - t0 > args.budget_s:
            events(event="skipped", op=op, tokens=n)
            continue
        count = len(CANDIDATES[op])
        wanted = set(args.candidates) if args.candidates else set(range(count))
        skip = skips.get((op, n), set()) | (set(range(count)) - wanted)
        log(f"{op} {label(n)}: {count - len(skip)} candidates")
        entries = sweep_one(op, n, dev, reps, log, skip=skip, events=_Tagged(events, op), inject=args.inject_fault)
        events(event="done", op=op, tokens=n, entries=entries)
        if dev.type == "cuda":  # the next inputs (1M tokens: GBs) start from an empty cache
            torch.cuda.empty_cache()


class _Tagged:
    """An event log that adds ``op`` to every event (``sweep_one`` names the size and the candidate)."""

    def __init__(self, events: _Events, op: str) -> None:
        self.events, self.op = events, op

    def __call__(self, **event) -> None:
        self.events(op=self.op, **event)


# ----------------------------------------------------------------------------------------- parent
def _read_events(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by the child's death
                break
    return out


def sweep_isolated(plan: list[tuple[str, int]], args, t_start: float, log):
    """:func:`sweep_one` for every ``(op, tokens)`` of ``plan``, in a child process that runs them in turn (the
    process start and the CUDA context are paid once): a child that dies is run again for what it did not finish,
    without the candidate it was running.

    Returns ``(entries, skipped, notes)``: per ``(op, tokens)`` that ran, every candidate's entry in
    :data:`CANDIDATES` order (failed and lost ones with their ``error``); the ``(op, tokens)`` past the budget;
    what was lost."""
    dropped: dict[tuple[str, int, int], dict] = {}  # (op, size, candidate) -> its error: failed earlier, or crashed
    done: dict[tuple[str, int], list[dict]] = {}
    skipped: list[tuple[str, int]] = []
    lost: dict[tuple[str, int], str] = {}
    notes: list[str] = []

    def name(key) -> str:
        return f"{key[0]}@{label(key[1])}"

    for _ in range(1 + MAX_CRASHES * len(plan)):
        left_plan = [k for k in plan if k not in done and k not in lost and k not in skipped]
        if not left_plan:
            break
        left = args.deadline_s - (time.time() - t_start)
        if left < 5:
            notes += [f"{name(k)}: stopped at the {args.deadline_s:.0f}s deadline" for k in left_plan]
            break
        with tempfile.TemporaryDirectory() as tmp:
            ev_path = Path(tmp) / "events.jsonl"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", _plan_arg(left_plan),
                   "--events", str(ev_path), "--t0", repr(t_start), "--reps", str(args.reps),
                   "--budget-s", repr(args.budget_s)]  # fmt: skip
            if args.candidates:
                cmd += ["--candidates", *map(str, args.candidates)]
            excl = sorted(f"{op}:{n}:{k}" for op, n, k in dropped if (op, n) in left_plan)
            if excl:
                cmd += ["--exclude", *excl]
            if args.inject_fault:
                cmd += ["--inject-fault", args.inject_fault]
            try:
                rc = subprocess.run(cmd, timeout=left, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = None
            events = _read_events(ev_path)
        for e in events:
            key = (e.get("op"), e.get("tokens"))
            if e["event"] == "failed":
                dropped[(*key, e["cand"])] = {"error": e["error"], "error_detail": e.get("detail")}
            elif e["event"] == "done":
                done[key] = e["entries"]
            elif e["event"] == "skipped":
                skipped.append(key)
        unfinished = [k for k in left_plan if k not in done and k not in skipped]
        if not unfinished:  # every result is in (whatever the exit status)
            break
        if rc is None:
            notes += [f"{name(k)}: the child passed the {args.deadline_s:.0f}s deadline and was stopped"
                      for k in unfinished]  # fmt: skip
            break
        last = next((e for e in reversed(events) if e["event"] in ("crash", "begin")), None)
        culprit = None if last is None else last.get("cand")
        if culprit is None:
            key = unfinished[0] if last is None else (last["op"], last["tokens"])
            stage = "building the inputs" if last is None else last.get("stage")
            lost[key] = f"the child died (exit {rc}) while {stage}, not in a candidate; size lost"
            notes.append(f"{name(key)}: {lost[key]}")
            continue
        key = (last["op"], last["tokens"])
        why = last.get("error") or f"the process died (exit {rc})"
        dropped[(*key, culprit)] = {"error": f"crashed the process ({last.get('stage')}): {why}",
                                    "error_detail": last.get("detail")}  # fmt: skip
        notes.append(f"{name(key)}: candidate {culprit} {CANDIDATES[key[0]][culprit]} "
                     f"{dropped[(*key, culprit)]['error']}; rerun without it")  # fmt: skip
        log(f"{name(key)}: candidate {culprit} crashed the child ({why}); running the rest again")
    else:
        notes += [f"{name(k)}: {1 + MAX_CRASHES * len(plan)} children died; given up"
                  for k in plan if k not in done and k not in skipped and k not in lost]  # fmt: skip
    out: dict[tuple[str, int], list[dict]] = {}
    for key in plan:
        if key in skipped or key in lost:
            continue
        op, n = key
        by_cand = {e["cand"]: e for e in done.get(key, [])}
        size = next((e["size"] for e in by_cand.values()), None)
        entries = []
        for i in sorted(set(args.candidates) if args.candidates else range(len(CANDIDATES[op]))):
            if i in by_cand:
                entries.append(by_cand[i])
            else:
                why = dropped.get((op, n, i), {"error": "not run (the child did not finish)", "error_detail": None})
                entries.append({"op": op, "tokens": n, "size": size, "config": full(op, CANDIDATES[op][i]),
                                "cand": i, **why})  # fmt: skip
        out[key] = entries
    return out, skipped, notes


def render_markdown(results: list[dict]) -> str:
    lines = ["| op | tokens | config | score | scenarios (us, % of same-size copy) |", "|---|---:|---|---:|---|"]
    for e in results:
        cfg = ", ".join(f"{k}={v}" for k, v in e["config"].items())
        if e["error"]:
            lines.append(f"| {e['op']} | {e['tokens']} | {cfg} | failed | {e['error'].replace('|', '/')} |")
            continue
        scen = "; ".join(f"{r['op']}: {r['us']:.1f} us, {100 * r['share']:.1f}%" for r in e.get("scenarios", []))
        lines.append(f"| {e['op']} | {e['tokens']} | {cfg} | {e.get('score', float('nan')):.3f} | {scen} |")
    details = [e for e in results if e["error"] and e.get("error_detail")]
    if details:
        lines += ["", "Errors of the failed candidates (innermost cause first):"]
        for e in details:
            lines += ["", f"{e['op']} at {e['tokens']} tokens, candidate {e['cand']}:", "```",
                      *e["error_detail"].splitlines()[-40:], "```"]  # fmt: skip
    return "\n".join(lines)


def _write(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"tune_ops on {doc['device']}, {doc['date']}\n\n" + render_markdown(doc["results"]) + "\n"
    )


def _op_tokens(specs, ops: list[str]) -> dict[str, list[int]]:
    """``--op-tokens OP=N[,N...]`` as ``{op: sizes}``."""
    out = {}
    for spec in specs or ():
        op, _, sizes = spec.partition("=")
        if op not in ops or not sizes:
            raise SystemExit(f"--op-tokens takes OP=N[,N...] for an op of --ops {ops}, got {spec!r}")
        out[op] = [int(x) for x in sizes.split(",")]
    return out


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
    sizes_of = {op: _op_tokens(args.op_tokens, ops).get(op, tokens) for op in ops}
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    total = sum(len(args.candidates or CANDIDATES[o]) * len(sizes_of[o]) for o in ops)
    log(f"tune_ops on {name}: {', '.join(f'{o} {[label(n) for n in sizes_of[o]]}' for o in ops)}; {total} runs")
    results, tuned, skipped, notes = [], {}, [], []
    out = Path(args.out or (Path(os.environ.get("OUT", ".")) / "tuned.json"))
    doc = {
        "device": name,
        "torch": torch.__version__,
        "triton": B._triton_version(),
        "date": datetime.date.today().isoformat(),
        "commit": B._commit(),
        "tokens": tokens,
        "sizes": {op: sizes_of[op] for op in ops},
        "tuned": tuned,
        "skipped": skipped,
        "notes": notes,
        "results": results,
    }
    plan = [(op, n) for op in ops for n in sizes_of[op]]
    by_key, late, lost = sweep_isolated(plan, args, t_start, log)
    skipped += [f"{op}@{label(n)}" for op, n in late]
    notes += lost
    for op, n in plan:
        entries = by_key.get((op, n))
        if entries is None:
            continue
        results.extend(entries)
        ok = [e for e in entries if not e["error"]]
        if not ok:
            log(f"{op} {label(n)}: no candidate passed")
            continue
        best = max(ok, key=lambda e: e["score"])
        tuned.setdefault(op, {})[str(best["size"])] = best["config"]
        shares = ", ".join(f"{r['op']} {100 * r['share']:.1f}%" for r in best["scenarios"])
        log(f"{op} {label(n)}: best {best['config']} score {best['score']:.3f} ({shares})")
    _write(out, doc)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    print("\nSummary (winner per op and size; score = min over scenarios of share of same-size copy / target):")
    for op in ops:
        for n in sizes_of[op]:
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
                    if e.get("error_detail"):
                        print(_tail(e["error_detail"], 12))
    for note in notes:
        print(f"  note: {note}")
    return doc


# ----------------------------------------------------------------------------------------- table writer
def _value(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(int(v))


def origin_of(doc: dict) -> str:
    """Where a sweep's JSON was measured: device, versions, date, commit, and the ops it tuned."""
    get = {k: doc.get(k, "?") for k in ("device", "torch", "triton", "date", "commit")}
    where = f"{get['device']}, torch {get['torch']}, triton {get['triton']}, {get['date']} (dtkv {get['commit']})"
    return f"{where}: {', '.join(sorted(doc.get('tuned', {})))}"


def merged_table(doc: dict, current: dict[str, dict[int, dict]], current_on: str) -> tuple[dict, str]:
    """``(TUNED, TUNED_ON)`` after a sweep: its winners replace the entries of the same op and size, every other
    entry of ``current`` stays (a sweep of some ops and sizes leaves the rest of the table as it was). Every entry
    is validated against ``DEFAULTS``: a key the table no longer knows is refused by name."""
    tuned = {op: dict(entries) for op, entries in current.items()}
    for op, entries in doc.get("tuned", {}).items():
        if op not in _tuned.DEFAULTS:
            raise ValueError(f"tuned op {op!r} is not an op of ops/_tuned.py ({sorted(_tuned.DEFAULTS)})")
        for size, cfg in entries.items():
            tuned.setdefault(op, {})[int(size)] = dict(cfg)
    for op, entries in tuned.items():
        if op not in _tuned.DEFAULTS:
            raise ValueError(f"tuned op {op!r} is not an op of ops/_tuned.py ({sorted(_tuned.DEFAULTS)})")
        for size, cfg in entries.items():
            bad = sorted(set(cfg) - set(_tuned.DEFAULTS[op]))
            if bad:
                raise ValueError(f"tuned config of {op!r} at {size} has unknown keys {bad}")
    origins = [o for o in current_on.split("; ") if o] if current else []
    new = origin_of(doc)
    if doc.get("tuned") and new not in origins:
        origins.append(new)
    return tuned, "; ".join(origins)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` cut at spaces into pieces of at most ``width`` characters (their concatenation is ``text``)."""
    parts, cur = [], ""
    for word in text.split(" "):
        piece = word if not cur else " " + word
        if cur and len(cur) + len(piece) > width:
            parts.append(cur + " ")
            cur = word
        else:
            cur += piece
    return [*parts, cur]


def render_table(tuned: dict[str, dict[int, dict]], tuned_on: str) -> str:
    """The TUNED block of ``ops/_tuned.py`` for a table (see :func:`merged_table`)."""
    lines = [
        f"{BEGIN}: written by `python benchmarks/tune_ops.py --write-table <json>`; do not edit by hand",
        "# fmt: off",
        "TUNED_ON = (",
        *(f"    {json.dumps(part)}" for part in _wrap(tuned_on, 100)),
        ")",
        "TUNED: dict[str, dict[int, Config]] = {",
    ]
    for op in sorted(tuned):
        lines.append(f"    {json.dumps(op)}: {{")
        for size in sorted(tuned[op]):
            items = [f"{json.dumps(k)}: {_value(v)}" for k, v in tuned[op][size].items()]
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


def _load_table(table: Path):
    spec = importlib.util.spec_from_file_location("_tuned_table", table)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_table(json_path: str, table: Path = TABLE) -> str:
    """Merge a sweep's winners into the TUNED block of ``table`` (``ops/_tuned.py``); returns the new block. The
    file is left untouched when the JSON names an op or a key the table does not know."""
    doc = json.loads(Path(json_path).read_text())
    current = _load_table(table)
    tuned, tuned_on = merged_table(doc, current.TUNED, current.TUNED_ON)
    block = render_table(tuned, tuned_on)
    text = table.read_text()
    i, j = text.index(BEGIN), text.index(END)
    table.write_text(text[:i] + block + text[j + len(END) :])
    return block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON of the sweep (default $OUT/tuned.json, else ./tuned.json)")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default 64K 256K 1M)")
    ap.add_argument("--op-tokens", nargs="*", metavar="OP=N[,N]", help="other token counts for some ops")
    ap.add_argument("--ops", nargs="*", help=f"ops to sweep (default all, in this order: {ORDER})")
    ap.add_argument("--candidates", type=int, nargs="*", help="only these candidate indices (one op)")
    ap.add_argument("--reps", type=int, default=0, help="timed replays per candidate (default 20)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no op or size past this many seconds")
    ap.add_argument("--deadline-s", type=float, default=530.0, help="stop a child still running at this time")
    ap.add_argument("--write-table", metavar="JSON", help="merge a sweep's winners into ops/_tuned.py's TUNED block")
    ap.add_argument("--child", metavar="OP=N;OP=N", help=argparse.SUPPRESS)
    ap.add_argument("--events", help=argparse.SUPPRESS)
    ap.add_argument("--exclude", nargs="*", help=argparse.SUPPRESS)  # OP:SIZE:CANDIDATE of the --child plan
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
