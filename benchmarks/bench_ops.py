"""Bandwidth of the ``dtkv.ops`` kernels against the device-to-device copy ceiling and plain PyTorch.

Run ``python benchmarks/bench_ops.py`` (GPU: 64K / 256K / 1M tokens; CPU: tiny sizes, a smoke run). Every number is
GB/s of bytes read + written, the fewest a correct kernel must move. On CUDA each measurement is a CUDA-graph replay
(no Python launch overhead) over enough rotating input sets to defeat the L2 cache; the median of the replays.

Scenario per token count ``n`` (page size 64, pages scattered over a pool twice the size needed):

- ``write_owned``: owner filter at cp=4, full chunk of ``4n`` fp8 rows (656 B) in token order (runs of 64 rows per
  page, owners rotating per page), ``n`` owned; also the worst case where consecutive rows belong to different
  ranks. Baseline ``index_copy_`` of the ``n`` owned rows with precomputed destinations (the least torch can do).
- ``direct_write``: ``n`` rows, fp8 (656 B) and bf16 (1152 B); baseline ``index_copy_``.
- ``quantize_write_mla_fp8``: bf16 ``[n, 576]`` -> 656-B rows; baseline torch quantize + ``index_copy_``.
- ``quantize_write_indexer_fp8``: bf16 ``[n, 128]`` -> 8448-B pages; baseline torch quantize + two ``index_put_``.
- ``pack_owned_pages``: ``n / 64`` fp8 pages (41 984 B) in list order; baseline ``index_select``.
- ``remap``: int32 top-k ``[n, 64]``; baseline the torch reference.

``--sweep`` also times kernel launch configurations at 256K tokens and uses the best for the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.ops import HAS_TRITON, plan_pack

if HAS_TRITON:
    import triton
    import triton.language as tl

# the op modules (``dtkv.ops.<op>`` names the function; the module holds KERNEL_CONFIG and the references)
_wo = importlib.import_module("dtkv.ops.write_owned")
_qm = importlib.import_module("dtkv.ops.quantize_write_mla_fp8")
_qi = importlib.import_module("dtkv.ops.quantize_write_indexer_fp8")
_pk = importlib.import_module("dtkv.ops.pack_owned_pages")
_remap = importlib.import_module("dtkv.ops.remap")

PS = 64
_ONLY_OURS = False  # set while sweeping: skip the copy and baseline timings


FP8 = MLAFp8Layout(page_size=PS)
IDX = IndexerFp8Layout(page_size=PS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    op: str
    """Op and variant."""
    tokens: int
    """Tokens written (or packed / remapped rows)."""
    bytes_moved: int
    """Bytes read + written by a minimal kernel."""
    us: float
    """Median microseconds per call."""
    copy_us: float
    """A plain copy of the same bytes (bytes_moved / 2 read and written)."""
    baseline: str
    """Plain PyTorch path."""
    baseline_us: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.us / 1e3

    @property
    def baseline_gbps(self) -> float:
        return self.bytes_moved / self.baseline_us / 1e3


def _capture(calls: list[Callable[[], object]], device: torch.device) -> Callable[[], None]:
    """Warm ``calls`` up and return a function running them all once (a CUDA-graph replay on CUDA)."""
    for c in calls:
        c()
    if device.type != "cuda":
        return lambda: [c() for c in calls] and None
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def time_groups(groups: list[list[Callable[[], object]]], device: torch.device, reps: int) -> list[float]:
    """Median microseconds per call of each group (one call per rotating input set).

    The groups' replays are interleaved, so clock or thermal drift affects each group alike.
    """
    replays = [_capture(g, device) for g in groups]
    times: list[list[float]] = [[] for _ in groups]
    for _ in range(reps):
        for i, (replay, calls) in enumerate(zip(replays, groups)):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                replay()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1e3 / len(calls))
            else:
                t0 = time.perf_counter()
                replay()
                times[i].append((time.perf_counter() - t0) * 1e6 / len(calls))
    return [statistics.median(t) for t in times]


def num_sets(set_bytes: int, device: torch.device) -> int:
    """Rotating input sets so one graph replay touches >= 512 MiB (about 10x the H200's L2)."""
    return 1 if device.type != "cuda" else max(1, min(8, math.ceil((512 << 20) / max(set_bytes, 1))))


if HAS_TRITON:

    @triton.jit
    def _copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


def copy_groups(nbytes: int, device: torch.device) -> list[list[Callable[[], object]]]:
    """Two copies of ``nbytes``: ``Tensor.copy_`` (cudaMemcpy) and, on CUDA, an SM copy kernel (int64 words)."""
    k = num_sets(2 * nbytes, device)
    words = -(-nbytes // 8)
    src = [torch.empty(words, dtype=torch.int64, device=device).random_() for _ in range(k)]
    dst = [torch.empty_like(x) for x in src]
    groups = [[lambda x=x, y=y: y.copy_(x) for x, y in zip(src, dst)]]
    if device.type == "cuda" and HAS_TRITON:
        grid = (triton.cdiv(words, 4096),)
        groups.append([lambda x=x, y=y: _copy_kernel[grid](y, x, words, BLOCK=4096, num_warps=8)
                       for x, y in zip(src, dst)])  # fmt: skip
    return groups


def measure(op: str, n: int, nbytes: int, ours: list, baseline: str, base: list, dev, reps: int) -> Result:
    """Time our calls and (unless sweeping) the baseline and the same-size copies, interleaved."""
    if _ONLY_OURS:
        (us,) = time_groups([ours], dev, reps)
        return Result(op=op, tokens=n, bytes_moved=nbytes, us=us, copy_us=math.nan, baseline=baseline,
                      baseline_us=math.nan)  # fmt: skip
    us, base_us, *copies = time_groups([ours, base, *copy_groups(nbytes // 2, dev)], dev, reps)
    return Result(op=op, tokens=n, bytes_moved=nbytes, us=us, copy_us=min(copies), baseline=baseline,
                  baseline_us=base_us)  # fmt: skip


def scattered(n: int, device: torch.device, seed: int):
    """Locations of ``n`` tokens over shuffled pages of a pool of ``2 * ceil(n / PS)`` local pages (cp=1)."""
    g = torch.Generator().manual_seed(seed)
    num_local = 2 * (-(-n // PS))
    pages = torch.randperm(num_local, generator=g)[: -(-n // PS)]
    t = torch.arange(n)
    return (pages[t // PS] * PS + t % PS).to(device), num_local


def bench_write(
    n: int, dev: torch.device, reps: int, *, row_dtype: str, owner_filter: bool, row_interleaved: bool = False
) -> Result:
    row_bytes = 656 if row_dtype == "fp8" else 1152
    cp = 4 if owner_filter else 1
    sets = []
    for s in range(num_sets(2 * n * row_bytes, dev)):
        locs_own, num_local = scattered(n, dev, s)
        own = PageOwnership(cp, num_local * cp, "interleave")
        pool = torch.zeros(num_local, PS, row_bytes, dtype=torch.uint8, device=dev)
        if row_dtype == "bf16":
            pool = pool.view(torch.bfloat16)
        rows = torch.empty(n * cp, pool.shape[2], dtype=torch.uint8 if row_dtype == "fp8" else torch.bfloat16,
                           device=dev)  # fmt: skip
        rows.view(torch.uint8).random_()
        # local page l of rank 0 is logical page l * cp + 0; ranks 1.. own the pages l * cp + r
        page, off = torch.div(locs_own, PS, rounding_mode="floor"), locs_own % PS
        locs = torch.stack([(page * cp + r) * PS + off for r in range(cp)], dim=1)  # [n, cp]
        if row_interleaved or n % PS:  # worst case: consecutive rows belong to different ranks
            locs, owned_rows = locs.reshape(-1), rows[::cp].contiguous()
        else:  # token order, as an all-gathered chunk is: runs of PS rows per page, owners rotating per page
            locs = locs.view(-1, PS, cp).transpose(1, 2).reshape(-1)
            owned_rows = rows.view(-1, cp, PS, rows.shape[1])[:, 0].reshape(-1, rows.shape[1])
        sets.append((own, pool, rows, locs, locs_own, owned_rows))
    name = "write_owned" if owner_filter else "direct_write"
    op = torch.ops.dtkv.write_owned  # a direct write is dtkv::write_owned with direct=True

    be = "triton" if dev.type == "cuda" else "torch"

    def ours(own, pool, rows, locs, locs_own, owned):
        if owner_filter:
            return op(pool, rows, locs, own.cp_size, own.num_pages, 0, 0, False, False, be)
        return op(pool, owned, locs_own, 1, own.num_pages // cp, 0, 0, True, False, be)

    def base(own, pool, rows, locs, locs_own, owned):
        pool.view(-1, pool.shape[2]).index_copy_(0, locs_own, owned)

    nbytes = 2 * n * row_bytes + n * cp * 8
    label = f"{name} {row_dtype}" + (f" cp={cp}" if owner_filter else "")
    label += " rows interleaved" if (owner_filter and row_interleaved) else ""
    ours_calls = [lambda a=a: ours(*a) for a in sets]
    base_calls = [lambda a=a: base(*a) for a in sets]
    return measure(label, n, nbytes, ours_calls, "index_copy_", base_calls, dev, reps)


def bench_quant_mla(n: int, dev: torch.device, reps: int) -> Result:
    be = "triton" if dev.type == "cuda" else "torch"
    sets = []
    for s in range(num_sets(n * (1152 + 656), dev)):
        locs, num_local = scattered(n, dev, s)
        pool = torch.zeros(num_local, PS, FP8.row_bytes, dtype=torch.uint8, device=dev)
        kv = torch.randn(n, FP8.row_dim, device=dev, dtype=torch.bfloat16)
        sets.append((pool, kv, locs, num_local))

    def ours(pool, kv, locs, num_local):
        torch.ops.dtkv.quantize_write_mla_fp8(pool, kv, locs, 1, num_local, 0, 0, 512, 64, 128, True, False, be)

    def base(pool, kv, locs, num_local):
        pool.view(-1, FP8.row_bytes).index_copy_(0, locs, _qm.quantize_mla_fp8_torch(kv, 512, 64, 128))

    nbytes = n * (1152 + 656 + 8)
    ours_calls = [lambda a=a: ours(*a) for a in sets]
    base_calls = [lambda a=a: base(*a) for a in sets]
    return measure(
        "quantize_write_mla_fp8 bf16", n, nbytes, ours_calls, "quantize + index_copy_", base_calls, dev, reps
    )


def bench_quant_indexer(n: int, dev: torch.device, reps: int) -> Result:
    be = "triton" if dev.type == "cuda" else "torch"
    hd = IDX.head_dim
    sets = []
    for s in range(num_sets(n * (256 + 132), dev)):
        locs, num_local = scattered(n, dev, s)
        pool = torch.zeros(num_local, PS * (hd + 4), dtype=torch.uint8, device=dev)
        k = torch.randn(n, hd, device=dev, dtype=torch.bfloat16)
        page, off = torch.div(locs, PS, rounding_mode="floor"), locs % PS
        key_cols = off[:, None] * hd + torch.arange(hd, device=dev)
        scale_cols = PS * hd + 4 * off[:, None] + torch.arange(4, device=dev)
        sets.append((pool, k, locs, num_local, page[:, None], key_cols, scale_cols))

    def ours(pool, k, locs, num_local, *_):
        torch.ops.dtkv.quantize_write_indexer_fp8(pool, k, locs, 1, num_local, 0, 0, PS, True, False, be)

    def base(pool, k, locs, num_local, page, key_cols, scale_cols):
        q, scale = _qi.quantize_indexer_fp8(k)
        pool.index_put_((page, key_cols), q)
        pool.index_put_((page, scale_cols), scale.view(torch.uint8).view(-1, 4))

    nbytes = n * (256 + 132 + 8)
    ours_calls = [lambda a=a: ours(*a) for a in sets]
    base_calls = [lambda a=a: base(*a) for a in sets]
    return measure(
        "quantize_write_indexer_fp8 bf16", n, nbytes, ours_calls, "quantize + 2x index_put_", base_calls, dev, reps
    )


def bench_pack(n: int, dev: torch.device, reps: int) -> Result:
    be = "triton" if dev.type == "cuda" else "torch"
    num = -(-n // PS)
    page_bytes = PS * FP8.row_bytes
    sets = []
    for s in range(num_sets(2 * num * page_bytes, dev)):
        own = PageOwnership(4, 8 * num, "interleave")  # rank 0 holds 2*num pages; the list picks num of them
        g = torch.Generator().manual_seed(s)
        pages = (torch.randperm(2 * num, generator=g)[:num] * 4).to(dev)
        plan = plan_pack(pages, own)
        pool = torch.empty(2 * num, PS, FP8.row_bytes, dtype=torch.uint8, device=dev).random_()
        idx = plan.send_local_idx[0].contiguous()
        sets.append((pool, idx))

    def ours(pool, idx):
        return torch.ops.dtkv.pack_owned_pages(pool, idx, be)

    def base(pool, idx):
        return pool.index_select(0, idx)

    nbytes = 2 * num * page_bytes
    ours_calls = [lambda a=a: ours(*a) for a in sets]
    base_calls = [lambda a=a: base(*a) for a in sets]
    return measure("pack_owned_pages fp8 ps64", n, nbytes, ours_calls, "index_select", base_calls, dev, reps)


def bench_remap(n: int, dev: torch.device, reps: int) -> Result:
    be = "triton" if dev.type == "cuda" else "torch"
    num_pages = -(-n // PS) * 4
    page_map = torch.randperm(num_pages, device=dev).to(torch.int32)
    sets = [torch.randint(-1, num_pages * PS, (n, 64), device=dev, dtype=torch.int32)
            for _ in range(num_sets(n * 64 * 8, dev))]  # fmt: skip
    nbytes = n * 64 * 8
    ours_calls = [lambda x=x: torch.ops.dtkv.remap(x, page_map, PS, be) for x in sets]
    base_calls = [lambda x=x: _remap.remap_torch(x, page_map, PS) for x in sets]
    return measure("remap int32 topk64", n, nbytes, ours_calls, "torch gather + where", base_calls, dev, reps)


def check(dev: torch.device, n: int = 65536 + 37, *, force: bool = False) -> str:
    """Bitwise agreement of the Triton and torch backends on one large, awkward input (a partial last page)."""
    if dev.type != "cuda" and not force:
        return "check skipped (no CUDA)"
    out = []
    locs, num_local = scattered(n, dev, 7)
    locs4 = torch.stack([(locs // PS * 4 + r) * PS + locs % PS for r in range(4)], 1).reshape(-1)
    own4 = PageOwnership(4, 4 * num_local)
    rows = torch.empty(4 * n, 656, dtype=torch.uint8, device=dev).random_()
    kv = torch.randn(4 * n, 576, device=dev, dtype=torch.bfloat16) * 10 ** torch.empty(4 * n, 1, device=dev).uniform_(
        -4, 3
    )
    k = kv[:, :128].contiguous()
    from dtkv.ops import (
        direct_write,
        pack_owned_pages,
        quantize_write_indexer_fp8,
        quantize_write_mla_fp8,
        remap,
        write_owned,
    )

    cases = {
        "write_owned": lambda be, pool: write_owned(pool, rows, locs4, own4, 1, validate=False, backend=be),
        "direct_write": lambda be, pool: direct_write(pool, rows[:n], locs, PageOwnership(1, num_local), 0,
                                                      validate=False, backend=be),
        "quantize_write_mla_fp8": lambda be, pool: quantize_write_mla_fp8(pool, kv, locs4, own4, 2, layout=FP8,
                                                                          validate=False, backend=be),
    }  # fmt: skip
    for name, fn in cases.items():
        pools = [torch.zeros(num_local, PS, 656, dtype=torch.uint8, device=dev) for _ in range(2)]
        fn("torch", pools[0])
        fn("triton", pools[1])
        out.append(f"{name}: {'ok' if torch.equal(pools[0], pools[1]) else 'MISMATCH'}")
    pools = [torch.zeros(num_local, *IDX.page_shape, dtype=torch.uint8, device=dev) for _ in range(2)]
    for be, pool in zip(("torch", "triton"), pools):
        quantize_write_indexer_fp8(pool, k, locs4, own4, 3, layout=IDX, validate=False, backend=be)
    out.append(f"quantize_write_indexer_fp8: {'ok' if torch.equal(pools[0], pools[1]) else 'MISMATCH'}")
    pool = torch.empty(num_local, PS, 656, dtype=torch.uint8, device=dev).random_()
    plan = plan_pack(torch.randperm(4 * num_local, device=dev)[: 3 * num_local // 2], own4)
    a, b = (pack_owned_pages(pool, plan, own4, 1, backend=be) for be in ("torch", "triton"))
    out.append(f"pack_owned_pages: {'ok' if torch.equal(a, b) else 'MISMATCH'}")
    topk = torch.randint(-1, 4 * num_local * PS, (n, 64), device=dev, dtype=torch.int32)
    a, b = (remap(topk, plan.page_map, page_size=PS, backend=be) for be in ("torch", "triton"))
    out.append(f"remap: {'ok' if torch.equal(a, b) else 'MISMATCH'}")
    return "Triton vs torch, bitwise, " + str(n) + " tokens: " + ", ".join(out)


def sweep(dev: torch.device, reps: int, n: int) -> list[str]:
    """Time launch configurations at ``n`` tokens; keep the best in each op's ``KERNEL_CONFIG``."""
    global _ONLY_OURS
    _ONLY_OURS = True
    lines = []
    spaces = [
        (_wo.KERNEL_CONFIG, lambda: bench_write(n, dev, reps, row_dtype="fp8", owner_filter=True),
         {"filter_block_r": [8, 16, 32], "num_warps": [4, 8]}),
        (_wo.KERNEL_CONFIG, lambda: bench_write(n, dev, reps, row_dtype="fp8", owner_filter=False),
         {"block_r": [4, 8], "num_warps": [4, 8]}),
        (_qm.KERNEL_CONFIG, lambda: bench_quant_mla(n, dev, reps), {"block_r": [4, 8, 16], "num_warps": [4, 8]}),
        (_qi.KERNEL_CONFIG, lambda: bench_quant_indexer(n, dev, reps), {"block_r": [8, 16], "num_warps": [2, 4]}),
    ]  # fmt: skip
    for cfg, run, space in spaces:
        best = None
        for values in itertools.product(*space.values()):
            cfg.update(dict(zip(space, values)))
            try:
                r = run()
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects is skipped
                lines.append(f"  {dict(cfg)}: failed ({type(e).__name__})")
                continue
            lines.append(f"  {r.op:34s} {dict(cfg)}: {r.us:9.1f} us {r.gbps:8.1f} GB/s")
            if best is None or r.us < best[0]:
                best = (r.us, dict(cfg))
        if best:
            cfg.update(best[1])
            lines.append(f"  best: {best[1]}")
    _ONLY_OURS = False
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default: GPU 64K 256K 1M, CPU 256)")
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="sweep kernel launch configs first (GPU)")
    ap.add_argument("--out", help="write a markdown table here")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a smoke run: busy shared CPUs make intra-op threads spin
    tokens = args.tokens or ([65536, 262144, 1048576] if dev.type == "cuda" else [256])
    reps = args.reps or (20 if dev.type == "cuda" else 3)
    check_line = check(dev)
    print(check_line, flush=True)
    sweep_lines = sweep(dev, reps, 262144) if args.sweep and dev.type == "cuda" else []
    ceiling_lines, ceiling = [], 0.0
    for big in [1 << 28, 1 << 30, 1 << 31] if dev.type == "cuda" else [1 << 22]:
        groups = copy_groups(big, dev)
        kinds = ["Tensor.copy_", "Triton copy kernel"][: len(groups)]
        for kind, us in zip(kinds, time_groups(groups, dev, reps)):
            gbps = 2 * big / us / 1e3
            ceiling = max(ceiling, gbps)
            ceiling_lines.append(f"  copy {big >> 20:5d} MiB, {kind}: {gbps:.0f} GB/s")
        del groups
    results = []
    for n in tokens:
        results += [
            bench_write(n, dev, reps, row_dtype="fp8", owner_filter=True),
            bench_write(n, dev, reps, row_dtype="fp8", owner_filter=True, row_interleaved=True),
            bench_write(n, dev, reps, row_dtype="fp8", owner_filter=False),
            bench_write(n, dev, reps, row_dtype="bf16", owner_filter=False),
            bench_quant_mla(n, dev, reps),
            bench_quant_indexer(n, dev, reps),
            bench_pack(n, dev, reps),
            bench_remap(n, dev, reps),
        ]
    env = (
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"triton {_triton_version()}, {datetime.date.today().isoformat()}"
    )
    head = [
        f"Device: {env}",
        check_line,
        f"Copy ceiling (best device-to-device copy, bytes read + written): {ceiling:.0f} GB/s",
        *ceiling_lines,
        "",
        "| op | tokens | MB moved | us | GB/s | % of copy ceiling | same-size copy GB/s | % of same-size copy "
        "| baseline | baseline GB/s | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    rows = [
        f"| {r.op} | {r.tokens} | {r.bytes_moved / 1e6:.1f} | {r.us:.1f} | {r.gbps:.0f} | "
        f"{100 * r.gbps / ceiling:.0f}% | {r.bytes_moved / r.copy_us / 1e3:.0f} | {100 * r.copy_us / r.us:.0f}% | "
        f"{r.baseline} | {r.baseline_gbps:.0f} | {r.baseline_us / r.us:.1f}x |"
        for r in results
    ]
    configs = [f"Kernel configs: write {_wo.KERNEL_CONFIG}, mla {_qm.KERNEL_CONFIG}, indexer {_qi.KERNEL_CONFIG}, "
               f"pack {_pk.KERNEL_CONFIG}, remap {_remap.KERNEL_CONFIG}"]  # fmt: skip
    text = "\n".join(head + rows + ["", *configs])
    if sweep_lines:
        text += "\n\nSweep at 256K tokens:\n```\n" + "\n".join(sweep_lines) + "\n```"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "missing"


if __name__ == "__main__":
    main()
