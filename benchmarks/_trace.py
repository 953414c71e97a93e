"""Reading ``torch.profiler`` chrome traces: where the device time goes, per stream, and which part is dtkv's.

:func:`trace_summary` reduces a trace to a small dict (milliseconds): the compute stream (the busiest one), its busy
and idle time inside the step's window and its largest gaps, the kernel time per category on it and on the other
streams, each other stream's overlap with the compute stream, NCCL kernel time (an NCCL kernel on the compute
stream also counts the time it waits for the slowest rank: ``nccl_on_compute_max_ms`` is the longest single one),
copy-engine copies and stream waits. :func:`profile_table` lays several modes' summaries side by side.

:func:`device_split` (``benchmarks/bench_runtime.py``): the device's busy time over every stream (overlapping
intervals merged, so two streams busy at once count once) and the part of it that dtkv's own code launched: a
kernel is dtkv's when the host call that launched it (matched by its ``correlation`` id) lies inside a host range
named ``dtkv.*`` (ranges the benchmark opens around dtkv's calls) or ``dtkv::*`` (dtkv's registered ops); a kernel
replayed from a CUDA graph (no host range) or with no matching launch is dtkv's when its name is one of dtkv's or
FlashMLA's kernels (:data:`DTKV_KERNEL_KEYS`). Without device events (a CPU run) the dtkv part is the host time
inside those ranges.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

__all__ = ["CATEGORIES", "DTKV_KERNEL_KEYS", "category", "device_split", "profile_table", "trace_summary"]

CATEGORIES = (
    ("nccl", ("nccl",)),
    ("kv_write", ("quantize_write",)),
    ("remap", ("_remap",)),
    ("pack", ("_pack_layer_pages",)),
    ("barrier", ("barrier_kernel",)),
    ("indexer", ("_indexer_logits", "indexer_pages", "indexer_cols", "_quantize_indexer_queries")),
    ("indices", ("_sparse_indices",)),
    ("attention", ("_sparse_mla", "flash", "mla", "sparse_attn")),
    ("topk", ("topk", "radix", "sort")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_")),
    ("cat_copy", ("catarraybatchedcopy", "direct_copy", "copy_kernel")),
)
"""Kernel categories, by a lowercase substring of the kernel name (first match wins); the rest is ``other``."""


def category(event: dict) -> str:
    if event.get("cat") == "gpu_memcpy":
        return "memcpy_peer" if "PtoP" in event.get("name", "") else "memcpy"
    if event.get("cat") == "gpu_memset":
        return "memset"
    name = event.get("name", "").lower()
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _intersect(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _ms(us: float, nd: int = 3) -> float:
    return round(us / 1e3, nd)


def trace_summary(path: Path) -> dict:
    """Per-stream busy time, overlap with the compute stream, kernel time per category, gaps (ms; see the module
    docstring)."""
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream: dict[object, list[dict]] = defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", -1)].append(e)
    unions = {s: _union([(e["ts"], e["ts"] + e["dur"]) for e in es]) for s, es in by_stream.items()}
    main = max(unions, key=lambda s: _length(unions[s])) if unions else None
    window = (
        max(b for iv in unions.values() for _, b in iv) - min(a for iv in unions.values() for a, _ in iv)
        if unions
        else 0.0
    )
    cats: dict[str, float] = defaultdict(float)
    side: dict[str, float] = defaultdict(float)
    for s, es in by_stream.items():
        for e in es:
            (cats if s == main else side)[category(e)] += e["dur"]
    gaps = []
    if main is not None:
        seq = sorted(by_stream[main], key=lambda e: e["ts"])
        end = seq[0]["ts"]
        for e in seq:
            if e["ts"] > end:
                gaps.append((e["ts"] - end, e["name"][:48]))
            end = max(end, e["ts"] + e["dur"])
    nccl_main = [e["dur"] for e in by_stream.get(main, []) if "nccl" in e["name"].lower()]
    waits = [e for e in events if e.get("ph") == "X" and "StreamWaitEvent" in e.get("name", "")]
    main_iv = unions.get(main, [])
    return {
        "window_ms": _ms(window),
        "compute_stream": main,
        "compute_busy_ms": _ms(_length(main_iv)),
        "compute_idle_ms": _ms(main_iv[-1][1] - main_iv[0][0] - _length(main_iv)) if main_iv else 0.0,
        "compute_gaps_top": [[_ms(g), name] for g, name in sorted(gaps, reverse=True)[:4]],
        "categories_ms": {k: _ms(v) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "side_categories_ms": {k: _ms(v) for k, v in sorted(side.items(), key=lambda kv: -kv[1])},
        "streams": {
            str(s): {"busy_ms": _ms(_length(iv)), "overlap_with_compute_ms": _ms(_intersect(iv, main_iv))}
            for s, iv in unions.items()
            if s != main
        },
        "nccl_kernel_ms": _ms(sum(e["dur"] for e in gpu if "nccl" in e["name"].lower())),
        "nccl_on_compute_max_ms": _ms(max(nccl_main, default=0.0)),
        "copy_ms": _ms(sum(e["dur"] for e in gpu if e.get("cat") == "gpu_memcpy")),
        "stream_waits": len(waits),
        "stream_wait_host_ms": _ms(sum(e["dur"] for e in waits)),
    }


def profile_table(summaries: dict[str, dict], reference: str | None = None) -> str:
    """Markdown: compute-stream time per category for each mode (and its difference from ``reference``)."""
    modes = list(summaries)
    cats = sorted({c for s in summaries.values() for c in s["categories_ms"]},
                  key=lambda c: -max(s["categories_ms"].get(c, 0.0) for s in summaries.values()))  # fmt: skip
    ref = summaries.get(reference) if reference else None

    def row(label: str, get) -> str:
        cells = []
        for mode, s in summaries.items():
            v = get(s)
            cells.append(f"{v:.3f}" if ref is None or mode == reference else f"{v:.3f} ({v - get(ref):+.3f})")
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = ["| compute stream, ms | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    lines.append(row("busy", lambda s: s["compute_busy_ms"]))
    lines.append(row("idle inside the step", lambda s: s["compute_idle_ms"]))
    lines.append(row("window", lambda s: s["window_ms"]))
    lines += [row(c, lambda s, c=c: s["categories_ms"].get(c, 0.0)) for c in cats]
    lines.append(row("longest NCCL kernel (waits for the slowest rank)", lambda s: s["nccl_on_compute_max_ms"]))
    lines.append("| other streams: busy / overlapping compute | " + " | ".join(
        ", ".join(f"{v['busy_ms']:.3f} / {v['overlap_with_compute_ms']:.3f}" for v in s["streams"].values()) or "-"
        for s in summaries.values()) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


DTKV_KERNEL_KEYS = ("indexer", "quantize_write", "sparse_mla", "sparse_indices", "remap", "pack_layer_pages",
                    "pack_owned", "write_owned", "map16", "flash", "mla", "sparse_attn", "logits_topk",
                    "keys_topk")  # fmt: skip
"""Lowercase substrings of the kernels of :mod:`dtkv.ops` (Triton: ``_<op>_kernel``) and FlashMLA's: how a kernel
with no host range (replayed from a CUDA graph) is attributed. ``torch.topk``'s kernels are not in it (the model's
MoE routing runs them too), so a graph-replayed step undercounts dtkv by a top-k it runs through ``torch.topk``
(``dtkv::logits_topk``'s and ``dtkv::keys_topk``'s kernels are in it)."""
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation")
NOT_LAUNCHES = (*GPU_CATS, *HOST_CATS, "gpu_user_annotation", "ac2g", "python_function")
"""Categories of events that carry no launch (the rest with a ``correlation``: ``cuda_runtime``, ``cuda_driver``)."""
RANGE_PREFIXES = ("dtkv.", "dtkv::")


def _inside(iv: list[tuple[float, float]], t: float) -> bool:
    """Whether ``t`` lies in one of the sorted, disjoint intervals ``iv``."""
    lo, hi = 0, len(iv)
    while lo < hi:
        mid = (lo + hi) // 2
        if iv[mid][1] < t:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(iv) and iv[lo][0] <= t <= iv[lo][1]


def device_split(events: list[dict], *, prefixes: tuple[str, ...] = RANGE_PREFIXES) -> dict:
    """Device busy time and dtkv's part of it (ms; see the module docstring) from a chrome trace's events.

    Returns:
        ``busy_ms`` (every stream merged; ``None`` without device events), ``dtkv_ms`` (dtkv's kernels merged, or
        without device events the host time inside dtkv's ranges), ``dtkv_host_ms``, ``kernels`` (device events),
        ``by_range`` / ``by_name`` (how many of dtkv's were attributed each way) and ``attribution`` (``"ranges"``,
        ``"ranges+names"``, ``"names"`` or ``"host"``).
    """
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    host: dict[object, list[tuple[float, float]]] = defaultdict(list)
    for e in xs:
        if e.get("cat") in HOST_CATS and e.get("name", "").startswith(prefixes):
            host[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    ranges = {tid: _union(iv) for tid, iv in host.items()}
    host_ms = _ms(sum(_length(iv) for iv in ranges.values()))
    launches = {}
    for e in xs:
        corr = e.get("args", {}).get("correlation")
        if corr is not None and e.get("cat") not in NOT_LAUNCHES:
            launches[corr] = e
    gpu = [e for e in xs if e.get("cat") in GPU_CATS]
    if not gpu:
        return {"busy_ms": None, "dtkv_ms": host_ms, "dtkv_host_ms": host_ms, "kernels": 0, "by_range": 0,
                "by_name": 0, "attribution": "host"}  # fmt: skip
    mine, by_range, by_name = [], 0, 0
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None and "graph" not in launch.get("name", "").lower():
            if _inside(ranges.get(launch.get("tid"), []), launch["ts"]):
                mine.append((e["ts"], e["ts"] + e["dur"]))
                by_range += 1
        elif any(k in e.get("name", "").lower() for k in DTKV_KERNEL_KEYS):
            mine.append((e["ts"], e["ts"] + e["dur"]))
            by_name += 1
    how = "ranges+names" if by_range and by_name else "names" if by_name else "ranges"
    return {
        "busy_ms": _ms(_length(_union([(e["ts"], e["ts"] + e["dur"]) for e in gpu]))),
        "dtkv_ms": _ms(_length(_union(mine))),
        "dtkv_host_ms": host_ms,
        "kernels": len(gpu),
        "by_range": by_range,
        "by_name": by_name,
        "attribution": how,
    }
