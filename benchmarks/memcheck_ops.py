"""Out-of-bounds check of every launch configuration ``benchmarks/tune_ops.py`` can pick, on guard-banded inputs.

    # GPU (one H200, about a minute for write_owned): every access checked by compute-sanitizer, with one device
    # allocation per tensor (no caching allocator) so that it sees each tensor's end
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python benchmarks/memcheck_ops.py --ops write_owned --tokens 517 70001 --seeds 0 1
    # GPU: the first sweep's crash (graphs replayed after their inputs were freed), old pattern and new
    python benchmarks/memcheck_ops.py --freed-graph-repro
    # CPU: the Triton interpreter, each active lane's address checked against the kernel's tensor arguments
    TRITON_INTERPRET=1 python benchmarks/memcheck_ops.py --ops remap

Each case runs one op with one configuration (every distinct candidate of ``tune_ops.CANDIDATES``, the defaults) on
inputs built as ``bench_ops.py`` builds them, over several seeds (its rotating input sets) and awkward sizes (one
token, a partial last page, windows of the owner filter whose last one is cut short), with skipped rows of every kind (``-1``, past the pool, int64 values past 2**32, foreign pages). Every input
and preallocated output is copied into a buffer of its own, between two bands of :data:`BAND` bytes of poison: for
an index or location tensor, a *valid* value (a lane that followed it would write or copy somewhere), elsewhere
random bytes. A case fails when:

- its bytes differ from the torch backend's on the same inputs (a read of poison, or any wrong result);
- a band changed (a write out of bounds);
- under the interpreter, with :func:`interpreter_address_check`, a load or store touched a byte outside every
  tensor argument of the kernel (the interpreter's version of compute-sanitizer; on the GPU the sanitizer does it).

Prints one line per op and a summary; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ops as B  # noqa: E402  (makes the dtkv/ops link of a checkout without the editable install)
import tune_ops as T  # noqa: E402

from dtkv.ops import _tuned  # noqa: E402
from dtkv.ops.pack_layer_pages import pack_layer_pages_into  # noqa: E402

BAND = 1 << 16
"""Guard bytes on either side of every tensor (more than a 41 984-byte page: a step one page past the end lands in
the band)."""

PS = B.PS


# ----------------------------------------------------------------------------------------- guard bands
class Bands:
    """Tensors copied into buffers of their own, each between two bands of :data:`BAND` bytes of poison.

    :meth:`put` returns the copy (same shape, strides and dtype; its first byte 64 KiB-aligned within the buffer, so
    word views are as wide as for a fresh tensor). The bytes of a buffer that are not the tensor's (the bands, and
    the gaps of a strided view such as a layer of a layered pool) are remembered; :meth:`changed` names the tensors
    whose other bytes were written.
    """

    def __init__(self, seed: int = 0) -> None:
        self._entries: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._gen = torch.Generator().manual_seed(seed)

    def put(self, name: str, t: torch.Tensor, poison: int | float | None = None) -> torch.Tensor:
        """``t`` inside bands of ``poison`` (a value of ``t.dtype``; ``None``: random bytes, gaps too)."""
        if any(st < 0 for st in t.stride()):
            raise ValueError(f"{name}: negative strides are not supported, got stride {t.stride()}")
        lo, hi = _extent(t)
        extent, isz = hi - lo, t.element_size()
        buf = _rand_bytes((2 * BAND + extent,), self._gen).to(t.device)
        if poison is not None:
            buf[:BAND].view(t.dtype).fill_(poison)
            buf[BAND + extent :].view(t.dtype).fill_(poison)
        view = buf[BAND : BAND + extent].view(t.dtype).as_strided(t.shape, t.stride())
        view.copy_(t)
        mine = torch.zeros_like(buf, dtype=torch.bool)
        byte_strides = [st * isz for st in t.stride()] + [1]
        mine.as_strided([*t.shape, isz], byte_strides, BAND).fill_(True)
        others = ~mine
        self._entries.append((name, buf, others, buf[others].clone()))
        return view

    def changed(self) -> list[str]:
        """Names of the tensors whose bands (or gaps) no longer hold what :meth:`put` left there."""
        return [name for name, buf, others, before in self._entries if not torch.equal(buf[others], before)]


# ----------------------------------------------------------------------------------------- the interpreter's check
class AddressError(AssertionError):
    """A Triton kernel run by the interpreter touched bytes outside every tensor argument."""


_ranges: list[tuple[int, int, str]] = []
"""``(first byte, end byte, name)`` of each tensor argument of the kernel being interpreted."""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_access(kind: str, ptrs, mask) -> None:
    addr = np.asarray(ptrs.data, dtype=np.uint64)
    active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
    addr = addr[active].astype(np.int64)
    if addr.size == 0:
        return
    size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    ok = np.zeros(addr.shape, dtype=bool)
    for lo, hi, _ in _ranges:
        ok |= (addr >= lo) & (addr + size <= hi)
    if not ok.all():
        bad = int(addr[~ok][0])
        near = min(_ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])), default=(0, 0, "?"))
        where = f"{bad - near[1]} bytes past the end of" if bad >= near[1] else f"{near[0] - bad} bytes before"
        raise AddressError(
            f"{kind} of {int((~ok).sum())} active lane(s) out of bounds, e.g. address {bad:#x}: {where} "
            f"argument {near[2]!r} [{near[0]:#x}, {near[1]:#x})"
        )


@contextlib.contextmanager
def interpreter_address_check() -> Iterator[None]:
    """Inside the block, every load and store of a kernel run by the Triton interpreter must touch only bytes of
    the kernel's tensor arguments (the extent of each argument's view); the first that does not raises
    :class:`AddressError` before the access is made (masked-off lanes are not accesses, as on a GPU).

    The check patches the interpreter's executor and builder (``triton.runtime.interpreter``); it raises
    ``RuntimeError`` when they are not what it patches, rather than check nothing.
    """
    from triton.runtime import interpreter as ti

    builder, executor = ti.InterpreterBuilder, ti.GridExecutor
    wanted = ("create_masked_load", "create_masked_store")
    if not all(hasattr(builder, m) for m in wanted) or not hasattr(executor, "_init_args_hst"):
        raise RuntimeError("triton.runtime.interpreter has changed: the address check cannot be installed")
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__

    def checked_load(self, ptrs, mask, other, *args, **kwargs):
        _check_access("load", ptrs, mask)
        return load(self, ptrs, mask, other, *args, **kwargs)

    def checked_store(self, ptrs, value, mask, *args, **kwargs):
        _check_access("store", ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    def checked_call(self, *args, **kwargs):
        names = list(getattr(self, "arg_names", [])) or [f"arg{i}" for i in range(len(args))]
        found = [(n, a) for n, a in itertools.chain(zip(names, args), kwargs.items()) if isinstance(a, torch.Tensor)]
        saved = list(_ranges)
        _ranges[:] = [(*_extent(a), n) for n, a in found]
        try:
            return call(self, *args, **kwargs)
        except Exception as e:  # the interpreter wraps what a kernel raises: unwrap the address error
            if isinstance(e.__cause__, AddressError):
                raise e.__cause__ from None
            raise
        finally:
            _ranges[:] = saved

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    executor.__call__ = checked_call
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, call


# ----------------------------------------------------------------------------------------- cases
@dataclass(frozen=True, kw_only=True)
class Case:
    """One input of one op: ``run(backend)`` runs the op on the banded tensors and returns the bytes to compare."""

    name: str
    run: Callable[[str], list[torch.Tensor]]
    bands: Bands


def _rand_bytes(shape, gen) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def _skipped_kinds(locs: torch.Tensor, num_locs: int) -> torch.Tensor:
    """Every kind of row the kernels must skip, sprinkled over ``locs``: -1, other negatives, ``num_locs`` (one past
    the pool), and in int64 values past 2**31 and 2**32 (they must not wrap onto a valid location). Every kept
    location stays unique (which of two rows at one location lands is unspecified)."""
    locs = locs.clone()
    locs[3::29] = -1
    locs[5::31] = -7
    locs[7::37] = num_locs
    if locs.dtype == torch.int64:
        locs[11::41] = 2**32 + 64
        locs[13::43] = 2**31
    return locs


def _mutating(bands: Bands, name: str, pool_init: torch.Tensor, launch: Callable[[torch.Tensor, str], None]) -> Case:
    pool = bands.put("pool", pool_init)

    def run(be: str) -> list[torch.Tensor]:
        pool.copy_(pool_init)
        launch(pool, be)
        return [pool.clone()]

    return Case(name=name, run=run, bands=bands)


def write_owned_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """The owner filter at cp=4 (``bench_ops.write_scenario``'s chunk): token order and interleaved rows."""
    cp = 4
    for order in ("token", "interleaved"):
        bands = Bands(seed)
        gen = torch.Generator().manual_seed(seed)
        locs_own, num_local = B.scattered(n, torch.device("cpu"), seed)
        page, off = torch.div(locs_own, PS, rounding_mode="floor"), locs_own % PS
        locs = torch.stack([(page * cp + r) * PS + off for r in range(cp)], dim=1)  # [n, cp]
        if order == "token":  # runs of PS rows per page, owners rotating per page (any n: a partial last run)
            t = torch.arange(n)
            key = (t // PS)[:, None] * cp * PS + torch.arange(cp)[None, :] * PS + (t % PS)[:, None]
            locs = locs.flatten()[key.flatten().argsort()]
        else:
            locs = locs.flatten()
        rank = seed % cp
        num_pages = num_local * cp
        locs = _skipped_kinds(locs.to(torch.int64 if seed % 2 == 0 else torch.int32), num_pages * PS)
        rows = bands.put("rows", _rand_bytes((n * cp, 656), gen).to(dev))
        locs = bands.put("locs", locs.to(dev), poison=rank * PS)  # a location rank owns
        if seed % 3 == 1:  # a layer view: page stride twice the page
            pool_init = _rand_bytes((num_local, 2, PS, 656), gen).to(dev)[:, 1]
        else:
            pool_init = _rand_bytes((num_local, PS, 656), gen).to(dev)

        def launch(pool, be, rows=rows, locs=locs, rank=rank, num_pages=num_pages):
            torch.ops.dtkv.write_owned(pool, rows, locs, cp, num_pages, 0, rank, False, False, be)

        yield _mutating(bands, f"write_owned n={n} seed={seed} {order} rank={rank}", pool_init, launch)


def direct_write_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """``bench_ops``' direct write (cp=1) of fp8 and bf16 rows."""
    for kind, dim, dtype in (("fp8", 656, torch.uint8), ("bf16", 576, torch.bfloat16)):
        bands = Bands(seed)
        gen = torch.Generator().manual_seed(seed)
        locs, num_local = B.scattered(n, torch.device("cpu"), seed)
        locs = _skipped_kinds(locs.to(torch.int64 if seed % 2 == 0 else torch.int32), num_local * PS)
        rows = bands.put("rows", _rand_bytes((n, dim * (2 if dtype == torch.bfloat16 else 1)), gen).view(dtype).to(dev))
        locs = bands.put("locs", locs.to(dev), poison=0)
        pool_init = _rand_bytes((num_local, PS, rows.shape[1] * rows.element_size()), gen).view(dtype).to(dev)

        def launch(pool, be, rows=rows, locs=locs, num_local=num_local):
            torch.ops.dtkv.write_owned(pool, rows, locs, 1, num_local, 0, 0, True, False, be)

        yield _mutating(bands, f"direct_write {kind} n={n} seed={seed}", pool_init, launch)


def _kv(n: int, dim: int, gen) -> torch.Tensor:
    mag = 10 ** (torch.rand(n, 1, generator=gen) * 7 - 4)
    return (torch.randn(n, dim, generator=gen) * mag).to(torch.bfloat16)


def quantize_mla_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """``bench_ops``' MLA quantizing write (cp=1, every row read at once) and the owner filter at cp=2."""
    for cp in (1, 2):
        bands = Bands(seed)
        gen = torch.Generator().manual_seed(seed)
        locs, num_local = B.scattered(n, torch.device("cpu"), seed)
        if cp == 2:  # rank 1 owns the odd logical pages: the rows of even pages are foreign
            page, off = torch.div(locs, PS, rounding_mode="floor"), locs % PS
            locs = torch.stack([(page * 2 + r) * PS + off for r in range(2)], 1).flatten()
        locs = _skipped_kinds(locs, num_local * cp * PS)
        kv = bands.put("kv", _kv(locs.shape[0], 576, gen).to(dev))
        locs = bands.put("locs", locs.to(dev), poison=(cp - 1) * PS)
        pool_init = _rand_bytes((num_local, PS, 656), gen).to(dev)

        def launch(pool, be, kv=kv, locs=locs, cp=cp, num_local=num_local):
            torch.ops.dtkv.quantize_write_mla_fp8(pool, kv, locs, cp, num_local * cp, 0, cp - 1, 512, 64, 128, cp == 1,
                                                  False, be)  # fmt: skip

        yield _mutating(bands, f"quantize_write_mla_fp8 cp={cp} n={n} seed={seed}", pool_init, launch)


def quantize_indexer_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """``bench_ops``' indexer quantizing write (cp=1) and the owner filter at cp=2."""
    hd = 128
    for cp in (1, 2):
        bands = Bands(seed)
        gen = torch.Generator().manual_seed(seed)
        locs, num_local = B.scattered(n, torch.device("cpu"), seed)
        if cp == 2:
            page, off = torch.div(locs, PS, rounding_mode="floor"), locs % PS
            locs = torch.stack([(page * 2 + r) * PS + off for r in range(2)], 1).flatten()
        locs = _skipped_kinds(locs, num_local * cp * PS)
        k = bands.put("k", _kv(locs.shape[0], hd, gen).to(dev))
        locs = bands.put("locs", locs.to(dev), poison=(cp - 1) * PS)
        pool_init = _rand_bytes((num_local, PS * (hd + 4)), gen).to(dev)

        def launch(pool, be, k=k, locs=locs, cp=cp, num_local=num_local):
            torch.ops.dtkv.quantize_write_indexer_fp8(pool, k, locs, cp, num_local * cp, 0, cp - 1, PS, cp == 1, False,
                                                      be)  # fmt: skip

        yield _mutating(bands, f"quantize_write_indexer_fp8 cp={cp} n={n} seed={seed}", pool_init, launch)


def _send_idx(n: int, seed: int) -> tuple[int, torch.Tensor]:
    """``bench_ops``' send list of input set ``seed`` (``n / 64`` of a pool's ``2 * n / 64`` pages), with zero rows
    of every kind: ``-1``, one past the pool, far past it."""
    num, lists = B._send_lists(n, torch.device("cpu"), seed + 1)
    idx = lists[seed].clone()
    idx[1::5] = -1
    idx[3::7] = 2 * num
    idx[4::9] = 2 * num + 1000
    return num, idx


def pack_owned_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """``bench_ops``' pack of ``n / 64`` fp8 pages out of a pool twice that size (the op's own output buffer)."""
    bands = Bands(seed)
    gen = torch.Generator().manual_seed(seed)
    num, idx = _send_idx(n, seed)
    pool = bands.put("pool", _rand_bytes((2 * num, PS, 656), gen).to(dev))
    idx = bands.put("send_idx", idx.to(dev), poison=0)

    def run(be: str) -> list[torch.Tensor]:
        return [torch.ops.dtkv.pack_owned_pages(pool, idx, be)]

    yield Case(name=f"pack_owned_pages n={n} seed={seed}", run=run, bands=bands)


def pack_layer_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """``bench_ops``' layer pack (fp8 rows and indexer pages) into preallocated, banded send buffers."""
    bands = Bands(seed)
    gen = torch.Generator().manual_seed(seed)
    num, idx = _send_idx(n, seed)
    pools = [bands.put("mla", _rand_bytes((2 * num, PS, 656), gen).to(dev)),
             bands.put("indexer", _rand_bytes((2 * num, PS * 132), gen).to(dev))]  # fmt: skip
    idx = bands.put("send_idx", idx.to(dev), poison=0)
    outs = [bands.put(f"out{i}", torch.zeros(idx.shape[0], *p.shape[1:], dtype=p.dtype, device=dev))
            for i, p in enumerate(pools)]  # fmt: skip

    def run(be: str) -> list[torch.Tensor]:
        for o in outs:
            o.zero_()
        pack_layer_pages_into(outs, pools, idx, backend=be)
        return [o.clone() for o in outs]

    yield Case(name=f"pack_layer_pages n={n} seed={seed}", run=run, bands=bands)


def remap_cases(dev: torch.device, n: int, seed: int) -> Iterator[Case]:
    """``bench_ops``' top-k remap (int32 ``[n, 64]``) and int64 indices, a page map with every kind of entry."""
    for dtype in (torch.int32, torch.int64):
        bands = Bands(seed)
        gen = torch.Generator().manual_seed(seed)
        num_pages = -(-n // PS) * 4
        page_map = torch.randperm(num_pages, generator=gen).to(torch.int32)
        page_map[::7] = -1
        page_map[1::11] = 0xFFFE + seed  # past the 2-byte copy's range: read in full
        x = torch.randint(-1, num_pages * PS, (n, 64), generator=gen, dtype=torch.int32).to(dtype)
        x.view(-1)[5::13] = num_pages * PS  # one page past the map
        x.view(-1)[6::17] = -PS - 1
        if dtype == torch.int64:
            x.view(-1)[7::19] = 2**32 + 3
        x = bands.put("indices", x.to(dev), poison=0)
        page_map = bands.put("page_map", page_map.to(dev), poison=0)

        def run(be: str, x=x, page_map=page_map) -> list[torch.Tensor]:
            return [torch.ops.dtkv.remap(x, page_map, PS, be)]

        yield Case(name=f"remap {str(dtype).removeprefix('torch.')} n={n} seed={seed}", run=run, bands=bands)


CASES: dict[str, Callable[[torch.device, int, int], Iterator[Case]]] = {
    "write_owned": write_owned_cases,
    "direct_write": direct_write_cases,
    "quantize_write_mla_fp8": quantize_mla_cases,
    "quantize_write_indexer_fp8": quantize_indexer_cases,
    "pack_owned_pages": pack_owned_cases,
    "pack_layer_pages": pack_layer_cases,
    "remap": remap_cases,
}
"""Input builders per ``ops/_tuned.py`` op: ``(device, tokens, seed) -> cases``."""

SIZES = {"cuda": [1, 517, 70001], "cpu": [1, 517]}
"""Tokens per case. 517 = 8 pages + 5 (a partial last page; cp=4: 2068 rows, 33 windows of 64 and 65 of 32, the last
one cut short); 70001 on the GPU (280004 rows: more programs than one wave of an H200)."""

SEEDS = (0, 1, 2)
"""Input sets (``bench_ops``' rotating sets are its seeds; seed 1 also takes a page-strided layer view, odd seeds
int32 locations)."""


def configs(op: str, *, distinct_compiles: bool) -> list[dict]:
    """``op``'s sweep candidates and its defaults, completed from DEFAULTS, each once (``distinct_compiles=False``:
    ``num_warps`` twins once, as the interpreter runs them alike)."""
    out, seen = [], []
    for cand in [{}, *T.CANDIDATES[op]]:
        cfg = T.full(op, cand)
        key = cfg if distinct_compiles else {k: v for k, v in cfg.items() if k != "num_warps"}
        if key not in seen:
            seen.append(key)
            out.append(cfg)
    return out


def check_case(op: str, case: Case, cfgs: list[dict]) -> list[str]:
    """Run ``case`` with each configuration of ``cfgs``; what went wrong, one line per configuration."""
    want = case.run("torch")
    problems = []
    for cfg in cfgs:
        try:
            with _tuned.override(op, **cfg):
                got = case.run("triton")
            if got and got[0].is_cuda:
                torch.cuda.synchronize()
        except AddressError as e:
            problems.append(f"{case.name} {cfg}: {e}")
            continue
        if len(got) != len(want) or not all(B._same(a, b) for a, b in zip(got, want)):
            problems.append(f"{case.name} {cfg}: bytes differ from the torch backend's")
        changed = case.bands.changed()
        if changed:
            problems.append(f"{case.name} {cfg}: guard bands written next to {changed}")
    return problems


def run(
    ops: list[str], dev: torch.device, sizes: list[int], seeds=SEEDS, *, address_check: bool, log=print
) -> list[str]:
    """Every case of ``ops`` with every configuration; the problems found (empty: none)."""
    problems: list[str] = []
    ctx = interpreter_address_check() if address_check else contextlib.nullcontext()
    with ctx:
        for op in ops:
            t0, count = time.perf_counter(), 0
            cfgs = configs(op, distinct_compiles=dev.type == "cuda")
            mine: list[str] = []
            for n in sizes:
                for seed in seeds:
                    for case in CASES[op](dev, n, seed):
                        mine += check_case(op, case, cfgs)
                        count += len(cfgs)
                log(f"  {op} at {n} tokens done ({time.perf_counter() - t0:.1f}s, {len(mine)} problems so far)")
            log(f"{op}: {count} runs ({len(cfgs)} configurations), {len(mine) or 'no'} problems, "
                f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
            for p in mine:
                log(f"  {p}")
            problems += mine
    return problems


# ----------------------------------------------------------------------------------------- the sweep's first crash
def freed_graph_child(keep: bool) -> None:
    """What ended the first H200 sweep, on purpose: the same-size copies of one scenario captured, the name of their
    groups rebound to the next scenario's (freeing the first buffers), the next capture (``torch.cuda.graph``
    empties the allocator's cache: the freed segments are unmapped), then every graph replayed. ``keep=False``
    holds only the graphs, as ``tune_ops`` did (expected: an illegal memory access); ``keep=True`` holds the
    :class:`bench_ops.Replay` objects, as it does now (expected: fine)."""
    dev = torch.device("cuda")
    replays = []
    for _ in range(2):
        groups = B.copy_groups(64 << 20, dev)
        for g in groups:
            r = B.capture(g, dev)
            replays.append(r if keep else r.graph.replay)
        del r
    del groups
    for r in replays:
        r()
        torch.cuda.synchronize()
    print(f"freed-graph {'kept' if keep else 'old'}: {len(replays)} replays ran fine", flush=True)


def freed_graph_repro() -> int:
    """Both patterns of :func:`freed_graph_child`, each in a process of its own; 0 when they behave as expected."""
    import subprocess

    ok = True
    for mode, want_ok in (("old", False), ("kept", True)):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--freed-graph-child", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        last = next((ln for ln in lines if "illegal memory access" in ln), lines[-1] if lines else "")
        print(f"{mode}: exit {proc.returncode}: {last.strip()[:200]}")
        ok &= (proc.returncode == 0) == want_ok
    print("freed-graph repro: " + ("as expected (old pattern fails, kept replays run)" if ok else "NOT as expected"))
    return 0 if ok else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="*", help=f"ops to check (default all: {list(CASES)})")
    ap.add_argument("--tokens", type=int, nargs="*", help=f"sizes (default {SIZES})")
    ap.add_argument("--seeds", type=int, nargs="*", help=f"input sets (default {list(SEEDS)})")
    ap.add_argument("--freed-graph-repro", action="store_true", help="the first sweep's crash, old and new (CUDA)")
    ap.add_argument("--freed-graph-child", choices=["old", "kept"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.freed_graph_child:
        freed_graph_child(args.freed_graph_child == "kept")
        return
    if args.freed_graph_repro:
        raise SystemExit(freed_graph_repro())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if B._backend(dev) != "triton":
        raise SystemExit("no Triton backend here: run on CUDA, or with TRITON_INTERPRET=1")
    ops = args.ops or list(CASES)
    unknown = sorted(set(ops) - set(CASES))
    if unknown:
        raise SystemExit(f"--ops must name ops of {list(CASES)}, got {unknown}")
    problems = run(
        ops, dev, args.tokens or SIZES[dev.type], tuple(args.seeds or SEEDS), address_check=dev.type != "cuda"
    )
    print(f"memcheck_ops: {len(problems)} problem(s) in {ops}")
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
