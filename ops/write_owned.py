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
from ._copy import flat_rows, load_span, needs_int64, row_dst, span_chunks, store_span, vector_words
from ._row_write import (
    RowWriteOp,
    call_row_write,
    check_locs,
    check_rows_contiguous,
    launch_rows,
    owned_rows_torch,
    register_row_write_rule,
)
from ._tuned import launch_config

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
def _flat_chunk(rows_ptr, locs_ptr, first, step, count, num_locs, num_local_pages, page_stride, rank,
                C: tl.constexpr, CW: tl.constexpr, SPAN: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr,
                PAGE_SIZE: tl.constexpr, CP: tl.constexpr, PAGES_PER_RANK: tl.constexpr, SCHEME: tl.constexpr,
                IDX64: tl.constexpr, OFF64: tl.constexpr, ROW_STRIDE: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
    """Words ``[C, C + CW)`` of a flat tile (``ops/_copy.py``): ``(values, destination offsets, keep)``. Each word
    reads its row's location (a few distinct addresses per warp: L1 hits); ``DIRECT`` issues the row words' load
    before the location is known, else only kept rows are read."""
    r, col, valid = flat_rows(first, step, count, C, CW, SPAN, W)
    loc = tl.load(locs_ptr + r, mask=valid, other=-1)
    src = tl.max_contiguous(tl.multiple_of(r * W + col, VEC), VEC)
    if DIRECT:
        v = tl.load(rows_ptr + src, mask=valid, other=0, eviction_policy="evict_first")
    keep, local, off = locate(loc, valid, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64)
    if not DIRECT:
        v = tl.load(rows_ptr + src, mask=keep, other=0, eviction_policy="evict_first")
    dst = tl.max_contiguous(tl.multiple_of(row_dst(local, off, page_stride, ROW_STRIDE, OFF64) + col, VEC), VEC)
    return v, dst, keep


@triton.jit
def _copy_flat(pool_ptr, rows_ptr, locs_ptr, first, step, count, num_locs, num_local_pages, page_stride, rank,
               PAGE_SIZE: tl.constexpr, CP: tl.constexpr, PAGES_PER_RANK: tl.constexpr, SCHEME: tl.constexpr,
               IDX64: tl.constexpr, OFF64: tl.constexpr, ROW_STRIDE: tl.constexpr, W: tl.constexpr,
               CW0: tl.constexpr, CW1: tl.constexpr, CW2: tl.constexpr, CW3: tl.constexpr, VEC: tl.constexpr,
               DIRECT: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """Copy rows ``first + j * step`` (``j < count <= BLOCK_R``) as one flat tile of ``BLOCK_R * W`` words in
    chunks ``CW0..CW3``; every chunk's load is issued before any store."""
    v0, d0, k0 = _flat_chunk(rows_ptr, locs_ptr, first, step, count, num_locs, num_local_pages, page_stride, rank,
                             0, CW0, BLOCK_R * W, W, VEC, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, OFF64,
                             ROW_STRIDE, DIRECT)  # fmt: skip
    v1, d1, k1 = v0, d0, k0
    v2, d2, k2 = v0, d0, k0
    v3, d3, k3 = v0, d0, k0
    if CW1 > 0:
        v1, d1, k1 = _flat_chunk(rows_ptr, locs_ptr, first, step, count, num_locs, num_local_pages, page_stride,
                                 rank, CW0, CW1, BLOCK_R * W, W, VEC, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64,
                                 OFF64, ROW_STRIDE, DIRECT)  # fmt: skip
    if CW2 > 0:
        v2, d2, k2 = _flat_chunk(rows_ptr, locs_ptr, first, step, count, num_locs, num_local_pages, page_stride,
                                 rank, CW0 + CW1, CW2, BLOCK_R * W, W, VEC, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME,
                                 IDX64, OFF64, ROW_STRIDE, DIRECT)  # fmt: skip
    if CW3 > 0:
        v3, d3, k3 = _flat_chunk(rows_ptr, locs_ptr, first, step, count, num_locs, num_local_pages, page_stride,
                                 rank, CW0 + CW1 + CW2, CW3, BLOCK_R * W, W, VEC, PAGE_SIZE, CP, PAGES_PER_RANK,
                                 SCHEME, IDX64, OFF64, ROW_STRIDE, DIRECT)  # fmt: skip
    tl.store(pool_ptr + d0, v0, mask=k0)
    if CW1 > 0:
        tl.store(pool_ptr + d1, v1, mask=k1)
    if CW2 > 0:
        tl.store(pool_ptr + d2, v2, mask=k2)
    if CW3 > 0:
        tl.store(pool_ptr + d3, v3, mask=k3)


@triton.jit
def _copy_tile(pool_ptr, rows_ptr, locs_ptr, first, step, count, num_rows, num_locs, num_local_pages, page_stride,
               rank, PAGE_SIZE: tl.constexpr, CP: tl.constexpr, PAGES_PER_RANK: tl.constexpr, SCHEME: tl.constexpr,
               IDX64: tl.constexpr, OFF64: tl.constexpr, ROW_STRIDE: tl.constexpr, W: tl.constexpr,
               CW0: tl.constexpr, CW1: tl.constexpr, CW2: tl.constexpr, CW3: tl.constexpr,
               BLOCK_R: tl.constexpr):  # fmt: skip
    """Owner filter: copy the kept ones of rows ``first + j * step`` (``j < count``) as a ``[BLOCK_R, W]`` tile."""
    jj = tl.arange(0, BLOCK_R)
    r = first + tl.where(jj < count, jj, 0) * step
    rmask = (jj < count) & (r < num_rows)
    loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
    keep, local, off = locate(loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64)
    v0, v1, v2, v3 = load_span(rows_ptr, r * W, keep, W, CW0, CW1, CW2, CW3)
    dst = row_dst(local, off, page_stride, ROW_STRIDE, OFF64)
    store_span(pool_ptr, dst, keep, v0, v1, v2, v3, W, CW0, CW1, CW2, CW3)


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
    VEC: tl.constexpr,
    FLAT: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program copies a tile of ``BLOCK_R`` rows: a ``[BLOCK_R, W]`` tile in chunks of each row, or with
    ``FLAT`` one flat span of ``BLOCK_R * W`` words (``ops/_copy.py``).

    ``DIRECT`` (every row is normally kept): the rows are read under the row bound alone, so their loads are in
    flight together with the locations' (one memory round trip per tile); only the stores wait for the mask.
    Otherwise (owner filter) only kept rows are read, and a tile with no kept row skips its copy.
    """
    if OFF64:
        r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    else:
        r0 = tl.program_id(0) * BLOCK_R
    r = r0 + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    if FLAT:
        count = tl.minimum(num_rows - r0, BLOCK_R)
        if DIRECT:
            _copy_flat(pool_ptr, rows_ptr, locs_ptr, r0, 1, count, num_locs, num_local_pages, page_stride, rank,
                       PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, OFF64, ROW_STRIDE, W, CW0, CW1, CW2, CW3, VEC,
                       DIRECT, BLOCK_R)  # fmt: skip
        else:
            loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
            keep, _, _ = locate(loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME,
                                IDX64)  # fmt: skip
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                _copy_flat(pool_ptr, rows_ptr, locs_ptr, r0, 1, count, num_locs, num_local_pages, page_stride, rank,
                           PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, OFF64, ROW_STRIDE, W, CW0, CW1, CW2, CW3,
                           VEC, DIRECT, BLOCK_R)  # fmt: skip
    else:
        src = r * W
        if DIRECT:
            v0, v1, v2, v3 = load_span(rows_ptr, src, rmask, W, CW0, CW1, CW2, CW3)
        loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
        keep, local, off = locate(
            loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64
        )
        dst = row_dst(local, off, page_stride, ROW_STRIDE, OFF64)
        if DIRECT:
            store_span(pool_ptr, dst, keep, v0, v1, v2, v3, W, CW0, CW1, CW2, CW3)
        elif tl.max(keep.to(tl.int32), axis=0) > 0:
            v0, v1, v2, v3 = load_span(rows_ptr, src, keep, W, CW0, CW1, CW2, CW3)
            store_span(pool_ptr, dst, keep, v0, v1, v2, v3, W, CW0, CW1, CW2, CW3)


@triton.jit
def _write_owned_window_kernel(
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
    VEC: tl.constexpr,
    FLAT: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Owner filter: program ``t * WINDOW / BLOCK_R + s`` copies the ``s``-th tile of ``BLOCK_R`` kept rows of
    window ``t`` (``WINDOW`` rows; ``WINDOW / BLOCK_R`` programs per window, side by side).

    When the window's kept rows are ``first, first + step, ...`` (a run of whole pages in token order: step 1; every
    ``cp``-th row of a round-robin split: step ``cp``), tile ``s`` is kept rows ``[s * BLOCK_R, (s + 1) * BLOCK_R)``:
    dense tiles, and programs past the last kept row copy nothing. Any other pattern: tile ``s`` is window rows
    ``[s * BLOCK_R, (s + 1) * BLOCK_R)``, masked. Only ``[WINDOW]`` vectors decide it (no ``[BLOCK_R, WINDOW]``
    search), so the copy keeps the registers of a plain tile.
    """
    pid = tl.program_id(0)
    s = pid % (WINDOW // BLOCK_R)  # the programs of a window are consecutive: its locations are read from L2 again
    if OFF64:
        w0 = (pid // (WINDOW // BLOCK_R)).to(tl.int64) * WINDOW
    else:
        w0 = (pid // (WINDOW // BLOCK_R)) * WINDOW
    w = tl.arange(0, WINDOW)
    mw = w0 + w < num_rows
    loc_w = tl.load(locs_ptr + w0 + w, mask=mw, other=-1)
    keep_w, _, _ = locate(loc_w, mw, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64)
    cnt = tl.sum(keep_w.to(tl.int32), axis=0)
    first = tl.min(tl.where(keep_w, w, WINDOW), axis=0)
    last = tl.max(tl.where(keep_w, w, -1), axis=0)
    step = tl.maximum((last - first) // tl.maximum(cnt - 1, 1), 1)
    on_grid = (w >= first) & (w <= last) & ((w - first) % step == 0)
    if tl.sum((on_grid != keep_w).to(tl.int32), axis=0) == 0:  # kept rows: first + i * step, i < cnt
        row0 = w0 + first + s * (BLOCK_R * step)
        count = cnt - s * BLOCK_R
        row_step = step
    else:
        row0 = w0 + s * BLOCK_R
        count = tl.minimum(num_rows - row0, BLOCK_R).to(tl.int32)
        row_step = tl.full((), 1, tl.int32)
    if count > 0:
        if FLAT:
            _copy_flat(pool_ptr, rows_ptr, locs_ptr, row0, row_step, count, num_locs, num_local_pages, page_stride,
                       rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, OFF64, ROW_STRIDE, W, CW0, CW1, CW2, CW3,
                       VEC, False, BLOCK_R)  # fmt: skip
        else:
            _copy_tile(pool_ptr, rows_ptr, locs_ptr, row0, row_step, count, num_rows, num_locs, num_local_pages,
                       page_stride, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, OFF64, ROW_STRIDE, W, CW0,
                       CW1, CW2, CW3, BLOCK_R)  # fmt: skip


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
    variant = cfg["variant"] if owner_filter else "tile"
    if variant not in ("tile", "window"):
        raise ValueError(f"write_owned variant must be 'tile' or 'window', got variant={variant!r}")
    if cfg["layout"] not in ("rows", "flat"):
        raise ValueError(f"{'write_owned' if owner_filter else 'direct_write'} layout must be 'rows' or 'flat', got "
                         f"layout={cfg['layout']!r}")  # fmt: skip
    window = int(cfg["window"]) if variant == "window" else 0
    block_r = min(int(cfg["block_r"]), window) if window else int(cfg["block_r"])
    flat = cfg["layout"] == "flat"
    span = block_r * num_words if flat else num_words
    chunks = span_chunks(span, int(cfg["chunk_w"]))
    vec = vector_words(rows_w.element_size(), num_words, pool_w.stride(0), pool_w.stride(1), *(c for c in chunks if c))
    pool_words = pool_w.shape[0] * pool_w.stride(0) + pool_w.shape[1] * pool_w.stride(1)
    if window:
        kernel, grid, extra = _write_owned_window_kernel, (cdiv(n, window) * (window // block_r),), {"WINDOW": window}
        rows_span = n + window * (window + 1)
    else:
        kernel, grid, extra = _write_owned_kernel, (cdiv(n, block_r),), {"DIRECT": not owner_filter}
        rows_span = n + block_r
    launch_rows(
        kernel, pool_w, rows_w, locs, cp_size, num_pages, scheme_code, rank, pool.shape[1], grid=grid,
        block_r=block_r, num_warps=int(cfg["num_warps"]), ROW_STRIDE=pool_w.stride(1), W=num_words,
        OFF64=needs_int64(rows_span * num_words, pool_words), VEC=vec, FLAT=flat,
        **dict(zip(("CW0", "CW1", "CW2", "CW3"), chunks)), **extra,
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
