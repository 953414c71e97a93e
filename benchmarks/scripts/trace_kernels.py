"""The kernels of kept ``torch.profiler`` chrome traces, by total device time: name, count, total and mean.

    python benchmarks/scripts/trace_kernels.py TRACE_DIR [--top 25] [--out FILE.md]

Reads every ``*.json`` under ``TRACE_DIR`` (``bench_runtime.py --trace-dir``) and writes, per trace, its window,
device busy time, host gaps on the compute stream, and the kernels that took the most device time (each with its
category from ``benchmarks/_trace.py``). Each trace is reduced where it was made, so only the summary travels.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _trace import category, trace_summary  # noqa: E402


def kernels(path: Path, top: int) -> str:
    events = json.loads(path.read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in gpu:
        name = e.get("name", "")[:110]
        total[name] += e["dur"]
        count[name] += 1
    s = trace_summary(path)
    lines = [f"## {path.stem}", "",
             f"window {s['window_ms']} ms, compute busy {s['compute_busy_ms']} ms, idle {s['compute_idle_ms']} ms, "
             f"{len(gpu)} device events, gaps {s['compute_gaps_top']}", "",
             "| kernel | category | count | total ms | mean us |", "|---|---|--:|--:|--:|"]  # fmt: skip
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        cat = category({"name": name, "cat": "kernel"})
        lines.append(f"| `{name}` | {cat} | {count[name]} | {us / 1e3:.3f} | {us / count[name]:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    text = "\n".join(kernels(f, ns.top) for f in sorted(Path(ns.trace_dir).glob("*.json")))
    if ns.out:
        Path(ns.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
