"""The extend-step indexer alone (``dtkv::indexer_logits``, fp8) against the plain-PyTorch path and the fp8 ceiling.

GPU, one H200 (a few minutes; the plain-PyTorch path and the compiles take most of it)::

    python benchmarks/bench_indexer_logits.py --out-dir $OUT
    python benchmarks/bench_indexer_logits.py --sweep --out-dir $OUT     # + time the launch candidates
    python benchmarks/bench_indexer_logits.py --write-table $OUT/indexer_logits_tuned.json   # winners -> ops/_tuned.py

CPU smoke (tiny shapes, torch and, with ``TRITON_INTERPRET=1``, the kernel under the interpreter; what
``tests/test_bench_indexer_logits.py`` runs)::

    TRITON_INTERPRET=1 python benchmarks/bench_indexer_logits.py --smoke --sweep --out-dir /tmp/x

Case ``tokens x context`` (``--cases``; default 4096 and 8192 tokens at 32K, 64K and 128K, and 1 and 16 tokens at
32K): one request whose last ``tokens`` positions are the step's queries (the last chunk of a ``context``-token
prompt: query ``n`` sees the first ``context - tokens + n + 1`` keys), DeepSeek-V3.2's indexer (64 heads x 128 dims,
fp8 pages of 64 tokens, 8448 bytes, in shuffled page order as a view holds them), queries quantized with
:func:`dtkv.ops.quantize_indexer_queries`. Rows (``phase: "indexer"``), one per case and ``mode``:

- ``logits`` / ``packed``: the kernel with float32 / packed int64 output (``packed`` is what the runtime runs);
- ``topk``: :func:`dtkv.ops.indexer_topk` of the packed keys (``index_topk`` 2048): the rest of the selection;
- ``torch``: the plain-PyTorch path (the op's torch backend: dequantized keys, float32 products in bounded blocks
  of queries; it computes every key, visible or not).

Each row: ``tokens``, ``context``, ``ms`` (median of ``--reps`` CUDA-event timings after a warmup), ``tflops``
(``2 x visible keys x 64 x 128`` per query over ``ms``; ``topk``: none), ``roofline_share`` (of
:data:`FP8_CEILING_TFLOPS`), ``peak_mem_gb`` (the call's peak allocation above what was allocated before it),
``visible_keys``, ``config`` (the launch), and the check against the torch path (``max_rel_err``: of each row's
largest ``|logit|``; ``mask_equal``). ``--sweep`` times every :data:`CANDIDATES` launch at :data:`SWEEP_CASES`
(rows ``phase: "indexer_sweep"``, ``bitwise`` against the default launch's packed keys) and writes
``indexer_logits_tuned.json`` (``benchmarks/tune_ops.py``'s format: the fastest bitwise launch per query count),
which ``--write-table`` merges into ``ops/_tuned.py``.

Writes ``indexer_<hw>_<date>.jsonl`` and ``.md`` into ``--out-dir`` (and ``$OUT`` when set); prints the table and
a closing ``TARGET`` line: >= 400 TFLOP/s at tokens >= 4096, context >= 32K.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("dtkv") is None:  # a checkout that is not installed: use it as is
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dtkv import IndexerFp8Layout  # noqa: E402
from dtkv.ops import _tuned, indexer_logits, indexer_topk, quantize_indexer_fp8, quantize_indexer_queries  # noqa: E402
from dtkv.ops.indexer_logits import indexer_logits_flops  # noqa: E402

FP8_CEILING_TFLOPS = 1400.0
"""The fp8 rate the issue's roofline takes for the indexer on one H200."""
TARGET_TFLOPS = 400.0
TOPK = 2048
HEADS, HEAD_DIM, PAGE = 64, 128, 64
CASES = [(4096, 32768), (8192, 32768), (4096, 65536), (8192, 65536), (4096, 131072), (8192, 131072),
         (1, 32768), (16, 32768)]  # fmt: skip
SWEEP_CASES = [(16, 32768), (1024, 32768), (4096, 32768), (8192, 32768), (8192, 131072)]
SMOKE_CASES = [(5, 70), (33, 200)]
"""CPU: tiny shapes (4 heads x 32 dims, pages of 16) that still have several tiles and query blocks."""


def _cands() -> list[dict]:
    out = []
    for bq, bk, warps in ((1, 64, 4), (2, 64, 4), (4, 64, 4), (4, 64, 8), (8, 64, 8), (1, 128, 4), (2, 128, 8),
                          (4, 128, 8)):  # fmt: skip
        for stages in (2, 3, 4):
            out.append({"variant": "keys", "block_q": bq, "block_k": bk, "num_warps": warps, "num_stages": stages})
    for bq, bk, warps in ((1, 64, 4), (2, 64, 4), (1, 128, 4), (2, 128, 8)):
        out.append({"variant": "queries", "block_q": bq, "block_k": bk, "num_warps": warps, "num_stages": 3})
    for bq, bk, warps in ((1, 128, 4), (2, 64, 4), (2, 128, 4), (2, 128, 8), (4, 64, 8), (4, 128, 8)):
        out.append({"variant": "split", "block_q": bq, "block_k": bk, "num_warps": warps, "num_stages": 2})
    out += [{"ctas_per_sm": c} for c in (2, 4, 6)]  # the key split of few queries
    return out


CANDIDATES: list[dict] = _cands()
"""Launches the sweep times (each completed from ``ops/_tuned.py``'s DEFAULTS): the keys-on-M arrangement over
queries per program x keys per tile x warps x pipeline stages (the default is 2 x 64 x 4 x 3: 161 registers, 3
programs per SM), the queries-on-M arrangement, a dot per query (``split``), and the key split's grid target for
decode-sized calls."""
SMOKE_CANDIDATES = [{"block_q": 1}, {"variant": "queries", "block_k": 32}]


def full(cand: dict) -> dict:
    return {**_tuned.DEFAULTS["indexer_logits"], **cand}


# ----------------------------------------------------------------------------------------- inputs
def make_case(tokens: int, context: int, device: torch.device, *, heads=HEADS, head_dim=HEAD_DIM, page=PAGE, seed=0):
    """The inputs of one case (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lay = IndexerFp8Layout(page_size=page, head_dim=head_dim)
    num_pages = -(-context // page)
    keys = torch.nn.functional.layer_norm(torch.randn(num_pages * page, head_dim, generator=g), (head_dim,))
    codes, scales = quantize_indexer_fp8(keys)
    pages = torch.empty(num_pages, lay.page_shape[0], dtype=torch.uint8)
    pages[:, : page * head_dim] = codes.view(num_pages, -1)
    pages[:, page * head_dim :] = scales.view(torch.uint8).view(num_pages, -1)
    order = torch.randperm(num_pages, generator=g)  # view page of each logical page
    pos = torch.arange(context)
    slots = order[pos // page] * page + pos % page
    q = torch.randn(tokens, heads, head_dim, generator=g)
    w = torch.randn(tokens, heads, generator=g) * heads**-0.5
    q8, w8 = quantize_indexer_queries(q, w, scale=head_dim**-0.5)
    start = torch.zeros(tokens, dtype=torch.int64)
    end = torch.arange(context - tokens, context, dtype=torch.int64) + 1
    to = {"device": device}
    return {"lay": lay, "q": q8.to(**to), "w": w8.to(**to), "pages": pages.to(**to), "slots": slots.to(**to),
            "start": start.to(**to), "end": end.to(**to)}  # fmt: skip


def _call(c: dict, backend: str, packed: bool):
    return lambda: indexer_logits(c["q"], c["w"], c["pages"], c["slots"], c["start"], c["end"], layout=c["lay"],
                                  packed=packed, backend=backend)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> tuple[float, float, object]:
    """``(median ms, peak GB above the allocation before, last result)`` of ``reps`` calls after one warmup (each
    call's result is freed before the next one runs)."""
    out = fn()
    _sync(device)
    out = None
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = []
    for _ in range(reps):
        out = None
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = fn()
            ms.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(ms), peak, out


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """The kernel's float32 logits against the torch path's: the visible masks and the relative error."""
    fg, fw = torch.isfinite(got), torch.isfinite(want)
    scale = want.masked_fill(~fw, 0).abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    err = ((got - want).abs() / scale).masked_fill(~fw, 0)
    return {"mask_equal": bool(torch.equal(fg, fw)), "max_rel_err": float(err.max()) if err.numel() else 0.0}


# ----------------------------------------------------------------------------------------- the runs
def _env(device: torch.device) -> dict:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}  # fmt: skip


def run_cases(cases, device: torch.device, *, reps: int, kernel_backend: str | None, smoke: bool, log=print):
    """Rows of every case and mode (see the module docstring); a failing mode is a row with ``error``."""
    rows, env = [], _env(device)
    geom = {"heads": 4, "head_dim": 32, "page": 16} if smoke else {}
    for tokens, context in cases:
        c = make_case(tokens, context, device, **geom)
        heads, head_dim = c["q"].shape[1:]
        flops = indexer_logits_flops(c["start"], c["end"], heads=heads, head_dim=head_dim)
        base = {"phase": "indexer", "tokens": tokens, "context": context, "visible_keys": flops // (2 * heads * head_dim),
                "heads": heads, "head_dim": head_dim, **env}  # fmt: skip
        want = None
        for mode in ("torch", "logits", "packed", "topk"):
            backend = "torch" if mode == "torch" else kernel_backend
            row = {**base, "mode": mode, "backend": backend}
            if backend is None:
                continue
            try:
                if mode == "topk":
                    keys = _call(c, kernel_backend, True)()
                    ms, peak, _ = timed(lambda keys=keys: indexer_topk(keys, TOPK), device, reps)
                    del keys
                else:
                    cfg = _tuned.launch_config("indexer_logits", tokens, device) if backend != "torch" else None
                    ms, peak, out = timed(_call(c, backend, mode == "packed"), device, reps if mode != "torch" else 1)
                    row |= {"config": cfg, "tflops": flops / (ms * 1e9)}
                    row["roofline_share"] = row["tflops"] / FP8_CEILING_TFLOPS
                    if mode == "torch":
                        want = out
                    elif mode == "logits" and want is not None:
                        row |= compare(out, want)
                    del out
                row |= {"ms": ms, "peak_mem_gb": peak, "ok": row.get("mask_equal", True) and row.get("max_rel_err", 0)
                        <= (1e-2 if device.type == "cuda" else 1e-5)}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported in the row
                row |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            log(_line(row))
        del want, c
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep(cases, device: torch.device, cands: list[dict], *, reps: int, smoke: bool, log=print):
    """Rows ``phase: "indexer_sweep"`` of every candidate at every case, and the winners in tune_ops' JSON: per
    query count, the launch with the smallest total time over that count's cases among those that ran every one
    of them with the default launch's packed keys (``bitwise``)."""
    rows, env = [], _env(device)
    geom = {"heads": 4, "head_dim": 32, "page": 16} if smoke else {}
    totals: dict[int, dict[int, float]] = {}  # tokens -> candidate -> ms over the cases, bitwise ones only
    for tokens, context in cases:
        c = make_case(tokens, context, device, **geom)
        heads, head_dim = c["q"].shape[1:]
        flops = indexer_logits_flops(c["start"], c["end"], heads=heads, head_dim=head_dim)
        default_keys = None
        fine = totals.setdefault(tokens, {i: 0.0 for i in range(-1, len(cands))})
        for i, cand in enumerate([{}, *cands], start=-1):
            cfg = full(cand)
            row = {"phase": "indexer_sweep", "tokens": tokens, "context": context, "candidate": i, "config": cfg,
                   **env}  # fmt: skip
            try:
                with _tuned.override("indexer_logits", **cfg):
                    ms, _, keys = timed(_call(c, "triton", True), device, reps)
                if default_keys is None:
                    default_keys = keys
                row |= {"ms": ms, "tflops": flops / (ms * 1e9), "bitwise": bool(torch.equal(keys, default_keys)),
                        "ok": True}  # fmt: skip
                keys = None
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run
                row |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if row["ok"] and row["bitwise"] and i in fine:
                fine[i] += row["ms"]
            else:
                fine.pop(i, None)
            rows.append(row)
            log(_line(row))
        c = default_keys = None
    tuned = {}
    for tokens, fine in totals.items():
        if fine:
            i = min(fine, key=fine.get)
            tuned[str(tokens)] = full(cands[i]) if i >= 0 else full({})
    return rows, {**env, "commit": _commit(), "tuned": {"indexer_logits": tuned} if tuned else {}}


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=ROOT, check=False)  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------------------- report
def _line(r: dict) -> str:
    head = f"{r['phase']:>13} {r['tokens']:>6} x {r['context']:>7} {r.get('mode', r.get('candidate', '')):>7}"
    if "error" in r:
        return f"{head}  error: {r['error']}"
    tf = f"{r['tflops']:8.1f} TFLOP/s" if r.get("tflops") is not None else " " * 16
    mem = f" peak {r['peak_mem_gb']:6.2f} GB" if "peak_mem_gb" in r else ""
    chk = f" err {r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
    bit = f" bitwise={r['bitwise']}" if "bitwise" in r else ""
    return f"{head} {r['ms']:10.3f} ms {tf}{mem}{chk}{bit}"


def markdown(rows: list[dict], command: str) -> str:
    out = [f"`{command}`", "", "| tokens | context | mode | ms | TFLOP/s | of 1400 | peak GB | max rel err | config |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        if r["phase"] != "indexer":
            continue
        if "error" in r:
            out.append(f"| {r['tokens']} | {r['context']} | {r['mode']} | error: {r['error'][:80]} | | | | | |")
            continue
        tf = f"{r['tflops']:.1f}" if r.get("tflops") is not None else ""
        share = f"{r['roofline_share']:.0%}" if r.get("roofline_share") is not None else ""
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else ""
        cfg = json.dumps(r["config"]) if r.get("config") else ""
        out.append(f"| {r['tokens']} | {r['context']} | {r['mode']} | {r['ms']:.3f} | {tf} | {share} | "
                   f"{r['peak_mem_gb']:.2f} | {err} | {cfg} |")  # fmt: skip
    return "\n".join(out) + "\n\n" + target(rows) + "\n"


def target(rows: list[dict]) -> str:
    """The closing line: the packed kernel's slowest case at tokens >= 4096, context >= 32K against 400 TFLOP/s."""
    big = [r for r in rows if r["phase"] == "indexer" and r["mode"] == "packed" and r["tokens"] >= 4096
           and r["context"] >= 32768]  # fmt: skip
    if not big:
        return "TARGET indexer >= 400 TFLOP/s at tokens >= 4096, context >= 32K: no such case ran"
    bad = [r for r in big if "error" in r or not r.get("ok")]
    if bad:
        return f"TARGET indexer: {len(bad)} case(s) failed ({bad[0].get('error', 'check failed')})"
    low = min(big, key=lambda r: r["tflops"])
    met = "met" if low["tflops"] >= TARGET_TFLOPS else "NOT met"
    return (f"TARGET indexer >= {TARGET_TFLOPS:.0f} TFLOP/s at tokens >= 4096, context >= 32K: {met} (slowest "
            f"{low['tflops']:.0f} TFLOP/s = {low['roofline_share']:.0%} of {FP8_CEILING_TFLOPS:.0f} at "
            f"{low['tokens']} x {low['context']})")  # fmt: skip


def write(rows: list[dict], doc: dict | None, out_dir: Path, tag: str, command: str) -> list[Path]:
    date = datetime.date.today().isoformat()
    paths = []
    for d in dict.fromkeys([out_dir] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])):
        d.mkdir(parents=True, exist_ok=True)
        stem = d / f"indexer_{tag}_{date}"
        stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        stem.with_suffix(".md").write_text(f"# Extend-step indexer, {tag} -- {date}\n\n" + markdown(rows, command))
        paths += [stem.with_suffix(".jsonl"), stem.with_suffix(".md")]
        if doc is not None:
            (d / "indexer_logits_tuned.json").write_text(json.dumps(doc, indent=1) + "\n")
            paths.append(d / "indexer_logits_tuned.json")
    return paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(f"{n}x{k}" for n, k in CASES), help="TOKENSxCONTEXT, comma separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time the launch candidates (writes the tuned JSON)")
    p.add_argument("--sweep-cases", default=",".join(f"{n}x{k}" for n, k in SWEEP_CASES))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--write-table", metavar="JSON", help="merge a sweep's winners into ops/_tuned.py and exit")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes (the kernel under TRITON_INTERPRET=1)")
    return p


def _cases(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.split("x") for s in text.split(",") if s)]


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.write_table:
        import tune_ops

        print(tune_ops.write_table(ns.write_table))
        print(f"wrote {tune_ops.TABLE}")
        return 0
    command = "python benchmarks/bench_indexer_logits.py " + " ".join(argv if argv is not None else sys.argv[1:])
    from dtkv.ops._common import HAS_TRITON, INTERPRET

    if ns.smoke:
        device, tag = torch.device("cpu"), "cpux1"
        kernel = "triton" if HAS_TRITON and INTERPRET else None
        cases, sweep_cases, cands, reps = SMOKE_CASES, SMOKE_CASES[:1], SMOKE_CANDIDATES, 1
    else:
        if not torch.cuda.is_available():
            print("error: needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 1
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device).lower()
        tag = next((f"{m}x1" for m in ("h200", "h100", "b200") if m in name), "gpux1")
        kernel, cases, sweep_cases, cands, reps = (
            "triton",
            _cases(ns.cases),
            _cases(ns.sweep_cases),
            CANDIDATES,
            ns.reps,
        )
    rows = run_cases(cases, device, reps=reps, kernel_backend=kernel, smoke=ns.smoke)
    doc = None
    if ns.sweep and kernel is not None:
        more, doc = sweep(sweep_cases, device, cands, reps=reps, smoke=ns.smoke)
        rows += more
    for path in write(rows, doc, Path(ns.out_dir), tag, command.strip()):
        print(f"wrote {path}")
    print(markdown(rows, command.strip()))
    errors = [r for r in rows if "error" in r or not r.get("ok", True)]
    print(f"{len(rows)} rows, {len(errors)} failed")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
