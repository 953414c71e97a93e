"""Independent references for the ``dtkv.ops`` tests: loops over rows and pages, built only on
:class:`dtkv.PageOwnership`'s own map and on a table-driven e4m3 rounding (no code shared with ``ops/``).

Also the parametrization helpers: ``BACKENDS`` (torch, and Triton where it can run: CUDA, or CPU under
``TRITON_INTERPRET=1``), ``DEVICES`` (cpu, and cuda when present), :func:`covering` (a product of axes whose
quick subset is a covering cut); :func:`benchmark` (a script of
``benchmarks/`` as a module) and :func:`address_check` (its interpreter out-of-bounds check).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership

try:
    import triton  # noqa: F401

    _HAS_TRITON = True
except ImportError:  # pragma: no cover
    _HAS_TRITON = False

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def backend_ok(backend: str, device: str) -> bool:
    if backend == "torch":
        return True
    return _HAS_TRITON and (device == "cuda" or _INTERPRET)


def skip_unless(backend: str, device: str) -> None:
    if not backend_ok(backend, device):
        pytest.skip(f"backend={backend} cannot run on {device} here (Triton missing, or CPU without interpreter)")


BACKENDS = ["torch", "triton"]


def covering(**axes: dict[str, object]) -> list:
    """Every combination of ``axes`` (name -> {id: value}) as ``pytest.param``, in the order of ``axes``; those
    outside a covering subset are marked ``slow``. The quick subset keeps the combinations whose axis indices sum
    to a multiple of the last axis's length (a Latin-square cut): every value of every axis still occurs, and, for
    the axes below, every pair of values of any two axes; the full suite runs the whole product."""
    names = list(axes)
    cut = len(axes[names[-1]])
    out = [()]
    for name in names:
        out = [(*c, (i, k, v)) for c in out for i, (k, v) in enumerate(axes[name].items())]
    return [
        pytest.param(
            *(v for _, _, v in c),
            id="-".join(k for _, k, _ in c),
            marks=() if sum(i for i, _, _ in c) % cut == 0 else pytest.mark.slow,
        )  # fmt: skip
        for c in out
    ]


@functools.cache
def benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules``, so its dataclasses resolve)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def address_check() -> contextlib.AbstractContextManager:
    """Under the Triton interpreter, every load and store of the kernels run inside the block must touch only their
    tensor arguments' bytes (``benchmarks/memcheck_ops.py``: the interpreter's compute-sanitizer); elsewhere a no-op
    (on a GPU, ``compute-sanitizer`` does it)."""
    if not (_HAS_TRITON and _INTERPRET):
        return contextlib.nullcontext()
    return benchmark("memcheck_ops").interpreter_address_check()


# ----------------------------------------------------------------------------------------- rows and pages
def ref_write_rows(pool: torch.Tensor, rows: torch.Tensor, locs: torch.Tensor, own: PageOwnership, rank: int):
    """Row by row: ``pool[local, offset] = row`` when the page is owned by ``rank``; returns the new pool."""
    out = pool.clone()
    ps = pool.shape[1]
    for i, loc in enumerate(locs.tolist()):
        if loc < 0:
            continue
        page = loc // ps
        if own.owner(page) == rank:
            out[own.local_index(page), loc % ps] = rows[i]
    return out


def ref_gathered(full: torch.Tensor, pages: list[int], own: PageOwnership):
    """Owner-major gathered buffer of a logical pool ``full`` for a page list, plus ``page_map`` and ``rows``."""
    seen: list[int] = []
    for p in pages:
        if p >= 0 and p not in seen:
            seen.append(p)
    per_rank = [[p for p in seen if own.owner(p) == r] for r in range(own.cp_size)]
    rows_per_rank = max((len(x) for x in per_rank), default=0)
    buf = torch.zeros((own.cp_size * rows_per_rank, *full.shape[1:]), dtype=full.dtype)
    page_map = [-1] * own.num_pages
    for r, lst in enumerate(per_rank):
        for j, p in enumerate(lst):
            buf[r * rows_per_rank + j] = full[p]
            page_map[p] = r * rows_per_rank + j
    rows = [page_map[p] if p >= 0 else -1 for p in pages]
    return buf, rows_per_rank, page_map, rows


def ref_remap(indices: torch.Tensor, page_map: list[int], page_size: int) -> torch.Tensor:
    out = []
    for x in indices.flatten().tolist():
        page = x // page_size if x >= 0 else -1
        m = page_map[page] if 0 <= page < len(page_map) else -1
        out.append(m * page_size + x % page_size if m >= 0 else -1)
    return torch.tensor(out, dtype=indices.dtype).view(indices.shape)


# ----------------------------------------------------------------------------------------- fp8
_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def ref_e4m3(y: np.ndarray) -> np.ndarray:
    """Round float32 values (``|y| <= 448``) to e4m3fn bits by table search, ties to the even code."""
    vals = _E4M3.numpy()
    finite = np.isfinite(vals)
    codes = np.nonzero(finite)[0]
    table = vals[codes]
    y64 = np.asarray(y, dtype=np.float64).ravel()
    d = np.abs(table[None, :] - y64[:, None])
    cand = d == d.min(axis=1, keepdims=True)
    even = (codes % 2 == 0)[None, :]
    sign_match = (codes >= 128)[None, :] == np.signbit(y64)[:, None]
    score = cand * (1 + 2 * even + sign_match)  # ties: the even code, then (for +-0) the sign of y
    out = codes[score.argmax(axis=1)].astype(np.uint8)
    return out.reshape(np.shape(y))


def ref_quantize_block(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One block (float32 values): e4m3 bits of ``x * (448 / amax)`` and ``s = amax / 448``, float32 arithmetic."""
    x = x.astype(np.float32)
    amax = np.float32(np.abs(x).max())
    s = amax / np.float32(448.0)
    y = x * (np.float32(448.0) / amax if amax > 0 else np.float32(1.0))
    return ref_e4m3(np.clip(y, -448, 448)), np.float32(s)


def ref_mla_row(kv_row: torch.Tensor, layout: MLAFp8Layout) -> torch.Tensor:
    """The fp8 row bytes of one input row (uint8 ``[row_bytes]``)."""
    L, qb = layout.kv_lora_rank, layout.quant_block
    x = kv_row.float().numpy()
    out = np.zeros(layout.row_bytes, dtype=np.uint8)
    for b in range(layout.num_scales):
        q, s = ref_quantize_block(x[b * qb : (b + 1) * qb])
        out[b * qb : (b + 1) * qb] = q
        out[L + 4 * b : L + 4 * b + 4] = np.frombuffer(np.float32(s).tobytes(), dtype=np.uint8)
    rope = kv_row[L:].to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    out[layout.rope_offset :] = rope
    return torch.from_numpy(out)


def ref_indexer_write(pool, k, locs, own: PageOwnership, rank: int, layout: IndexerFp8Layout) -> torch.Tensor:
    """Token by token: e4m3 key bytes at ``t*H`` and the fp32 scale at ``S*H + 4t`` of each owned page."""
    out = pool.clone()
    ps, hd = layout.page_size, layout.head_dim
    for i, loc in enumerate(locs.tolist()):
        if loc < 0 or own.owner(loc // ps) != rank:
            continue
        page, t = own.local_index(loc // ps), loc % ps
        q, s = ref_quantize_block(k[i].float().numpy())
        out[page, t * hd : (t + 1) * hd] = torch.from_numpy(q)
        out[page, ps * hd + 4 * t : ps * hd + 4 * t + 4] = torch.from_numpy(
            np.frombuffer(np.float32(s).tobytes(), dtype=np.uint8).copy()
        )
    return out


def scattered_locs(num_pages: int, page_size: int, n: int, *, seed: int = 0, pad_every: int = 0) -> torch.Tensor:
    """``n`` distinct token locations over shuffled pages (a partial last page when ``n % page_size``)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=g)
    t = torch.arange(n)
    locs = pages[t // page_size] * page_size + t % page_size
    if pad_every:
        locs[::pad_every] = -1
    return locs


def spread_rows(n: int, dim: int, dtype: torch.dtype, *, seed: int = 0, neg_zero_col: int = 1) -> torch.Tensor:
    """Rows spanning 9 decades, an all-zero last row with a -0.0: subnormals, ties and the zero scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * 10 ** torch.empty(n, 1).uniform_(-6, 3, generator=g)
    if n > 1:
        x[-1] = 0.0
        x[-1, neg_zero_col] = -0.0
    return x.to(dtype)


def layer_pools(num_local: int, seed: int, kinds) -> list[torch.Tensor]:
    """Pools of one layer out of layered buffers ``[3, P, ...]`` (page stride != page size), one per kind."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fp8-row": ((5, 656), torch.uint8), "bf16-row": ((3, 24), torch.bfloat16),
              "indexer": ((4 * 132,), torch.uint8), "odd": ((7,), torch.uint8)}  # fmt: skip
    pools = []
    for kind in kinds:
        shape, dtype = shapes[kind]
        raw = torch.randint(0, 256, (3, num_local, *shape[:-1], shape[-1] * dtype.itemsize), generator=g,
                            dtype=torch.uint8)  # fmt: skip
        pools.append(raw.view(dtype)[1])
    return pools


def snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    a8, b8 = (t.detach().cpu().contiguous().reshape(t.shape or (1,)).view(torch.uint8) for t in (a, b))  # 0-dim too
    if not torch.equal(a8, b8):
        diff = (a8 != b8).nonzero()
        raise AssertionError(f"{msg} byte mismatch at {diff[:5].tolist()} ({diff.shape[0]} bytes)")


# ----------------------------------------------------------------------------------------- compile
_PLACEMENT_COMPILES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)

OWNERSHIP_KINDS = [
    pytest.param(
        "placement",
        id="PageOwnership",
        marks=pytest.mark.skipif(
            not _PLACEMENT_COMPILES, reason="torch < 2.13 Dynamo cannot guard on Placement subclasses (EQUALS_MATCH)"
        ),
    ),
    pytest.param("spec", id="OwnershipSpec"),
]


def as_kind(own: PageOwnership, kind: str):
    """``own`` itself, or its :class:`dtkv.ops.OwnershipSpec`."""
    from dtkv.ops import ownership_spec

    return own if kind == "placement" else ownership_spec(own)
