"""Bandwidth of the ``dtkv.ops`` kernels against the device-to-device copy ceiling and plain PyTorch.

Run ``python benchmarks/bench_ops.py`` (GPU: 64K / 256K / 1M tokens; CPU: tiny sizes, a smoke run). Every number is
GB/s of bytes read + written, the fewest a correct kernel must move. On CUDA each measurement is a CUDA-graph replay
(no Python launch overhead) over enough rotating input sets to defeat the L2 cache; the median of the replays. The
kernels run with the launch configurations of ``ops/_tuned.py`` (tuned by ``benchmarks/tune_ops.py``). On CUDA the
table goes to ``benchmarks/results/ops_<gpu>_<date>.md`` (and the same name under ``$OUT`` when set, or ``--out``).

Scenario per token count ``n`` (page size 64, pages scattered over a pool twice the size needed):

- ``write_owned``: owner filter at cp=4, full chunk of ``4n`` fp8 rows (656 B) in token order (runs of 64 rows per
  page, owners rotating per page), ``n`` owned; also the worst case where consecutive rows belong to different
  ranks. Baseline ``index_copy_`` of the ``n`` owned rows with precomputed destinations (the least torch can do).
- ``direct_write``: ``n`` rows, fp8 (656 B) and bf16 (1152 B); baseline ``index_copy_``.
- ``quantize_write_mla_fp8``: bf16 ``[n, 576]`` -> 656-B rows; baseline torch quantize + ``index_copy_``.
- ``quantize_write_indexer_fp8``: bf16 ``[n, 128]`` -> 8448-B pages; baseline torch quantize + two ``index_put_``.
- ``pack_owned_pages``: ``n / 64`` fp8 pages (41 984 B) in list order; baseline ``index_select``.
- ``pack_layer_pages``: the same send list out of a layer's fp8 and indexer pools (41 984 + 8 448 B per row) in one
  launch; baseline two ``index_select``.
- ``remap``: int32 top-k ``[n, 64]``; baseline the torch reference.
- ``dequantize_mla_rows``: ``n`` fp8 rows (656 B, pages of 64) -> bf16 ``[n, 576]``; baseline the torch path
  (a float32 copy of the codes, the scaled product, the rope copy).
- ``rope_interleave_into``: ``n`` tokens x 128 heads of 64 rope dims into a bf16 query buffer; baseline the
  model's interleaved rope, then a copy.

Each row's ``target`` is the issue's: >= 90% of a plain copy of the same bytes measured in the same run, except the
row-interleaved owner filter (every tile keeps some rows): >= 75%. Before timing, every scenario's Triton result on
every input set is compared bitwise with the torch backend's; each row is synchronized on its own, and a row that
fails is listed under the table instead of ending the run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
_SPEC = importlib.util.find_spec("dtkv.ops")
if _SPEC is None or Path(_SPEC.origin).resolve().parent != (ROOT / "ops").resolve():
    # a checkout without its editable install (pyproject's package-dir maps dtkv.ops to ops/): link it
    (ROOT / "dtkv" / "ops").symlink_to("../ops")
    importlib.invalidate_caches()

from _dist_bench import elapsed_ms  # noqa: E402

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership  # noqa: E402
from dtkv.ops import HAS_TRITON, plan_pack  # noqa: E402
from dtkv.ops._common import INTERPRET  # noqa: E402

if HAS_TRITON:
    import triton
    import triton.language as tl

_qm = importlib.import_module("dtkv.ops.quantize_write_mla_fp8")
_qi = importlib.import_module("dtkv.ops.quantize_write_indexer_fp8")
_remap = importlib.import_module("dtkv.ops.remap")
_tuned = importlib.import_module("dtkv.ops._tuned")

PS = 64
FP8 = MLAFp8Layout(page_size=PS)
IDX = IndexerFp8Layout(page_size=PS)
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One row of the table: inputs built, calls ready to capture, a bitwise check against the torch backend."""

    op: str
    """Row label (op and variant)."""
    tuned_op: str
    """The ``ops/_tuned.py`` key whose configuration the call uses."""
    tokens: int
    """Tokens written (or packed / remapped rows)."""
    size: int
    """The op's size as ``ops/_tuned.py`` buckets it (rows of the call, send rows, indices)."""
    bytes_moved: int
    """Bytes read + written by a minimal kernel."""
    target: float
    """Share of the same-size copy the row must reach."""
    baseline: str
    """Plain PyTorch path."""
    calls: list[Callable[[], object]]
    """Our op, one call per rotating input set."""
    base_calls: list[Callable[[], object]]
    """The baseline, likewise."""
    verify: Callable[[], str | None]
    """Triton (with the configuration in force) against torch on every input set: ``None`` if bitwise equal, else
    why not (naming the set)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    op: str
    tokens: int
    bytes_moved: int
    us: float
    """Median microseconds per call."""
    copy_us: float
    """A plain copy of the same bytes (bytes_moved / 2 read and written)."""
    baseline: str
    baseline_us: float
    target: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.us / 1e3

    @property
    def baseline_gbps(self) -> float:
        return self.bytes_moved / self.baseline_us / 1e3

    @property
    def share(self) -> float:
        """Share of the same-size copy (``copy_us / us``)."""
        return self.copy_us / self.us


# ----------------------------------------------------------------------------------------- timing
class Replay:
    """A captured group of calls: calling it runs them all once (a CUDA-graph replay on CUDA).

    It holds the calls, and with them every tensor they use, for as long as it lives: a CUDA graph does not own
    its inputs, and ``torch.cuda.graph`` empties the allocator's cache at each capture, so a graph whose inputs
    were freed before a later capture replays into unmapped memory (an illegal memory access).
    """

    __slots__ = ("calls", "graph")

    def __init__(self, calls: list[Callable[[], object]], graph: torch.cuda.CUDAGraph | None) -> None:
        self.calls = list(calls)
        self.graph = graph

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            for c in self.calls:
                c()


def capture(calls: list[Callable[[], object]], device: torch.device) -> Replay:
    """Warm ``calls`` up and return a :class:`Replay` running them all once (synchronized and checked: a call that
    fails raises here)."""
    for c in calls:
        c()
    if device.type != "cuda":
        return Replay(calls, None)
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
    replay = Replay(calls, graph)
    replay()
    torch.cuda.synchronize()
    return replay


class ReplayError(RuntimeError):
    """A replay of :func:`time_replays` failed; ``index`` is its position in the list (the error is chained)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(
            f"replay {index} failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
        self.index = index


def time_replays(
    replays: list[tuple[Callable[[], None], int]],
    device: torch.device,
    reps: int,
    before: Callable[[int], None] | None = None,
) -> list[float]:
    """Median microseconds per call of each ``(replay, calls per replay)``, the replays interleaved so that clock
    or thermal drift affects each alike.

    Each replay is synchronized on its own: one that fails raises :class:`ReplayError` naming it (``before(i)``,
    when given, is called before replay ``i`` runs, so a process that dies there can be traced to it).
    """
    times: list[list[float]] = [[] for _ in replays]
    for _ in range(reps):
        for i, (replay, count) in enumerate(replays):
            if before is not None:
                before(i)
            try:
                times[i].append(elapsed_ms(replay, device) * 1e3 / count)
            except Exception as e:  # noqa: BLE001 - named and re-raised
                raise ReplayError(i, e) from e
    return [statistics.median(t) for t in times]


def time_groups(groups: list[list[Callable[[], object]]], device: torch.device, reps: int) -> list[float]:
    """Median microseconds per call of each group (one call per rotating input set), interleaved."""
    return time_replays([(capture(g, device), len(g)) for g in groups], device, reps)


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


def measure(s: Scenario, dev: torch.device, reps: int) -> Result:
    """Time our calls, the baseline and the same-size copies, interleaved."""
    us, base_us, *copies = time_groups([s.calls, s.base_calls, *copy_groups(s.bytes_moved // 2, dev)], dev, reps)
    return Result(op=s.op, tokens=s.tokens, bytes_moved=s.bytes_moved, us=us, copy_us=min(copies),
                  baseline=s.baseline, baseline_us=base_us, target=s.target)  # fmt: skip


# ----------------------------------------------------------------------------------------- scenarios
def _backend(dev: torch.device) -> str:
    """Triton on CUDA, and on a CPU under ``TRITON_INTERPRET=1`` (a dry run of the checks); torch otherwise."""
    return "triton" if dev.type == "cuda" or (HAS_TRITON and INTERPRET) else "torch"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _verify_pool(
    pools: list[torch.Tensor], run: Callable[[int, str], object], dev: torch.device
) -> Callable[[], str | None]:
    """Check of a mutating op on every input set: ``run(i, backend)`` writes ``pools[i]``; from the same random
    start, Triton's bytes must be the torch backend's (the references are computed once, then reused for every
    configuration). Each set is synchronized before the next, so a failure names its set."""
    refs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def verify() -> str | None:
        if _backend(dev) != "triton":
            return None
        if not refs:
            for i, pool in enumerate(pools):
                init = torch.empty_like(pool).view(torch.uint8).random_().view(pool.dtype)
                pool.copy_(init)
                run(i, "torch")
                refs.append((init, pool.clone()))
        for i, (pool, (init, ref)) in enumerate(zip(pools, refs)):
            pool.copy_(init)
            run(i, "triton")
            _sync(dev)
            if not _same(pool, ref):
                return f"input set {i} of {len(pools)}: pool bytes differ from the torch backend's"
        return None

    return verify


def _verify_out(run: Callable[[int, str], torch.Tensor], count: int, dev: torch.device) -> Callable[[], str | None]:
    """Check of a functional op on each of its ``count`` input sets: Triton's output bytes must be the torch
    backend's (``run(i, backend)`` on set ``i``)."""
    refs: list[torch.Tensor] = []

    def verify() -> str | None:
        if _backend(dev) != "triton":
            return None
        if not refs:
            refs.extend(run(i, "torch") for i in range(count))
        for i, ref in enumerate(refs):
            outs = run(i, "triton")
            _sync(dev)
            if not _same(outs, ref):
                return f"input set {i} of {count}: output bytes differ from the torch backend's"
        return None

    return verify


def scattered(n: int, device: torch.device, seed: int):
    """Locations of ``n`` tokens over shuffled pages of a pool of ``2 * ceil(n / PS)`` local pages (cp=1)."""
    g = torch.Generator().manual_seed(seed)
    num_local = 2 * (-(-n // PS))
    pages = torch.randperm(num_local, generator=g)[: -(-n // PS)]
    t = torch.arange(n)
    return (pages[t // PS] * PS + t % PS).to(device), num_local


def write_scenario(
    n: int, dev: torch.device, *, row_dtype: str, owner_filter: bool, row_interleaved: bool = False
) -> Scenario:
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

    def ours(own, pool, rows, locs, locs_own, owned, be: str = ""):
        be = be or _backend(dev)
        if owner_filter:
            return op(pool, rows, locs, own.cp_size, own.num_pages, 0, 0, False, False, be)
        return op(pool, owned, locs_own, 1, own.num_pages // cp, 0, 0, True, False, be)

    def base(own, pool, rows, locs, locs_own, owned):
        pool.view(-1, pool.shape[2]).index_copy_(0, locs_own, owned)

    label = f"{name} {row_dtype}" + (f" cp={cp}" if owner_filter else "")
    label += " rows interleaved" if (owner_filter and row_interleaved) else ""
    return Scenario(
        op=label, tuned_op=name, tokens=n, size=n * cp, bytes_moved=2 * n * row_bytes + n * cp * 8,
        target=0.75 if (owner_filter and row_interleaved) else 0.90, baseline="index_copy_",
        calls=[lambda a=a: ours(*a) for a in sets], base_calls=[lambda a=a: base(*a) for a in sets],
        verify=_verify_pool([a[1] for a in sets], lambda i, be: ours(*sets[i], be=be), dev),
    )  # fmt: skip


def quant_mla_scenario(n: int, dev: torch.device) -> Scenario:
    sets = []
    for s in range(num_sets(n * (1152 + 656), dev)):
        locs, num_local = scattered(n, dev, s)
        pool = torch.zeros(num_local, PS, FP8.row_bytes, dtype=torch.uint8, device=dev)
        kv = torch.randn(n, FP8.row_dim, device=dev, dtype=torch.bfloat16)
        sets.append((pool, kv, locs, num_local))

    def ours(pool, kv, locs, num_local, be: str = ""):
        be = be or _backend(dev)
        torch.ops.dtkv.quantize_write_mla_fp8(pool, kv, locs, 1, num_local, 0, 0, 512, 64, 128, True, False, be)

    def base(pool, kv, locs, num_local):
        pool.view(-1, FP8.row_bytes).index_copy_(0, locs, _qm.quantize_mla_fp8_torch(kv, 512, 64, 128))

    return Scenario(
        op="quantize_write_mla_fp8 bf16", tuned_op="quantize_write_mla_fp8", tokens=n, size=n,
        bytes_moved=n * (1152 + 656 + 8), target=0.90, baseline="quantize + index_copy_",
        calls=[lambda a=a: ours(*a) for a in sets], base_calls=[lambda a=a: base(*a) for a in sets],
        verify=_verify_pool([a[0] for a in sets], lambda i, be: ours(*sets[i], be=be), dev),
    )  # fmt: skip


def dequant_mla_scenario(n: int, dev: torch.device) -> Scenario:
    """A view of ``ceil(n / 64)`` fp8 pages (quantized rows: finite, so both backends' bytes compare) to bf16
    rows; baseline the torch path the FlashMLA seam took before the op (a float32 copy of the codes, the scaled
    product written into the rows, the rope copied)."""
    pages = -(-n // PS)
    sets = []
    for _ in range(num_sets(pages * PS * (FP8.row_bytes + 2 * FP8.row_dim), dev)):
        kv = torch.randn(pages * PS, FP8.row_dim, device=dev, dtype=torch.bfloat16)
        sets.append(_qm.quantize_mla_fp8_torch(kv, 512, 64, 128).view(pages, PS, FP8.row_bytes))

    def ours(rows, be: str = ""):
        return torch.ops.dtkv.dequantize_mla_rows(rows, 512, 64, 128, torch.bfloat16, be or _backend(dev))

    def base(rows):
        r = rows.reshape(-1, FP8.row_bytes)
        out = torch.empty((r.shape[0], FP8.row_dim), dtype=torch.bfloat16, device=dev)
        codes = r[:, :512].view(torch.float8_e4m3fn).view(-1, 4, 128)
        torch.mul(codes.float(), r[:, 512:528].view(torch.float32)[..., None], out=out[:, :512].view(-1, 4, 128))
        out[:, 512:].copy_(r[:, FP8.rope_offset :].view(torch.bfloat16))
        return out

    return Scenario(
        op="dequantize_mla_rows fp8 -> bf16", tuned_op="dequantize_mla_rows", tokens=pages * PS, size=pages * PS,
        bytes_moved=pages * PS * (FP8.row_bytes + 2 * FP8.row_dim), target=0.90,
        baseline="torch: float32 codes, scaled product, rope copy", calls=[lambda a=a: ours(a) for a in sets],
        base_calls=[lambda a=a: base(a) for a in sets],
        verify=_verify_out(lambda i, be: ours(sets[i], be=be), len(sets), dev),
    )  # fmt: skip


def rope_scenario(n: int, dev: torch.device) -> Scenario:
    """``n`` tokens' rope queries (128 heads x 64 dims, a head-major view of a ``[n, 128, 192]`` projection) into
    the rope columns of an ``[n, 128, 576]`` bf16 query buffer; baseline the eager path (the model's interleaved
    rope, then a copy into the buffer)."""
    heads, e = 128, 64
    sets = []
    for _ in range(num_sets(n * heads * (192 + 576) * 2, dev)):
        proj = torch.randn(n, heads, 192, device=dev, dtype=torch.bfloat16)
        ang = torch.rand(n, e // 2, device=dev) * n
        emb = torch.cat([ang, ang], -1)
        buf = torch.empty(n, heads, 576, device=dev, dtype=torch.bfloat16)
        sets.append((buf, proj.transpose(0, 1)[..., 128:], emb.cos().bfloat16(), emb.sin().bfloat16()))

    def ours(buf, x, cos, sin, be: str = ""):
        torch.ops.dtkv.rope_interleave_into(buf[..., 512:], x, cos, sin, be or _backend(dev))
        return buf[..., 512:]

    def base(buf, x, cos, sin):
        c, s = cos[None, :, : e // 2], sin[None, :, : e // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        buf[..., 512:].copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).transpose(0, 1))

    return Scenario(
        op="rope_interleave_into bf16 128x64", tuned_op="rope_interleave_into", tokens=n, size=n * heads,
        bytes_moved=n * heads * e * 2 * 2 + n * e * 2 * 2, target=0.90,
        baseline="the model's rope (six elementwise ops, a cat), then a copy",
        calls=[lambda a=a: ours(*a) for a in sets], base_calls=[lambda a=a: base(*a) for a in sets],
        verify=_verify_out(lambda i, be: ours(*sets[i], be=be), len(sets), dev),
    )  # fmt: skip


def quant_indexer_scenario(n: int, dev: torch.device) -> Scenario:
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

    def ours(pool, k, locs, num_local, *_, be: str = ""):
        be = be or _backend(dev)
        torch.ops.dtkv.quantize_write_indexer_fp8(pool, k, locs, 1, num_local, 0, 0, PS, True, False, be)

    def base(pool, k, locs, num_local, page, key_cols, scale_cols):
        q, scale = _qi.quantize_indexer_fp8(k)
        pool.index_put_((page, key_cols), q)
        pool.index_put_((page, scale_cols), scale.view(torch.uint8).view(-1, 4))

    return Scenario(
        op="quantize_write_indexer_fp8 bf16", tuned_op="quantize_write_indexer_fp8", tokens=n, size=n,
        bytes_moved=n * (256 + 132 + 8), target=0.90, baseline="quantize + 2x index_put_",
        calls=[lambda a=a: ours(*a) for a in sets], base_calls=[lambda a=a: base(*a) for a in sets],
        verify=_verify_pool([a[0] for a in sets], lambda i, be: ours(*sets[i], be=be), dev),
    )  # fmt: skip


def _send_lists(n: int, dev: torch.device, count: int):
    """``count`` send lists of ``n / 64`` of rank 0's ``2 * n / 64`` local pages (cp=4), in list order."""
    num = -(-n // PS)
    out = []
    for s in range(count):
        own = PageOwnership(4, 8 * num, "interleave")  # rank 0 holds 2*num pages; the list picks num of them
        g = torch.Generator().manual_seed(s)
        plan = plan_pack((torch.randperm(2 * num, generator=g)[:num] * 4).to(dev), own)
        out.append(plan.send_local_idx[0].contiguous())
    return num, out


def pack_scenario(n: int, dev: torch.device) -> Scenario:
    page_bytes = PS * FP8.row_bytes
    num, idxs = _send_lists(n, dev, num_sets(2 * -(-n // PS) * page_bytes, dev))
    sets = [(torch.empty(2 * num, PS, FP8.row_bytes, dtype=torch.uint8, device=dev).random_(), idx) for idx in idxs]

    def ours(pool, idx, be: str = ""):
        be = be or _backend(dev)
        return torch.ops.dtkv.pack_owned_pages(pool, idx, be)

    return Scenario(
        op="pack_owned_pages fp8 ps64", tuned_op="pack_owned_pages", tokens=n, size=num,
        bytes_moved=2 * num * page_bytes, target=0.90, baseline="index_select",
        calls=[lambda a=a: ours(*a) for a in sets], base_calls=[lambda p=p, i=i: p.index_select(0, i) for p, i in sets],
        verify=_verify_out(lambda i, be: ours(*sets[i], be=be), len(sets), dev),
    )  # fmt: skip


def pack_layer_scenario(n: int, dev: torch.device) -> Scenario:
    page_bytes = PS * FP8.row_bytes + IDX.page_bytes
    num, idxs = _send_lists(n, dev, num_sets(2 * -(-n // PS) * page_bytes, dev))
    sets = []
    for idx in idxs:
        mla = torch.empty(2 * num, PS, FP8.row_bytes, dtype=torch.uint8, device=dev).random_()
        sets.append(([mla, torch.empty(2 * num, *IDX.page_shape, dtype=torch.uint8, device=dev).random_()], idx))

    def ours(pools, idx, be: str = ""):
        be = be or _backend(dev)
        return torch.ops.dtkv.pack_layer_pages(pools, idx, be)

    def verify_run(i, be):
        return torch.cat([o.flatten() for o in ours(*sets[i], be=be)])

    return Scenario(
        op="pack_layer_pages fp8+indexer ps64", tuned_op="pack_layer_pages", tokens=n, size=num,
        bytes_moved=2 * num * page_bytes, target=0.90, baseline="2x index_select",
        calls=[lambda a=a: ours(*a) for a in sets],
        base_calls=[lambda p=p, i=i: [x.index_select(0, i) for x in p] for p, i in sets],
        verify=_verify_out(verify_run, len(sets), dev),
    )  # fmt: skip


def remap_scenario(n: int, dev: torch.device) -> Scenario:
    num_pages = -(-n // PS) * 4
    page_map = torch.randperm(num_pages, device=dev).to(torch.int32)
    sets = [torch.randint(-1, num_pages * PS, (n, 64), device=dev, dtype=torch.int32)
            for _ in range(num_sets(n * 64 * 8, dev))]  # fmt: skip

    def ours(x, be: str = ""):
        be = be or _backend(dev)
        return torch.ops.dtkv.remap(x, page_map, PS, be)

    return Scenario(
        op="remap int32 topk64", tuned_op="remap", tokens=n, size=n * 64, bytes_moved=n * 64 * 8, target=0.90,
        baseline="torch gather + where", calls=[lambda x=x: ours(x) for x in sets],
        base_calls=[lambda x=x: _remap.remap_torch(x, page_map, PS) for x in sets],
        verify=_verify_out(lambda i, be: ours(sets[i], be=be), len(sets), dev),
    )  # fmt: skip


SCENARIOS: dict[str, list[Callable[[int, torch.device], Scenario]]] = {
    "write_owned": [
        lambda n, d: write_scenario(n, d, row_dtype="fp8", owner_filter=True),
        lambda n, d: write_scenario(n, d, row_dtype="fp8", owner_filter=True, row_interleaved=True),
    ],
    "direct_write": [
        lambda n, d: write_scenario(n, d, row_dtype="fp8", owner_filter=False),
        lambda n, d: write_scenario(n, d, row_dtype="bf16", owner_filter=False),
    ],
    "quantize_write_mla_fp8": [quant_mla_scenario],
    "quantize_write_indexer_fp8": [quant_indexer_scenario],
    "pack_owned_pages": [pack_scenario],
    "pack_layer_pages": [pack_layer_scenario],
    "remap": [remap_scenario],
    "dequantize_mla_rows": [dequant_mla_scenario],
    "rope_interleave_into": [rope_scenario],
}
"""The table's scenarios per ``ops/_tuned.py`` op, in table order."""


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
        pack_layer_pages,
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
    ipool = torch.empty(num_local, *IDX.page_shape, dtype=torch.uint8, device=dev).random_()
    idx = plan.send_local_idx[1]
    a, b = ([*pack_layer_pages([pool, ipool], idx, backend=be)] for be in ("torch", "triton"))
    out.append(f"pack_layer_pages: {'ok' if all(torch.equal(x, y) for x, y in zip(a, b)) else 'MISMATCH'}")
    topk = torch.randint(-1, 4 * num_local * PS, (n, 64), device=dev, dtype=torch.int32)
    a, b = (remap(topk, plan.page_map, page_size=PS, backend=be) for be in ("torch", "triton"))
    out.append(f"remap: {'ok' if torch.equal(a, b) else 'MISMATCH'}")
    return "Triton vs torch, bitwise, " + str(n) + " tokens: " + ", ".join(out)


# ----------------------------------------------------------------------------------------- report
def target_cell(r: Result) -> str:
    """``met`` when the op reaches its share of the same-size copy, else ``not met`` with the exact share."""
    if not math.isfinite(r.share):
        return "n/a"
    return "met" if r.share >= r.target else f"not met ({100 * r.share:.1f}% < {100 * r.target:.0f}%)"


def table(results: list[Result], ceiling: float) -> list[str]:
    head = [
        "| op | tokens | MB moved | us | GB/s | % of copy ceiling | same-size copy GB/s | % of same-size copy "
        "| baseline | baseline GB/s | speedup | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    return head + [
        f"| {r.op} | {r.tokens} | {r.bytes_moved / 1e6:.1f} | {r.us:.1f} | {r.gbps:.0f} | "
        f"{100 * r.gbps / ceiling:.0f}% | {r.bytes_moved / r.copy_us / 1e3:.0f} | {100 * r.share:.0f}% | "
        f"{r.baseline} | {r.baseline_gbps:.0f} | {r.baseline_us / r.us:.1f}x | {target_cell(r)} |"
        for r in results
    ]


def closing_note(results: list[Result], failed: list[str] = ()) -> str:
    missed = [r for r in results if not r.share >= r.target]
    total = len(results) + len(failed)
    line = (
        f"Targets (>= 90% of the same-size copy; the row-interleaved owner filter >= 75%): "
        f"{len(results) - len(missed)} of {total} rows met."
    )
    if missed:
        line += " Not met: " + "; ".join(f"{r.op} at {r.tokens} tokens ({100 * r.share:.1f}%)" for r in missed) + "."
    if failed:
        line += f" Failed (not measured): {len(failed)}, listed above."
    return line


def context_ok(dev: torch.device) -> bool:
    """Whether the CUDA context still runs work (an illegal memory access poisons it for the whole process)."""
    if dev.type != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=dev).add_(1).item() == 2.0
    except Exception:  # noqa: BLE001 - any error means: no
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and its causes, outermost first."""
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def error_summary(e: BaseException) -> str:
    """One line: the error and its innermost cause, with the source line of the innermost Triton compile error
    (a kernel's ``CompilationError`` names only its call site; what failed is in the called function)."""
    chain = _chain(e)
    inner = chain[-1]
    line = _first_line(e)
    if inner is not e:
        line += f" <- {_first_line(inner)}"
    located = [x for x in chain if type(x).__name__ == "CompilationError"]
    if located:  # "at L:C:", the source, a caret under the failing line, then (Triton 3.6+) the cause's repr
        lines = str(located[-1]).splitlines()
        caret = next((i for i, t in enumerate(lines) if t.strip() == "^"), None)
        if caret:
            cause = " ".join(t.strip() for t in lines[caret + 1 :] if t.strip())
            line += f" [{lines[0].strip()} {lines[caret - 1].strip()}{' -> ' + cause if cause else ''}]"
    return line[:600]


def error_text(e: BaseException, max_chars: int = 6000) -> str:
    """The whole chain, innermost cause first, each with its full message (what a log and a JSON keep)."""
    parts = [f"{type(x).__name__}: {str(x).strip()}" for x in reversed(_chain(e))]
    text = "\n--- raised from ---\n".join(parts)
    return text if len(text) <= max_chars else text[: max_chars - 10] + "\n... (cut)"


def _indent(text: str, last: int = 60) -> str:
    lines = text.splitlines()
    return "\n".join("      " + t for t in lines[-last:])


def device_tag(dev: torch.device) -> str:
    """``h200`` for an ``NVIDIA H200``: the results file's hardware name."""
    if dev.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(dev).lower().removeprefix("nvidia ")).strip("-")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "missing"


def run_rows(tokens: list[int], ops: list[str], dev: torch.device, reps: int):
    """Every scenario of ``ops`` at every token count, each row checked, measured and synchronized on its own: a row
    that fails is reported, not fatal. After an error that leaves the CUDA context unusable (an illegal memory
    access), the remaining rows are reported as not run. Returns ``(results, configs, bad, failed, details)``:
    ``failed`` one line per failed row, ``details`` the full error text of each (innermost cause first)."""
    results, configs, bad, failed = [], [], [], []
    details = []  # the full error text of each failed row (the report's last section)
    lost = ""
    for n in tokens:
        for op in ops:
            for k, make in enumerate(SCENARIOS[op]):
                where = f"{op} scenario {k} at {n} tokens"
                if lost:
                    failed.append(f"{where}: not run (the CUDA context was lost at {lost})")
                    continue
                s = None
                try:
                    s = make(n, dev)
                    where = f"{s.op} at {n} tokens"
                    why = s.verify()
                    if why:
                        bad.append(f"{where}: {why}")
                    r = measure(s, dev, reps)
                    _sync(dev)
                    results.append(r)
                    configs.append(f"  {s.op} @ {n}: {_tuned.launch_config(s.tuned_op, s.size, dev)}")
                    print(f"  {s.op} {n}: {r.us:.1f} us, {100 * r.share:.0f}% of same-size copy", flush=True)
                except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
                    failed.append(f"{where}: {error_summary(e)}")
                    details.append(f"{where}:\n{_indent(error_text(e))}")
                    print(f"  {where}: FAILED {error_summary(e)}\n{_indent(error_text(e))}", flush=True)
                    if not context_ok(dev):
                        lost = where
                finally:
                    del s
    return results, configs, bad, failed, details


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default: GPU 64K 256K 1M, CPU 256)")
    ap.add_argument("--ops", nargs="*", help=f"ops to measure (default all: {list(SCENARIOS)})")
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--out", help="also write the markdown report here (a file, or a directory: under its own name)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a smoke run: busy shared CPUs make intra-op threads spin
    tokens = args.tokens or ([65536, 262144, 1048576] if dev.type == "cuda" else [256])
    reps = args.reps or (20 if dev.type == "cuda" else 3)
    ops = args.ops or list(SCENARIOS)
    unknown = sorted(set(ops) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--ops must name ops of {list(SCENARIOS)}, got {unknown}")
    try:
        check_line = check(dev)
    except Exception as e:  # noqa: BLE001 - reported in the report's head; the rows still run if they can
        check_line = f"Triton vs torch check FAILED: {error_summary(e)}"
        print(_indent(error_text(e)), flush=True)
    print(check_line, flush=True)
    ceiling_lines, ceiling = [], 0.0
    for big in [1 << 28, 1 << 30, 1 << 31] if dev.type == "cuda" else [1 << 22]:
        groups = copy_groups(big, dev)
        kinds = ["Tensor.copy_", "Triton copy kernel"][: len(groups)]
        for kind, us in zip(kinds, time_groups(groups, dev, reps)):
            gbps = 2 * big / us / 1e3
            ceiling = max(ceiling, gbps)
            ceiling_lines.append(f"  copy {big >> 20:5d} MiB, {kind}: {gbps:.0f} GB/s")
        del groups
    results, configs, bad, failed, details = run_rows(tokens, ops, dev, reps)
    date = datetime.date.today().isoformat()
    env = (
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"triton {_triton_version()}, {date}, dtkv {_commit()}"
    )
    tuned = f"tuned table: {_tuned.TUNED_ON or 'empty (DEFAULTS everywhere)'}"
    head = [
        f"Device: {env}; {tuned}",
        check_line,
        "Every timed scenario bitwise equal to the torch backend on every input set: "
        + ("yes" if not bad else "NO: " + "; ".join(bad))
        if _backend(dev) == "triton"
        else "Scenario checks skipped (torch backend: no CUDA, no TRITON_INTERPRET=1)",
        f"Copy ceiling (best device-to-device copy, bytes read + written): {ceiling:.0f} GB/s",
        *ceiling_lines,
        "",
    ]
    fail_lines = ["", "Rows that failed (not in the table):", *(f"- {f}" for f in failed)] if failed else []
    if details:
        fail_lines += ["", "Errors of the failed rows (innermost cause first):", "", "```", *details, "```"]
    text = "\n".join(
        head + table(results, ceiling) + fail_lines
        + ["", closing_note(results, failed), "", "Launch configurations (ops/_tuned.py):"] + configs
    )  # fmt: skip
    print(text)
    name = f"ops_{device_tag(dev)}_{date}.md"
    targets = []
    if args.out:  # a file, or a directory to write the report into under its own name
        targets.append(Path(args.out) / name if Path(args.out).is_dir() else Path(args.out))
    if dev.type == "cuda":
        targets.append(RESULTS / name)
        if os.environ.get("OUT"):
            targets.append(Path(os.environ["OUT"]) / name)
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"wrote {path}")
    if failed:
        raise SystemExit(f"{len(failed)} row(s) failed")


if __name__ == "__main__":
    main()
