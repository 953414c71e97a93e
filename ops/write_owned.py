"""``dtkv::write_owned``: owner-filtered scatter of a chunk's rows into this rank's local page pool.

Entry point: :func:`write_owned`. Every rank receives the *full* chunk (e.g. after an all-gather of a
token-balanced CP split) with the logical token location of each row (``loc = page * page_size + offset``, see
:mod:`dtkv.page_table`); each rank keeps only the rows whose page it owns, so every page is stored once. With
``direct=True`` the rows are this rank's own rows of a page-aligned split instead (:func:`dtkv.ops.direct_write`
is that call); the store is the same masked scatter of whole rows. Checks, ``locs`` normalization and dispatch
are the row writes' shared prologue (``ops/_row_write.py``).

Legend: ``P`` local pages, ``S`` page size, ``D`` elements per row, ``W`` words per row, ``N`` rows.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor

from ._common import OwnershipLike, cdiv, locate, tl, triton, word_view
from ._copy import load_span, needs_int64, row_dst, span_chunks, store_span
from ._row_write import (
    RowWriteOp,
    call_row_write,
    check_locs,
    check_rows_contiguous,
    launch_rows,
    owned_rows_torch,
    register_row_write_rule,
)
from ._tuned import launch_config, num_sms

__all__ = ["write_owned", "write_owned_torch"]


# ----------------------------------------------------------------------------------------- torch reference
def write_owned_torch(
    pool: torch.Tensor,  # [P, S, D], any page/row stride, last dim contiguous
    rows: torch.Tensor,  # [N, D], pool.dtype
    locs: torch.Tensor,  # [N], int32/int64, -1 = skip
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
) -> None:
    """Reference: ``pool[local(page), offset] = row`` for rows whose page ``rank`` owns (an ``index_put_``).

    Rows at ``-1``, out of range, or on foreign pages are skipped. Synchronizes on CUDA (boolean selection).
    Duplicate locations: which row lands is unspecified (as for ``index_put_``).
    """
    sel, local, off = owned_rows_torch(locs, pool.shape[1], cp_size, num_pages, scheme_code, rank, pool.shape[0])
    pool.index_put_((local, off), rows[sel])


# ----------------------------------------------------------------------------------------- Triton kernels
@triton.jit
def _write_owned_kernel(
    pool_ptr,  # [P, S, W] words; page stride page_stride, row stride ROW_STRIDE
    rows_ptr,  # [N, W] words, contiguous
    locs_ptr,  # [N], int32/int64, contiguous
    num_rows,
    num_local_pages,
    page_stride,
    num_locs,
    rank,
    PAGE_SIZE: tl.constexpr,
    CP: tl.constexpr,
    PAGES_PER_RANK: tl.constexpr,
    SCHEME: tl.constexpr,
    IDX64: tl.constexpr,
    OFF64: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    W: tl.constexpr,
    CW0: tl.constexpr,
    CW1: tl.constexpr,
    CW2: tl.constexpr,
    CW3: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program copies a tile of ``BLOCK_R`` rows (chunks of ``ops/_copy.py``).

    ``DIRECT`` (every row is normally kept): the rows are read under the row bound alone, so their loads are in
    flight together with the locations' (one memory round trip per tile); only the stores wait for the mask.
    Otherwise (owner filter) only kept rows are read, and a tile with no kept row skips its copy.
    """
    if OFF64:
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    else:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    src = r * W
    if DIRECT:
        v0, v1, v2, v3 = load_span(rows_ptr, src, rmask, W, CW0, CW1, CW2, CW3)
    loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
    keep, local, off = locate(loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64)
    dst = row_dst(local, off, page_stride, ROW_STRIDE, OFF64)
    if DIRECT:
        store_span(pool_ptr, dst, keep, v0, v1, v2, v3, W, CW0, CW1, CW2, CW3)
    elif tl.max(keep.to(tl.int32), axis=0) > 0:
        v0, v1, v2, v3 = load_span(rows_ptr, src, keep, W, CW0, CW1, CW2, CW3)
        store_span(pool_ptr, dst, keep, v0, v1, v2, v3, W, CW0, CW1, CW2, CW3)


@triton.jit
def _write_owned_compact_kernel(
    pool_ptr,  # [P, S, W] words; page stride page_stride, row stride ROW_STRIDE
    rows_ptr,  # [N, W] words, contiguous
    locs_ptr,  # [N], int32/int64, contiguous
    num_rows,
    num_local_pages,
    page_stride,
    num_locs,
    rank,
    PAGE_SIZE: tl.constexpr,
    CP: tl.constexpr,
    PAGES_PER_RANK: tl.constexpr,
    SCHEME: tl.constexpr,
    IDX64: tl.constexpr,
    OFF64: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    W: tl.constexpr,
    CW0: tl.constexpr,
    CW1: tl.constexpr,
    CW2: tl.constexpr,
    CW3: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Owner filter: each program takes windows of ``WINDOW`` rows (``pid``, ``pid + grid``, ...) and copies only
    their kept rows, gathered into dense tiles of ``BLOCK_R`` rows.

    The ``j``-th kept row of a window is row ``#{w : incl[w] <= j}`` (``incl`` the inclusive count of kept rows),
    or ``first + j`` when the kept rows form one run (rows in token order: whole pages). So a round-robin split,
    where every tile of consecutive rows keeps a few, still copies full tiles. The next window's locations are
    loaded before the current window's rows are copied (a persistent grid hides that latency).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    w = tl.arange(0, WINDOW)
    jj = tl.arange(0, BLOCK_R)
    if OFF64:
        nxt = pid.to(tl.int64) * WINDOW + w
    else:
        nxt = pid * WINDOW + w
    loc_next = tl.load(locs_ptr + nxt, mask=nxt < num_rows, other=-1)
    for t in range(pid, tl.cdiv(num_rows, WINDOW), nprog):
        if OFF64:
            w0 = tl.cast(t, tl.int64) * WINDOW
        else:
            w0 = t * WINDOW
        loc_w = loc_next
        nxt = w0 + nprog * WINDOW + w
        loc_next = tl.load(locs_ptr + nxt, mask=nxt < num_rows, other=-1)
        keep_w, _, _ = locate(
            loc_w, w0 + w < num_rows, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64
        )
        k = keep_w.to(tl.int32)
        cnt = tl.sum(k, axis=0)
        first = tl.min(tl.where(keep_w, w, WINDOW), axis=0)
        run = tl.max(tl.where(keep_w, w, -1), axis=0) - first + 1 == cnt
        incl = tl.cumsum(k, axis=0)
        for s in range(0, cnt, BLOCK_R):
            j = s + jj
            if run:
                rj = first + j
            else:
                rj = tl.sum((incl[None, :] <= j[:, None]).to(tl.int32), axis=1)
            r = tl.where(j < cnt, w0 + rj, num_rows)
            rmask = r < num_rows
            loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
            keep, local, off = locate(
                loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64
            )
            v0, v1, v2, v3 = load_span(rows_ptr, r * W, keep, W, CW0, CW1, CW2, CW3)
            dst = row_dst(local, off, page_stride, ROW_STRIDE, OFF64)
            store_span(pool_ptr, dst, keep, v0, v1, v2, v3, W, CW0, CW1, CW2, CW3)


def _launch(pool, rows, locs, cp_size, num_pages, scheme_code, rank, *, direct: bool) -> None:
    """Launch a row-copy kernel on word views of the pool and the (contiguous) rows, configured by
    ``ops/_tuned.py`` (``"write_owned"`` for the owner filter at cp > 1, ``"direct_write"`` otherwise)."""
    rows = rows.contiguous()
    pool_w = word_view(pool)
    rows_w = word_view(rows)
    if pool_w.dtype != rows_w.dtype:  # e.g. a page stride or an offset that only allows narrower words
        narrow = min(pool_w.dtype, rows_w.dtype, key=lambda d: d.itemsize)
        pool_w, rows_w = pool.view(narrow), rows.view(narrow)
    n, num_words = rows_w.shape
    if n == 0 or pool.shape[0] == 0:
        return
    owner_filter = not direct and cp_size > 1
    cfg = launch_config("write_owned" if owner_filter else "direct_write", n, pool.device)
    chunks = dict(zip(("CW0", "CW1", "CW2", "CW3"), span_chunks(num_words, int(cfg["chunk_w"]))))
    pool_words = pool_w.shape[0] * pool_w.stride(0) + pool_w.shape[1] * pool_w.stride(1)
    if owner_filter and cfg["variant"] == "compact":
        window = int(cfg["window"])
        grid = cdiv(n, window)
        if cfg["programs_per_sm"]:
            grid = min(grid, int(cfg["programs_per_sm"]) * num_sms(pool.device))
        # num_stages=1: no software pipelining of the window loop (its loads would be staged through shared
        # memory, which costs occupancy; the next window's locations are prefetched by hand instead)
        kernel, extra = _write_owned_compact_kernel, {"WINDOW": window, "grid": grid, "num_stages": 1}
        rows_span = n + 2 * grid * window
        block_r = min(int(cfg["block_r"]), window)
    elif not owner_filter or cfg["variant"] == "tile":
        block_r = int(cfg["block_r"])
        kernel, extra = _write_owned_kernel, {"DIRECT": not owner_filter}
        rows_span = n + block_r
    else:
        raise ValueError(f"write_owned variant must be 'tile' or 'compact', got variant={cfg['variant']!r}")
    launch_rows(
        kernel, pool_w, rows_w, locs, cp_size, num_pages, scheme_code, rank, pool.shape[1],
        block_r=block_r, num_warps=int(cfg["num_warps"]), ROW_STRIDE=pool_w.stride(1), W=num_words,
        OFF64=needs_int64(rows_span * num_words, pool_words), **chunks, **extra,
    )  # fmt: skip


def _check(pool: torch.Tensor, rows: torch.Tensor, locs: torch.Tensor) -> int:
    check_tensor("pool", pool, ndim=3)
    check_rows_contiguous(pool, 2, "rows")
    check_tensor("rows", rows, dtype=pool.dtype, shape=(None, pool.shape[2]), device=pool.device)
    check_locs(locs, rows.shape[0], pool.device)
    return pool.shape[1]


_ROW_WRITE = RowWriteOp(check=_check, torch_impl=write_owned_torch, triton_impl=_launch)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::write_owned", mutates_args=("pool",))
def _write_owned_op(
    pool: torch.Tensor,
    rows: torch.Tensor,
    locs: torch.Tensor,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    direct: bool,
    validate: bool,
    backend: str,
) -> None:
    _ROW_WRITE.run(pool, rows, locs, cp_size, num_pages, scheme_code, rank, direct=direct, validate=validate,
                   backend=backend)  # fmt: skip


@_write_owned_op.register_fake
def _fake_write_owned(pool, rows, locs, cp_size, num_pages, scheme_code, rank, direct, validate, backend) -> None:
    _ROW_WRITE.fake(pool, rows, locs, cp_size, num_pages, scheme_code, rank)


register_row_write_rule(torch.ops.dtkv.write_owned.default, "rows")


# ----------------------------------------------------------------------------------------- public wrapper
def write_owned(
    pool: torch.Tensor,
    rows: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    *,
    direct: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
) -> None:
    """Write the rows whose logical page ``rank`` owns into its local pool; skip the others.

    Args:
        pool: this rank's pages of one layer, ``[P, S, D]`` (``P >= ownership.num_local_pages(rank)``, ``S`` the
            page size), any dtype; any page/row stride as long as each row is contiguous (e.g. a view
            ``buffer[layer]``). Mutated in place. May be a DTensor with the ``ownership`` placement (then
            ``rank`` is taken from its mesh and ``rows``/``locs`` are treated as replicated, or as this rank's
            ``Shard(0)`` piece when ``direct``).
        rows: the full chunk, ``[N, D]``, ``pool.dtype``, same device (this rank's own rows when ``direct``).
        locs: logical token locations (:mod:`dtkv.page_table`), int64/int32 ``[N]``, any strides; ``-1`` rows
            are skipped.
        ownership: the page map (a :class:`dtkv.PageOwnership` or an :class:`OwnershipSpec`, which compiles on
            every torch version); ``rank``: this rank in ``[0, cp_size)``.
        direct: ``False``: owner filter (foreign rows skipped). ``True``: a compute-owner direct write of a
            page-aligned split (every target page must be owned by ``rank``; a validated foreign page raises).
        validate: check ``locs`` on the host before writing (one sync; raises, pool untouched). ``None``: in
            eager yes; under ``torch.compile`` only with ``DTKV_DEBUG=1``. Unvalidated, exactly the rows that
            validation would refuse are skipped (out of range, foreign under ``direct``).
        backend: ``"auto"`` (Triton on CUDA when available, else torch; honours ``DTKV_BACKEND``),
            ``"torch"`` (``index_put_`` reference, synchronizes) or ``"triton"``.

    Raises:
        TypeError / ValueError: bad dtype, shape, device, ownership or (validated) location; nothing written.
        NotImplementedError: ``backend="triton"`` without Triton (or on CPU without ``TRITON_INTERPRET=1``).
    """
    call_row_write(torch.ops.dtkv.write_owned, pool, rows, locs, ownership, rank, (), direct=direct,
                   validate=validate, backend=backend)  # fmt: skip
