"""Results of ``benchmarks/bench_runtime.py``: the issue's targets, the markdown summary and the plot.

Targets (one H200, cp=1, DeepSeek-V3.2's attention dims, 4 layers unless named; :func:`target_lines`, each ``met``
/ ``not met`` with its numbers, or ``not measured``):

- prefill of 32K and 128K prompts in chunks of 8192: ``ok``, ``gpu_busy_share >= 0.90``,
  ``dtkv_ms_per_layer <= 1.25 x kernel_ms_per_layer``, ``roofline_share >= 0.50``; a 128K prompt runs (peak memory);
- the extend-step indexer op >= 400 TFLOP/s at >= 4096 tokens x >= 32K context (``phase: "indexer"`` rows);
- decode with CUDA graphs at 32K and 128K x batch 1 and 16, both decode modes: ``gpu_busy_share >= 0.85``,
  ``dtkv_ms_per_layer <= 1.20 x`` the decode step's graph time per layer at the same context and batch (this
  run's ``kernel_ms_per_layer``, and ``bench_decode``'s committed H200 figure beside it);
- a 61-layer model decodes a step at 32K / batch 1 in <= 15 ms.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_indexer_logits import target as indexer_target

__all__ = ["figure", "markdown", "target_lines"]

RESULTS = Path(__file__).resolve().parent / "results"
PREFILL_BUSY, PREFILL_DTKV, PREFILL_ROOF = 0.90, 1.25, 0.50
DECODE_BUSY, DECODE_DTKV, LONG_STEP_MS = 0.85, 1.20, 15.0


def _f(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def bench_decode_ms_per_layer(context: int, batch: int, mode: str) -> float | None:
    """``bench_decode.py``'s graph step time per layer at this context and batch, from the newest committed
    ``decode_graph_h200x1_*.jsonl`` (``mode``: ``sharded`` or ``full_view``), or None."""
    files = sorted(RESULTS.glob("decode_graph_h200x1_*.jsonl"))
    if not files:
        return None
    for line in files[-1].read_text().splitlines():
        r = json.loads(line)
        if r.get("graph") and r.get("mode") == mode and (r.get("context"), r.get("batch")) == (context, batch):
            return r["step_ms"] / r["layers"]
    return None


def _prefill_line(r: dict) -> str:
    what = f"prefill {r['context'] // 1024}K / chunk {r['chunk']} ({r['adapter']}, {r['layers']} layers)"
    if not r["ok"]:
        return f"- TARGET {what}: **not met** (failed: {r['error']})"
    busy, dtkv, kern, roof = r["gpu_busy_share"], r["dtkv_ms_per_layer"], r["kernel_ms_per_layer"], r["roofline_share"]
    ratio = dtkv / kern if dtkv is not None and kern else None
    parts = [
        f"gpu_busy_share {_f(busy, '.2f')} (>= {PREFILL_BUSY})",
        f"dtkv {_f(dtkv)} ms/layer = {_f(ratio, '.2f')} x kernels {_f(kern)} (<= {PREFILL_DTKV})",
        f"roofline_share {_f(roof, '.2f')} (>= {PREFILL_ROOF})",
        f"{_f(r['tok_s'], '.0f')} tok/s, peak {_f(r['peak_mem_gb'], '.1f')} GiB",
    ]
    if None in (busy, ratio, roof):
        return f"- TARGET {what}: " + "; ".join(parts) + ": **not measured** (a part is missing)"
    return (
        f"- TARGET {what}: "
        + "; ".join(parts)
        + ": "
        + _verdict(busy >= PREFILL_BUSY and ratio <= PREFILL_DTKV and roof >= PREFILL_ROOF)
    )


def _decode_line(r: dict) -> str:
    what = f"decode {r['context'] // 1024}K x batch {r['batch']}, {r['decode_mode']} ({r['adapter']})"
    if not r["ok"]:
        return f"- TARGET {what}: **not met** (failed: {r['error']})"
    busy, dtkv, kern = r["gpu_busy_share"], r["dtkv_ms_per_layer"], r["kernel_ms_per_layer"]
    ratio = dtkv / kern if dtkv is not None and kern else None
    ref = bench_decode_ms_per_layer(
        r["context"], r["batch"], "sharded" if r["decode_mode"] == "sharded" else "full_view"
    )
    text = (f"graph {str(r['graph']).lower()}; step {_f(r['step_ms'])} ms; gpu_busy_share {_f(busy, '.2f')} "
            f"(>= {DECODE_BUSY}); dtkv {_f(dtkv)} ms/layer = {_f(ratio, '.2f')} x the graph step's {_f(kern)} "
            f"(<= {DECODE_DTKV}; bench_decode's file: {_f(ref)})")  # fmt: skip
    if not r["graph"]:
        return f"- TARGET {what}: {text}: **not met** (no CUDA graphs in the runtime)"
    if None in (busy, ratio):
        return f"- TARGET {what}: {text}: **not measured** (a part is missing)"
    return f"- TARGET {what}: {text}: " + _verdict(busy >= DECODE_BUSY and ratio <= DECODE_DTKV)


def target_lines(rows: list[dict]) -> list[str]:
    """One line per target of the issue (module docstring), from a run's rows."""
    lines = []
    pre = [r for r in rows if r["phase"] == "prefill" and r["adapter"] == "transformers" and r.get("chunk") == 8192
           and r["context"] in (32768, 131072) and r.get("cp", 1) == 1]  # fmt: skip
    lines += [_prefill_line(r) for r in pre] or ["- TARGET prefill 32K / 128K, chunk 8192: **not measured**"]
    big = [r for r in pre if r["context"] == 131072]
    if big:
        r = big[0]
        state = f"runs, peak {_f(r['peak_mem_gb'], '.1f')} GiB" if r["ok"] else f"failed: {r['error']}"
        lines.append(f"- TARGET a 128K prompt in 8K chunks runs on one GPU: {state}: {_verdict(r['ok'])}")
    idx = [r for r in rows if r["phase"] == "indexer"]
    lines.append("- " + indexer_target(idx) if idx else "- TARGET indexer: **not measured**")
    dec = [r for r in rows if r["phase"] == "decode" and r["adapter"] == "transformers" and r["layers"] != 61
           and r["context"] in (32768, 131072) and r["batch"] in (1, 16) and r.get("cp", 1) == 1]  # fmt: skip
    lines += [_decode_line(r) for r in dec] or ["- TARGET decode 32K / 128K x batch 1 / 16: **not measured**"]
    long = [r for r in rows if r["phase"] == "decode" and r["layers"] == 61 and r["context"] == 32768
            and r["batch"] == 1]  # fmt: skip
    for r in long:
        what = f"61 layers decode a step at 32K / batch 1 ({r['decode_mode']}, graph {str(r['graph']).lower()})"
        if not r["ok"]:
            lines.append(f"- TARGET {what}: **not met** (failed: {r['error']})")
        else:
            lines.append(f"- TARGET {what}: {_f(r['step_ms'], '.1f')} ms (<= {LONG_STEP_MS}): "
                         + _verdict(r["step_ms"] <= LONG_STEP_MS))  # fmt: skip
    if not long:
        lines.append("- TARGET 61 layers decode at 32K / batch 1: **not measured**")
    return lines


_PREFILL_COLS = (
    "adapter",
    "layers",
    "attention",
    "kv_mode",
    "context",
    "chunk",
    "ok",
    "tok_s",
    "gpu_busy_share",
    "dtkv_ms_per_layer",
    "kernel_ms_per_layer",
    "model_tflop",
    "roofline_share",
    "peak_mem_gb",
    "error",
)
_DECODE_COLS = ("adapter", "layers", "attention", "kv_mode", "decode_mode", "context", "batch", "graph", "ok",
                "step_ms", "gpu_busy_share", "dtkv_ms_per_layer", "kernel_ms_per_layer", "peak_mem_gb", "error")  # fmt: skip
_INDEXER_COLS = ("tokens", "context", "mode", "ms", "tflops", "peak_mem_gb", "error")


def _table(rows: list[dict], cols: tuple[str, ...]) -> list[str]:
    def cell(v) -> str:
        if isinstance(v, float):
            return format(v, ".4g")
        return "" if v is None else str(v).replace("|", "/")[:160]

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return out + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]


def markdown(rows: list[dict], env: dict, *, title: str, command: str, seconds: float, notes: list[str]) -> str:
    """The summary page: hardware and versions, the command, one table per phase, where the time went (kernel ms
    by category of the profiled runs), the targets, notes."""
    lines = [f"# {title}", "", f"- **Hardware / versions**: {env.get('device')}; " + ", ".join(
        f"{k} {env[k]}" for k in ("driver", "torch", "cuda", "triton", "transformers", "flash_mla") if env.get(k)),
        f"- **Date / commit**: {env.get('date')}, {env.get('commit')}",
        f"- **Command**: `{command}` ({seconds:.0f} s, cp={env.get('cp')})", ""]  # fmt: skip
    lines += [f"- {n}" for n in notes] + [""]
    for phase, cols in (("prefill", _PREFILL_COLS), ("decode", _DECODE_COLS), ("indexer", _INDEXER_COLS)):
        got = [r for r in rows if r["phase"] == phase]
        if got:
            lines += [f"## {phase}", ""] + _table(got, cols) + [""]
    cats = [r for r in rows if r.get("categories_ms")]
    if cats:
        lines += ["## Where the device time went (profiled runs, busiest stream, ms)", ""]
        for r in cats:
            what = f"{r['phase']} {r['adapter']} {r['layers']}L {r['context']}"
            what += f" chunk {r['chunk']}" if r["phase"] == "prefill" else f" x{r['batch']} {r['decode_mode']}"
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["categories_ms"].items())[:6])
            parts = r.get("kernel_parts_ms")
            lines.append(f"- {what}: {top}" + (f"; kernels alone per layer: {json.dumps(parts)}" if parts else ""))
        lines.append("")
    lines += ["## Targets", ""] + target_lines(rows)
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path) -> bool:
    """Prefill tok/s (and roofline share) by prompt length; decode ms per layer (runtime vs the kernels alone) by
    context; False when matplotlib is missing or nothing ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pre = [r for r in rows if r["phase"] == "prefill" and r["ok"] and r.get("tok_s")]
    dec = [r for r in rows if r["phase"] == "decode" and r["ok"] and r.get("step_ms")]
    if not pre and not dec:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["adapter"], r["layers"], r["chunk"]) for r in pre}):
        pts = sorted((r["context"], r["tok_s"], r.get("roofline_share")) for r in pre
                     if (r["adapter"], r["layers"], r["chunk"]) == key)  # fmt: skip
        a.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} {key[1]}L chunk {key[2]}")
        for x, y, s in pts:
            if s is not None:
                a.annotate(f"{100 * s:.0f}%", (x / 1024, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    a.set(xscale="log", xlabel="prompt (K tokens)", ylabel="prefill tok/s (labels: roofline share)",
          title="Runtime.prefill")  # fmt: skip
    a.legend(fontsize=7)
    for key in sorted({(r["adapter"], r["layers"], r["decode_mode"], r["batch"]) for r in dec}):
        pts = sorted((r["context"], r["step_ms"] / r["layers"], r.get("kernel_ms_per_layer")) for r in dec
                     if (r["adapter"], r["layers"], r["decode_mode"], r["batch"]) == key)  # fmt: skip
        line = b.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o",
                      label=f"{key[0]} {key[1]}L {key[2]} b{key[3]}")[0]  # fmt: skip
        ks = [(p[0] / 1024, p[2]) for p in pts if p[2] is not None]
        if ks:
            b.plot([k[0] for k in ks], [k[1] for k in ks], linestyle="--", color=line.get_color(), linewidth=1)
    b.set(xscale="log", yscale="log", xlabel="context (K tokens)", ylabel="ms per layer per step",
          title="Runtime.decode (dashed: kernels alone)")  # fmt: skip
    b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
