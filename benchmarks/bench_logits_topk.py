"""The extend indexer's selection alone: ``dtkv::logits_topk`` against the packed-key path it replaces and
``torch.topk``; ``dtkv::quantize_indexer_queries`` against its torch reference.

GPU, one H200 (about a minute)::

    python benchmarks/bench_logits_topk.py --out-dir $OUT            # add --sweep to time launch candidates

CPU smoke (tiny shapes; with ``TRITON_INTERPRET=1`` the kernels under the interpreter; what
``tests/test_bench_logits_topk.py`` runs)::

    TRITON_INTERPRET=1 python benchmarks/bench_logits_topk.py --smoke --out-dir /tmp/x

Case ``tokens x context`` (``--cases``; default 8192 tokens at 8K, 32K, 64K and 128K -- a prefill chunk of 8192
at each point of a 128K prompt -- and 16 tokens at 32K): ``bench_indexer_logits.make_case``'s inputs (one request
whose last ``tokens`` positions are the queries, DeepSeek-V3.2's indexer over shuffled fp8 pages), whose logits
come from :func:`dtkv.ops.indexer_logits`, once as float32 and once as packed keys (the same launch: the packed keys
are the float32 logits' selection keys). Rows (``phase: "topk"``), one per case and ``mode``:

- ``packed``: the path the runtime ran before: :func:`dtkv.ops.indexer_topk` of the packed keys (``torch.topk`` of
  int64) and the kept columns' slots;
- ``logits_topk``: :func:`dtkv.ops.logits_topk` of the float32 logits with the slots, as the runtime calls it
  (the logits are ``-inf`` outside each query's range already; ``bitwise``: the packed path's result exactly);
- ``logits_topk_exact``: the same on the kernel's exact path alone (``GROUP_CONFIG`` set so that no row is grouped:
  the path before the grouped bound; ``bitwise``);
- ``logits_topk_ranges``: the same with the queries' column ranges passed (the kernel path masks a copy first);
- ``keys_topk``: :func:`dtkv.ops.keys_topk` of the packed keys with the slots (decode's radix select over many
  programs a row, at prefill's rows; ``bitwise``: the packed path's result exactly);
- ``torch_f32``: ``torch.topk`` of the float32 logits, ``sorted=True`` (a speed reference: its ties are not the
  rule's);
- ``quantize`` / ``quantize_torch``: the queries' fp8 quantization, the kernel and its torch reference
  (``bitwise``);
- ``indexer_f32`` / ``indexer_packed``: the indexer kernel writing float32 logits / int64 keys.

Each row: ``tokens``, ``context``, ``ms`` (median of ``--reps`` CUDA-event timings after a warmup), ``gbps`` (the
top-k's logits read once; the quantization's bytes in and out), ``peak_mem_gb``, ``speedup`` (``logits_topk``: the
packed path's ms over its own), ``vs_exact`` (``logits_topk``: ``logits_topk_exact``'s ms over its own), ``group``
(the columns a group of the grouped bound, 0: exact), ``config`` (the kernel's launch and ``GROUP_CONFIG``). ``--sweep`` times :data:`CANDIDATES` at
:data:`SWEEP_CASES` (rows ``phase: "topk_sweep"``, each checked ``bitwise``).

Writes ``logits_topk_<hw>_<date>.jsonl`` and ``.md`` into ``--out-dir`` and prints a closing ``SUMMARY`` line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_indexer_logits as bil  # noqa: E402

from dtkv.ops import indexer_logits, indexer_topk, keys_topk, logits_topk, quantize_indexer_queries  # noqa: E402

_mod = sys.modules["dtkv.ops.logits_topk"]
_keys_mod = sys.modules["dtkv.ops.keys_topk"]
TOPK = 2048
CASES = [(8192, 8192), (8192, 32768), (8192, 65536), (8192, 131072), (16, 32768)]
SMOKE_CASES = [(5, 70), (33, 200)]
SMOKE_TOPK = 16
CANDIDATES = [
    {"block": 256, "num_warps": 2}, {"block": 512, "num_warps": 2}, {"block": 512, "num_warps": 4},
    {"block": 1024, "num_warps": 4}, {"block": 1024, "num_warps": 8}, {"block": 2048, "num_warps": 4},
    {"block": 4096, "num_warps": 8}, {"block": 1024, "num_warps": 4, "num_stages": 3},
    {"block": 1024, "num_warps": 4, "num_stages": 4}, {"block": 512, "num_warps": 4, "num_stages": 4},
]  # fmt: skip
"""Launches of ``--sweep`` (each over :data:`dtkv.ops.logits_topk.KERNEL_CONFIG`): columns a step of the kernel's
pass, warps and loads in flight (each a separate build: seconds of compilation)."""
SWEEP_CASES = [(8192, 32768), (8192, 131072)]
SMOKE_CANDIDATES = [{"block": 16}, {"block": 64, "num_warps": 2}]


def _case(tokens: int, context: int, device: torch.device, smoke: bool) -> dict:
    geom = {"heads": 4, "head_dim": 32, "page": 16} if smoke else {}
    c = bil.make_case(tokens, context, device, **geom)
    args = (c["q"], c["w"], c["pages"], c["slots"], c["start"], c["end"])
    backend = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    c["backend"] = backend
    c["logits"] = indexer_logits(*args, layout=c["lay"], backend=backend)
    c["keys"] = indexer_logits(*args, layout=c["lay"], backend=backend, packed=True)
    return c


def _packed(c: dict, k: int):
    def run():
        top, valid = indexer_topk(c["keys"], k)
        return torch.where(valid, c["slots"][top.clamp(min=0)], torch.full_like(top, -1))

    return run


def _new(c: dict, k: int, backend: str, ranges: bool = False):
    kw = {"key_start": c["start"], "key_end": c["end"]} if ranges else {}
    return lambda: logits_topk(c["logits"], k, key_slots=c["slots"], backend=backend, **kw)


def _exact(c: dict, k: int, backend: str):
    def run():
        before = dict(_mod.GROUP_CONFIG)
        _mod.GROUP_CONFIG["ratio"] = 2**62  # no row has that many groups
        try:
            return logits_topk(c["logits"], k, key_slots=c["slots"], backend=backend)
        finally:
            _mod.GROUP_CONFIG.update(before)

    return run


def _modes(c: dict, k: int, tokens: int, context: int, visible: int, device: torch.device) -> dict:
    """Mode -> (call, bytes it moves) of one case."""
    heads, dim = c["q"].shape[1:]
    gen = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(tokens, heads, dim, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(tokens, heads, generator=gen).to(device)
    qbytes = q.numel() * 3 + w.numel() * 8
    args = (c["q"], c["w"], c["pages"], c["slots"], c["start"], c["end"])
    return {
        "packed": (_packed(c, k), 8 * visible),
        "logits_topk_exact": (_exact(c, k, c["backend"]), 4 * visible),
        "logits_topk": (_new(c, k, c["backend"]), 4 * visible),
        "logits_topk_ranges": (_new(c, k, c["backend"], ranges=True), 4 * visible),
        "keys_topk": (lambda: keys_topk(c["keys"], k, key_slots=c["slots"], backend=c["backend"]), 8 * visible),
        "torch_f32": (lambda: torch.topk(c["logits"], min(k, context), dim=1, sorted=True), 4 * visible),
        "quantize": (lambda: quantize_indexer_queries(q, w, scale=0.1, backend=c["backend"]), qbytes),
        "quantize_torch": (lambda: quantize_indexer_queries(q, w, scale=0.1, backend="torch"), qbytes),
        "indexer_f32": (lambda: indexer_logits(*args, layout=c["lay"], backend=c["backend"]), 4 * tokens * context),
        "indexer_packed": (lambda: indexer_logits(*args, layout=c["lay"], backend=c["backend"], packed=True),
                           8 * tokens * context),
    }  # fmt: skip


def run_cases(cases, device: torch.device, *, reps: int, smoke: bool, log=print) -> list[dict]:
    rows, env = [], bil._env(device)
    k = SMOKE_TOPK if smoke else TOPK
    for tokens, context in cases:
        c = _case(tokens, context, device, smoke)
        visible = int((c["end"] - c["start"]).clamp(min=0).sum())
        base = {"phase": "topk", "tokens": tokens, "context": context, "k": k, "visible_keys": visible, **env}
        want = None
        modes = _modes(c, k, tokens, context, visible, device)
        results: dict[str, object] = {}
        for mode, (fn, nbytes) in modes.items():
            row = {**base, "mode": mode}
            try:
                ms, peak, out = bil.timed(fn, device, reps)
                row |= {"ms": ms, "peak_mem_gb": peak, "gbps": nbytes / (ms * 1e6), "ok": True}
                if mode in ("logits_topk", "logits_topk_exact", "logits_topk_ranges", "keys_topk"):
                    if mode == "keys_topk":
                        cfg = dict(_keys_mod.KERNEL_CONFIG)
                    else:
                        cfg = {**_mod.KERNEL_CONFIG, "group": dict(_mod.GROUP_CONFIG)}
                        grouped = mode == "logits_topk" and c["backend"] == "triton"
                        row["group"] = _mod.group_size(context, k, rows=tokens) if grouped else 0
                    row |= {"config": cfg, "bitwise": bool(torch.equal(out, results["packed"]))}
                    row["ok"] = row["bitwise"]
                    row["speedup"] = rows_ms(rows, tokens, context, "packed") / ms
                    if mode == "logits_topk":
                        row["vs_exact"] = rows_ms(rows, tokens, context, "logits_topk_exact") / ms
                if mode == "quantize":
                    want = out
                if mode == "quantize_torch" and want is not None:
                    row["bitwise"] = bool(all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                              for a, b in zip(out, want)))  # fmt: skip
                    row["ok"] = row["bitwise"]
                results[mode] = out if mode == "packed" else None
            except Exception as e:  # noqa: BLE001 - reported in the row
                row |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            log(_line(row))
        c = results = want = modes = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def rows_ms(rows: list[dict], tokens: int, context: int, mode: str) -> float:
    r = next(r for r in rows if (r["tokens"], r["context"], r.get("mode")) == (tokens, context, mode))
    return r["ms"]


def sweep(cases, device: torch.device, cands: list[dict], *, reps: int, smoke: bool, log=print) -> list[dict]:
    rows, env = [], bil._env(device)
    k = SMOKE_TOPK if smoke else TOPK
    for tokens, context in cases:
        c = _case(tokens, context, device, smoke)
        want = _packed(c, k)()
        for i, cand in enumerate(cands):
            cfg = {**_mod.KERNEL_CONFIG, **cand}
            row = {"phase": "topk_sweep", "tokens": tokens, "context": context, "candidate": i, "config": cfg, **env}
            before = dict(_mod.KERNEL_CONFIG)
            _mod.KERNEL_CONFIG.update(cfg)
            try:
                ms, _, out = bil.timed(_new(c, k, c["backend"]), device, reps)
                row |= {"ms": ms, "bitwise": bool(torch.equal(out, want)), "ok": True}
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run
                row |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                _mod.KERNEL_CONFIG.clear()
                _mod.KERNEL_CONFIG.update(before)
            rows.append(row)
            log(_line(row))
        c = want = None
    return rows


def _line(r: dict) -> str:
    head = f"{r['phase']:>10} {r['tokens']:>6} x {r['context']:>7} {r.get('mode', r.get('candidate', '')):>14}"
    if "error" in r:
        return f"{head}  error: {r['error']}"
    extra = "".join(f" {key}={r[key]}" for key in ("bitwise",) if key in r)
    speed = f" x{r['speedup']:.2f}" if "speedup" in r else ""
    speed += f" x{r['vs_exact']:.2f} vs exact (groups of {r['group']})" if "vs_exact" in r else ""
    cfg = f" {json.dumps(r['config'])}" if r["phase"] == "topk_sweep" else ""
    return f"{head} {r['ms']:10.3f} ms {r.get('gbps', 0):9.1f} GB/s{speed}{extra}{cfg}"


def markdown(rows: list[dict], command: str) -> str:
    out = [f"`{command}`", "", "| tokens | context | mode | ms | GB/s | speedup | bitwise | peak GB |",
           "|---:|---:|---|---:|---:|---:|---|---:|"]  # fmt: skip
    for r in rows:
        if r["phase"] != "topk":
            continue
        if "error" in r:
            out.append(f"| {r['tokens']} | {r['context']} | {r['mode']} | error: {r['error'][:80]} | | | | |")
            continue
        sp = f"{r['speedup']:.2f}" if "speedup" in r else ""
        out.append(f"| {r['tokens']} | {r['context']} | {r['mode']} | {r['ms']:.3f} | {r['gbps']:.0f} | {sp} | "
                   f"{r.get('bitwise', '')} | {r['peak_mem_gb']:.2f} |")  # fmt: skip
    sw = [r for r in rows if r["phase"] == "topk_sweep"]
    if sw:
        out += ["", "| tokens | context | candidate | ms | bitwise | config |", "|---:|---:|---:|---:|---|---|"]
        out += [f"| {r['tokens']} | {r['context']} | {r['candidate']} | {r.get('ms', float('nan')):.3f} | "
                f"{r.get('bitwise', r.get('error', ''))} | {json.dumps(r['config'])} |" for r in sw]  # fmt: skip
    return "\n".join(out) + "\n\n" + summary(rows) + "\n"


def summary(rows: list[dict]) -> str:
    new = [r for r in rows if r["phase"] == "topk" and r.get("mode") == "logits_topk"]
    bad = [r for r in rows if not r.get("ok")]
    parts = [f"{r['tokens']}x{r['context']}: {r['ms']:.2f} ms (x{r['speedup']:.2f}, x{r['vs_exact']:.2f} the exact path)"
             for r in new if "ms" in r]  # fmt: skip
    return f"SUMMARY logits_topk vs the packed path: {'; '.join(parts) or 'nothing ran'}; {len(bad)} failed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--cases", default=None, help="tokens x context pairs, e.g. 8192x32768,16x32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="time the launch candidates at the 8192-token cases")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes (the kernels need TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.cases:
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    else:
        cases = SMOKE_CASES if args.smoke else CASES
    reps = 1 if args.smoke else args.reps
    command = "python benchmarks/bench_logits_topk.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run_cases(cases, device, reps=reps, smoke=args.smoke)
    if args.sweep:
        at = SMOKE_CASES[-1:] if args.smoke else SWEEP_CASES
        rows += sweep(at, device, SMOKE_CANDIDATES if args.smoke else CANDIDATES, reps=reps, smoke=args.smoke)
    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
    tag = "cpux1" if device.type == "cpu" else next((f"{m}x1" for m in ("h200", "h100", "b200") if m in name), "gpux1")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"logits_topk_{tag}_{datetime.date.today().isoformat()}"
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stem.with_suffix(".md").write_text(f"# The extend indexer's selection, {tag}\n\n" + markdown(rows, command))
    print(summary(rows))
    print(f"wrote {stem}.jsonl, {stem}.md")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
