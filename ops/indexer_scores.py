"""``dtkv::indexer_scores``: DSA indexer scores of decode queries over the fp8 indexer pages they read, packed as
selection keys, in one kernel.

Entry point: :func:`indexer_scores`; reference :func:`indexer_scores_torch`. Query ``n`` reads the ``L`` pages
``page_ids[n]`` (local rows of a pool of :class:`dtkv.IndexerFp8Layout` pages, ``-1`` padding); page ``l`` holds
the request's logical page ``page_slots[n, l]``, so its token ``t`` sits at position ``page_slots[n, l] * S + t``.
For every such key::

    score[n, s] = sum_i w[n, i] * relu(q[n, i] . k[s])        k[s] = e4m3 codes of token s * its fp32 scale

masked (:data:`dtkv.ops.selection_keys.INVALID_KEY`) where the page is padding or the key is not causal (position >
``query_pos[n]``), and packed with its position into the int64 key of :mod:`dtkv.ops.selection_keys` (score
rounded to float32, ties by position): ``torch.topk`` of the output *is* the selection rule. Output column
``l * S + t`` is token ``t`` of page ``l``.

**Query precision** (``q_fp8``). ``q_fp8=True`` quantizes each (query, head) row of ``q`` to e4m3 with the scale
``amax / 448`` and folds the scale into the head weight (``relu`` is positively homogeneous), as DeepSeek-V3.2's
indexer does: the dot is then fp8 x fp8 on the tensor cores (twice the bf16 rate), which is what keeps the kernel at
memory bandwidth: every key costs ``2 * I * J`` flops for its ``J + 4`` bytes (124 flop/byte at ``I = 64``,
``J = 128``: HBM speed needs ~600 TFLOP/s, beyond what a bf16 dot sustains). The price is e4m3 rounding of the
queries (up to 2**-4 relative per element), so the selection differs from that of unquantized queries at
near-ties. Every mode of a decode step (sharded, full view, replicated) reads other page counts, so other launches
and grids, yet scores a key with the same operations in the same order: a key's bits do not depend on the launch
(the tile, program or grid it lands in) -- under the interpreter by construction (its dot is exact and in one
order, :mod:`dtkv.ops._indexer_kernels`), on a GPU for every launch of :data:`LAUNCH_TABLE` (the sweep admits only
launches whose keys equal the default launch's bitwise; ``benchmarks/bench_indexer_scores.py --check-launches``
checks every launch on awkward shapes) -- so the modes select the same keys.
``q_fp8=False`` keeps ``q`` as given (bf16 for the kernel: bf16 x bf16 dot of the exactly converted codes): the
reference model's formula.

**Tolerance.** The reference dequantizes the keys first (codes x scale, float32, as
:func:`dtkv.ops.dequantize_indexer_pages`) and computes in float32 (float64 when ``q`` is float64: the reference
model's path, bitwise its :func:`dtkv.decode.index_scores`); the kernel applies the key scale after the head sum
and sums in another order. Scores agree to float32 rounding (~1e-6 of the row's largest ``|score|`` under the
interpreter; fp8 tensor-core accumulation on Hopper adds ~2**-13 relative per dot): the positions and masks are
exact, and a selection differs only where two scores are that close.

**Bytes.** Per valid key ``J`` code bytes and 4 scale bytes are read once (8448 per 64-token page at ``J = 128``),
plus 8 bytes written per output column; queries and weights are ``N * I * (J * itemsize + 4)``. Padding pages and
pages wholly past the query are not read (the page kernel reads the rest of a query's last, partial page).

**Launch.** :func:`launch_config` picks the kernel and its parameters (:class:`IndexerLaunch`) from
:data:`LAUNCH_TABLE` by (batch bucket, key bucket), :data:`DEFAULT_LAUNCH` where the table has no entry; the
kernels are in :mod:`dtkv.ops._indexer_kernels`. ``benchmarks/bench_indexer_scores.py`` times the candidates on a
GPU and writes the winners into the table.

Legend: ``N`` queries, ``I`` indexer heads, ``J`` indexer dims, ``P`` local pages, ``S`` page size, ``L`` pages
read per query.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dtkv._checks import check_tensor
from dtkv._util import cdiv
from dtkv.layouts import IndexerFp8Layout

from ._common import INTERPRET, device_ctx, e4m3_blocks_torch, index_arg, resolve_backend
from ._indexer_kernels import indexer_cols_kernel, indexer_pages_kernel
from .selection_keys import selection_keys

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no Triton, or one without host-side TMA descriptors: pointer loads
    TensorDescriptor = None

__all__ = [
    "BATCH_BUCKETS",
    "DEFAULT_LAUNCH",
    "KEY_BUCKETS",
    "LAUNCH_TABLE",
    "IndexerLaunch",
    "indexer_scores",
    "indexer_scores_bytes",
    "indexer_scores_torch",
    "launch_bucket",
    "launch_config",
    "use_launch",
]

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_IDX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------- torch reference
def indexer_scores_torch(
    q: torch.Tensor,  # [N, I, J] bf16/fp16/fp32/fp64
    w: torch.Tensor,  # [N, I] floating
    pool: torch.Tensor,  # uint8 [P, S*(J+4)]
    page_ids: torch.Tensor,  # [N, L] int32/int64, -1 padding
    page_slots: torch.Tensor,  # [N, L] int32/int64, -1 padding
    query_pos: torch.Tensor,  # [N] int32/int64
    page_size: int,
    q_fp8: bool,
) -> torch.Tensor:
    """Reference of :func:`indexer_scores`: gather the pages, dequantize, score, mask, pack (int64 ``[N, L*S]``)."""
    n, _, hd = q.shape
    num_pages = page_ids.shape[1]
    ps = page_size
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    ids = page_ids.to(torch.int64)
    real = (ids >= 0) & (ids < pool.shape[0]) & (page_slots >= 0)
    if pool.shape[0] == 0 or num_pages == 0:  # no page stored or none read: every slot is padding
        keys_NSJ = torch.zeros((n, num_pages * ps, hd), dtype=dtype, device=q.device)
    else:
        pages = pool[torch.where(real, ids, torch.zeros_like(ids))].reshape(n * num_pages, pool.shape[1])
        codes = pages[:, : ps * hd].contiguous().view(torch.float8_e4m3fn).float().view(-1, ps, hd)
        scales = pages[:, ps * hd :].contiguous().view(torch.float32).view(-1, ps, 1)
        keys_NSJ = (codes * scales).reshape(n, num_pages * ps, hd).to(dtype)
    if q_fp8:
        codes_q, scale_q = e4m3_blocks_torch(q.float())
        qx = codes_q.view(torch.float8_e4m3fn).to(dtype)
        wx = w.to(dtype) * scale_q.to(dtype)
    else:
        qx, wx = q.to(dtype), w.to(dtype)
    scores = (torch.relu(torch.einsum("nij,nsj->nis", qx, keys_NSJ)) * wx[:, :, None]).sum(1)
    offsets = torch.arange(ps, device=q.device)
    pos = (page_slots.to(torch.int64)[:, :, None] * ps + offsets).reshape(n, -1)
    valid = real[:, :, None].expand(-1, -1, ps).reshape(n, -1) & (pos <= query_pos.to(torch.int64)[:, None])
    return selection_keys(scores, pos, valid)


# ----------------------------------------------------------------------------------------- launch configuration
_KERNELS = ("pages", "cols")


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexerLaunch:
    """Launch parameters of the Triton kernels (:mod:`dtkv.ops._indexer_kernels`). Every kernel scores a key's
    row with the same operations whatever the tile, so none changes a key's bits under the interpreter (its dot is
    exact, in one order); on a GPU the tensor-core dot is the same instruction sequence per row at
    ``num_warps=4``, and the table holds only launches that the sweep found bitwise equal to the default
    (``imprecise`` does change the bits)."""

    kernel: str = "pages"
    """``"pages"``: one page per tile, the page id loaded once and pipelined ahead; ``"cols"``: the first kernel,
    tiles of ``block_s`` columns gathered column by column (also what pages above 128 tokens get)."""
    tma: bool = False
    """``"pages"``: TMA loads of the codes and scales where the pool allows (a Hopper GPU or the interpreter,
    16-byte aligned pool, page stride and rows; ``cp.async`` pointer loads otherwise). Off by default: the pointer
    loads take fewer instructions and barriers per page in the sm_90 build; the sweep decides per bucket."""
    pages_per_iter: int = 1
    """``"pages"``: pages per loop iteration (their loads issued together)."""
    merge: bool = False
    """``"pages"``: the ``pages_per_iter`` pages of an iteration in one tile of ``pages_per_iter`` x page-size rows
    (one dot and epilogue; ``cp.async`` pointer loads whatever ``tma`` says; 8 warps give 2 pages of 64 one
    warpgroup each)."""
    block_s: int = 64
    """``"cols"``: key columns per tile."""
    num_warps: int = 4
    num_stages: int = 8
    """Software-pipeline stages; with a page id loaded before its tile, Triton gives the tile loads about
    ``num_stages / 2`` iterations of look-ahead (``num_stages=4``: one tile, no overlap within a program)."""
    ctas_per_sm: int = 4
    """Grid target: ``ctas_per_sm`` programs per SM (tiles per program grow to keep the grid near it; a query's
    pages are split over programs when the batch is small)."""
    imprecise: int = 0
    """``max_num_imprecise_acc`` of the fp8 dot (0: Triton's default)."""
    maxnreg: int = 0
    """Register cap per thread (0: the compiler's choice); 96 lets 5 programs of 4 warps share an SM."""

    def __post_init__(self) -> None:
        if self.kernel not in _KERNELS:
            raise ValueError(f"kernel must be one of {_KERNELS}, got kernel={self.kernel!r}")
        for name in ("pages_per_iter", "block_s", "num_warps", "num_stages", "ctas_per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={v!r}")
        if not isinstance(self.maxnreg, int) or isinstance(self.maxnreg, bool) or self.maxnreg < 0:
            raise ValueError(f"maxnreg must be an int >= 0, got maxnreg={self.maxnreg!r}")
        if not isinstance(self.merge, bool) or not isinstance(self.tma, bool):
            raise TypeError(f"merge and tma must be bools, got merge={self.merge!r}, tma={self.tma!r}")
        if self.pages_per_iter & (self.pages_per_iter - 1):
            raise ValueError(f"pages_per_iter must be a power of two, got pages_per_iter={self.pages_per_iter}")
        if self.block_s & (self.block_s - 1) or self.block_s < 16:
            raise ValueError(f"block_s must be a power of two >= 16, got block_s={self.block_s}")


DEFAULT_LAUNCH = IndexerLaunch()
"""What a shape without a :data:`LAUNCH_TABLE` entry gets: page tiles by ``cp.async``, 8 stages (about 4 tiles
in flight per program), 4 programs per SM (about 105 registers and 42 KB of shared memory each at DeepSeek-V3.2
geometry in the sm_90 build: 4 fit an SM)."""

BATCH_BUCKETS: tuple[int, ...] = (1, 4)
"""Upper bounds of the batch buckets (queries per call): ``n <= 1``, ``n <= 4``, more."""
KEY_BUCKETS: tuple[int, ...] = (262144,)
"""Upper bounds of the key buckets (key columns per query, ``L * S``): ``<= 256K``, more."""

# BEGIN LAUNCH_TABLE (benchmarks/bench_indexer_scores.py --apply-table rewrites this block from a sweep)
LAUNCH_TABLE: dict[tuple[int, int], IndexerLaunch] = {
    # 1x131072: default, 1822 GB/s = 38% of 4.8 TB/s (2026-12-01)
    (0, 0): IndexerLaunch(),
    # 1x1048576: pages-cpasync-s8-p1-c3, 3330 GB/s = 69% of 4.8 TB/s (2026-12-01)
    (0, 1): IndexerLaunch(ctas_per_sm=3),
    # 4x131072: pages-cpasync-s6-p1-c4, 2929 GB/s = 61% of 4.8 TB/s (2026-12-01)
    (1, 0): IndexerLaunch(num_stages=6),
    # 16x131072: pages-cpasync-s6-p1-c4, 3710 GB/s = 77% of 4.8 TB/s (2026-12-01)
    (2, 0): IndexerLaunch(num_stages=6),
}
# END LAUNCH_TABLE
"""``(batch bucket, key bucket) -> IndexerLaunch`` measured on one H200 (``--indexer-sweep``); only launches
whose keys are bitwise those of :data:`DEFAULT_LAUNCH` enter it (``bench_indexer_scores.py --check-launches``
re-checks them on awkward shapes), so sharded, full-view and replicated steps (which read different page counts)
select the same keys."""

_FORCED: list[IndexerLaunch] = []


def launch_bucket(num_queries: int, num_keys: int) -> tuple[int, int]:
    """The table cell of a call with ``num_queries`` queries of ``num_keys`` key columns each."""
    b = next((i for i, hi in enumerate(BATCH_BUCKETS) if num_queries <= hi), len(BATCH_BUCKETS))
    k = next((i for i, hi in enumerate(KEY_BUCKETS) if num_keys <= hi), len(KEY_BUCKETS))
    return b, k


def launch_config(num_queries: int, num_keys: int) -> IndexerLaunch:
    """The launch a call of this shape gets: :func:`use_launch`'s if one is active, else the table's cell, else
    :data:`DEFAULT_LAUNCH`."""
    if _FORCED:
        return _FORCED[-1]
    return LAUNCH_TABLE.get(launch_bucket(num_queries, num_keys), DEFAULT_LAUNCH)


@contextlib.contextmanager
def use_launch(cfg: IndexerLaunch) -> Iterator[None]:
    """Every call in the block launches ``cfg`` (benchmarks and tests; eager only: a captured graph keeps the
    launch it recorded)."""
    if not isinstance(cfg, IndexerLaunch):
        raise TypeError(f"cfg must be an IndexerLaunch, got {type(cfg).__name__}")
    _FORCED.append(cfg)
    try:
        yield
    finally:
        _FORCED.pop()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H200's count, so the grids match a GPU's


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, x - 1).bit_length())


def _triton_takes(q: torch.Tensor, pool: torch.Tensor, page_size: int, q_fp8: bool) -> str:
    """Why the kernels cannot take these arguments ('' when they can)."""
    hd = q.shape[2]
    if q.dtype == torch.float64:
        return "q is float64 (the kernel computes in float32)"
    if not q_fp8 and q.dtype == torch.float32:
        return "q is float32 with q_fp8=False (the kernel's dot takes bf16/fp16 queries)"
    if (page_size * hd) % 4 or pool.stride(0) % 4 or pool.storage_offset() % 4:
        return (
            "the scales' byte offsets are not multiples of 4 (page_size * head_dim, the pool's page stride and "
            f"offset must be), got page_size={page_size}, head_dim={hd}, pool.stride()={pool.stride()}, "
            f"pool.storage_offset()={pool.storage_offset()}"
        )
    return ""


def _tma_descriptors(pool: torch.Tensor, page_size: int, hd: int, sp: int, jp: int) -> tuple | None:
    """TMA descriptors of the pool's codes ``[P, S, J]`` and scales ``[P, S]``, or None where TMA cannot read
    it (no descriptor support, a pre-Hopper GPU, no page, 16-byte alignment, boxes over 256)."""
    if TensorDescriptor is None or pool.shape[0] == 0 or max(sp, jp) > 256:
        return None
    if pool.device.type == "cuda" and torch.cuda.get_device_capability(pool.device) < (9, 0):
        return None
    if pool.device.type != "cuda" and not INTERPRET:
        return None
    ps, stride = page_size, pool.stride(0)
    if pool.data_ptr() % 16 or stride % 16 or hd % 16 or (ps * hd) % 16:
        return None
    num = pool.shape[0]
    codes = TensorDescriptor(pool.view(torch.float8_e4m3fn), [num, ps, hd], [stride, hd, 1], [1, sp, jp])
    scales = pool[:, ps * hd :].view(torch.float32)
    return codes, TensorDescriptor(scales, [num, ps], [stride // 4, 1], [1, sp])


def _launch(keys, q, w, pool, page_ids, page_slots, query_pos, page_size: int, q_fp8: bool) -> None:
    n, heads, hd = q.shape
    num_pages = page_ids.shape[1]
    cols = num_pages * page_size
    cfg = launch_config(n, cols)
    target = _num_sms(q.device) * cfg.ctas_per_sm
    q = q if q.stride(2) == 1 else q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    nhp, jp, sp = _pow2_at_least(heads, 16), _pow2_at_least(hd, 32), _pow2_at_least(page_size, 16)
    common = dict(NH=heads, NHP=nhp, J=hd, JP=jp, Q_FP8=q_fp8, PREROUND=INTERPRET, IMPRECISE_ACC=cfg.imprecise,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg or None)  # fmt: skip
    with device_ctx(q.device):
        if cfg.kernel == "pages" and sp * (cfg.pages_per_iter if cfg.merge else 1) <= 256 and sp <= 128:
            per = max(1, cdiv(num_pages * n, target))
            per = cdiv(per, cfg.pages_per_iter) * cfg.pages_per_iter
            desc = _tma_descriptors(pool, page_size, hd, sp, jp) if cfg.tma and not cfg.merge else None
            indexer_pages_kernel[(n, cdiv(num_pages, per))](
                keys, q, w, pool, *(desc or (None, None)), page_ids, page_slots, query_pos,
                num_pages, pool.shape[0], pool.stride(0), q.stride(0), q.stride(1), w.stride(0), per,
                S=page_size, SP=sp, PAGES=cfg.pages_per_iter, MERGE=cfg.merge, NUM_STAGES=cfg.num_stages,
                TMA=desc is not None, **common,
            )  # fmt: skip
            return
        tiles = cdiv(cols, cfg.block_s)
        per = max(1, cdiv(tiles * n, target))
        indexer_cols_kernel[(n, cdiv(tiles, per))](
            keys, q, w, pool, page_ids, page_slots, query_pos,
            cols, num_pages, pool.shape[0], pool.stride(0), q.stride(0), q.stride(1), w.stride(0), per,
            S=page_size, BLOCK_S=cfg.block_s, **common,
        )  # fmt: skip


def _check(q, w, pool, page_ids, page_slots, query_pos, page_size) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3)
    n, heads, hd = q.shape
    dev = q.device
    check_tensor("w", w, dtype=_Q_DTYPES, shape=(n, heads), device=dev)
    check_tensor("pool", pool, dtype=torch.uint8, shape=(None, page_size * (hd + 4)), device=dev)
    if pool.shape[0] and pool.stride(1) != 1:
        raise ValueError(f"pool pages must be contiguous (stride 1 in dim 1), got pool.stride()={pool.stride()}")
    check_tensor("page_ids", page_ids, dtype=_IDX_DTYPES, ndim=2, device=dev)
    if page_ids.shape[0] != n:
        raise ValueError(f"page_ids must have one row per query ({n}), got page_ids.shape={list(page_ids.shape)}")
    check_tensor("page_slots", page_slots, dtype=_IDX_DTYPES, shape=tuple(page_ids.shape), device=dev)
    check_tensor("query_pos", query_pos, dtype=_IDX_DTYPES, shape=(n,), device=dev)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::indexer_scores", mutates_args=())
def _indexer_scores_op(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    page_slots: torch.Tensor,
    query_pos: torch.Tensor,
    page_size: int,
    q_fp8: bool,
    backend: str,
) -> torch.Tensor:
    _check(q, w, pool, page_ids, page_slots, query_pos, page_size)
    ids, slots, qpos = index_arg(page_ids), index_arg(page_slots), index_arg(query_pos)
    if backend != "triton":
        return indexer_scores_torch(q, w, pool, ids, slots, qpos, page_size, q_fp8)
    why = _triton_takes(q, pool, page_size, q_fp8)
    if why:
        raise NotImplementedError(f"backend='triton' for indexer_scores cannot run: {why}; use backend='torch'")
    keys = torch.empty((q.shape[0], ids.shape[1] * page_size), dtype=torch.int64, device=q.device)
    if keys.numel():
        _launch(keys, q, w, pool, ids, slots, qpos, page_size, q_fp8)
    return keys


@_indexer_scores_op.register_fake
def _fake_indexer_scores(q, w, pool, page_ids, page_slots, query_pos, page_size, q_fp8, backend):
    _check(q, w, pool, page_ids, page_slots, query_pos, page_size)
    return q.new_empty((q.shape[0], page_ids.shape[1] * page_size), dtype=torch.int64)


# ----------------------------------------------------------------------------------------- public wrapper
def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    page_ids: torch.Tensor,
    page_slots: torch.Tensor,
    query_pos: torch.Tensor,
    *,
    layout: IndexerFp8Layout,
    q_fp8: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Indexer scores of each query over its pages, packed as selection keys (see the module docstring).

    Run phase: no host synchronization, no data-dependent shapes (CUDA-graph safe).

    Args:
        q: indexer queries ``[N, I, layout.head_dim]`` (bf16/fp16/fp32; float64 on the torch backend), last dim
            contiguous.
        w: head weights ``[N, I]``, floating.
        pool: this rank's indexer pages of one layer, uint8 ``[P, layout.page_size * (layout.head_dim + 4)]``
            (pages contiguous, any page stride).
        page_ids: int32/int64 ``[N, L]`` the local page each query reads in column ``l``; ``-1`` (or ``>= P``)
            is padding.
        page_slots: int32/int64 ``[N, L]`` the request's logical page index of each (its first token is at
            position ``page_slots * page_size``); ``-1`` is padding.
        query_pos: int32/int64 ``[N]`` position of each query: keys after it are masked (``-1``: all masked).
        layout: the pool's layout.
        q_fp8: quantize ``q`` per (query, head) to e4m3 first (the fast path; see the module docstring).
        backend: ``"auto"`` (Triton on CUDA where the kernel takes the arguments, else torch) | ``"torch"`` |
            ``"triton"``.

    Returns:
        int64 ``[N, L * page_size]`` selection keys (``INVALID_KEY`` where masked); column ``l * S + t`` is token
        ``t`` of page ``l``.

    Raises:
        TypeError / ValueError: bad dtypes or shapes, naming the argument.
        NotImplementedError: ``backend="triton"`` with arguments the kernel does not take (float64 ``q``,
            misaligned scales).
    """
    if not isinstance(layout, IndexerFp8Layout):
        raise TypeError(f"layout must be a dtkv.IndexerFp8Layout, got {type(layout).__name__}")
    if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[2] != layout.head_dim:
        raise ValueError(f"q must have shape [*, *, {layout.head_dim}] (layout.head_dim), got {list(q.shape)}")
    be = resolve_backend(backend, q.device)
    if be == "triton" and backend == "auto" and _triton_takes(q, pool, layout.page_size, q_fp8):
        be = "torch"
    return torch.ops.dtkv.indexer_scores(q, w, pool, page_ids, page_slots, query_pos, layout.page_size, q_fp8, be)


def indexer_scores_bytes(*, num_valid_keys: int, num_cols: int, num_queries: int, heads: int, head_dim: int) -> int:
    """HBM bytes one call must move: the valid keys' codes and scales, the output keys, queries and weights
    (bf16 queries): what the GB/s of a benchmark is computed from."""
    return num_valid_keys * (head_dim + 4) + num_cols * 8 + num_queries * heads * (head_dim * 2 + 4)
