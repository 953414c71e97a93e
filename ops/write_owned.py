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

from ._common import OwnershipLike, locate_rows, tl, triton, word_view
from ._row_write import (
    RowWriteOp,
    call_row_write,
    check_locs,
    check_rows_contiguous,
    launch_rows,
    owned_rows_torch,
    register_row_write_rule,
)

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


# ----------------------------------------------------------------------------------------- Triton kernel
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
    ROW_STRIDE: tl.constexpr,
    W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One program copies ``BLOCK_R`` rows, ``BLOCK_W`` words at a time; skipped rows issue no memory traffic.

    A tile with no kept row (three in four under an owner filter at cp=4, since rows arrive in page runs) skips
    its copy loop altogether (measured on an H200: 57-60% -> 71-78% of the copy ceiling for the owner filter).
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    keep, local, off = locate_rows(
        locs_ptr, r, num_rows, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64
    )
    if tl.max(keep.to(tl.int32), axis=0) > 0:
        dst = local * page_stride + off * ROW_STRIDE
        src = r.to(tl.int64) * W
        for c in tl.static_range(0, W, BLOCK_W):
            cols = c + tl.arange(0, BLOCK_W)
            m = keep[:, None] & (cols < W)[None, :]
            v = tl.load(rows_ptr + src[:, None] + cols[None, :], mask=m, eviction_policy="evict_first")
            tl.store(pool_ptr + dst[:, None] + cols[None, :], v, mask=m)


KERNEL_CONFIG: dict[str, int] = {"block_r": 8, "block_w": 128, "num_warps": 4, "filter_block_r": 32}
"""Launch parameters of the row-scatter kernel, swept by ``benchmarks/bench_ops.py`` on an H200
(``benchmarks/results/ops_h200_2026-11-29.md``): ``block_r`` rows per program when every row is kept,
``filter_block_r`` for the owner filter (``0``: ``block_r * cp``, at most 64), ``block_w`` words per step (``0``: the
whole row, up to 256)."""


def _launch(pool, rows, locs, cp_size, num_pages, scheme_code, rank, *, direct: bool) -> None:
    """Launch :func:`_write_owned_kernel` on word views of the pool and the (contiguous) rows."""
    rows = rows.contiguous()
    pool_w = word_view(pool)
    rows_w = word_view(rows)
    if pool_w.dtype != rows_w.dtype:  # e.g. a page stride or an offset that only allows narrower words
        narrow = min(pool_w.dtype, rows_w.dtype, key=lambda d: d.itemsize)
        pool_w, rows_w = pool.view(narrow), rows.view(narrow)
    num_words = rows_w.shape[1]
    block_w = KERNEL_CONFIG["block_w"] or min(triton.next_power_of_2(num_words), 256)
    block_r = KERNEL_CONFIG["block_r"]
    if not direct and cp_size > 1:
        block_r = KERNEL_CONFIG["filter_block_r"] or min(64, block_r * triton.next_power_of_2(cp_size))
    launch_rows(
        _write_owned_kernel, pool_w, rows_w, locs, cp_size, num_pages, scheme_code, rank, pool.shape[1],
        block_r=block_r, num_warps=KERNEL_CONFIG["num_warps"], ROW_STRIDE=pool_w.stride(1), W=num_words,
        BLOCK_W=block_w,
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
