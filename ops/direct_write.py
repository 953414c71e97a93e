"""``dtkv::direct_write``: write this rank's locally computed rows straight into its own pages.

Entry point: :func:`direct_write`. Valid only when the CP split is page-aligned, i.e. each page's tokens were
all computed by its owner (``PageOwnership`` pages handed out whole); then no rank needs the others' rows and the
all-gather before the write disappears. Every target page must be owned by this rank: the op refuses otherwise,
before any byte is written (eager host check; under ``torch.compile`` only with ``DTKV_DEBUG=1``, since the check
synchronizes, while the kernel's mask keeps foreign rows out of the pool regardless).

Legend: ``P`` local pages, ``S`` page size, ``D`` elements per row, ``N`` rows.
"""

from __future__ import annotations

import torch

from ._common import (
    OwnershipLike,
    check_ownership_ints,
    ownership_args,
    resolve_backend,
    should_validate,
)
from ._sharding import dtensor_args, register_pool_rule
from .write_owned import check_row_write, run_row_write, write_owned_torch

__all__ = ["direct_write", "direct_write_torch"]


# ----------------------------------------------------------------------------------------- torch reference
def direct_write_torch(
    pool: torch.Tensor,  # [P, S, D]
    rows: torch.Tensor,  # [N, D], pool.dtype; this rank's rows
    locs: torch.Tensor,  # [N], int32/int64; every page owned by rank (or -1)
    cp_size: int,
    num_pages: int,
    layout_code: int,
    rank: int,
) -> None:
    """Reference: ``pool[local(page), offset] = row`` for every non-``-1`` row (an ``index_put_``).

    Meant for rows already validated as owned; a foreign row is skipped exactly as in
    :func:`dtkv.ops.write_owned_torch`, which this is (the two ops differ in what they promise, not in the store).
    """
    write_owned_torch(pool, rows, locs, cp_size, num_pages, layout_code, rank)


# The Triton kernel is dtkv::write_owned's (``_write_owned_kernel``): the same masked scatter of whole rows.


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::direct_write", mutates_args=("pool",))
def _direct_write_op(
    pool: torch.Tensor,
    rows: torch.Tensor,
    locs: torch.Tensor,
    cp_size: int,
    num_pages: int,
    layout_code: int,
    rank: int,
    validate: bool,
    backend: str,
) -> None:
    run_row_write(pool, rows, locs, cp_size, num_pages, layout_code, rank, validate, backend, direct=True)


@_direct_write_op.register_fake
def _fake_direct_write(pool, rows, locs, cp_size, num_pages, layout_code, rank, validate, backend) -> None:
    check_row_write(pool, rows, locs)
    check_ownership_ints(cp_size, num_pages, layout_code, rank)


# Each rank hands in its own rows: rows and locs are Shard(0) pieces of the chunk.
register_pool_rule(torch.ops.dtkv.direct_write.default, ("shard0", "shard0"))


# ----------------------------------------------------------------------------------------- public wrapper
def direct_write(
    pool: torch.Tensor,
    rows: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    *,
    page_aligned: bool,
    validate: bool | None = None,
    backend: str = "auto",
) -> None:
    """Write this rank's own rows into its own pages (no owner filtering needed, none tolerated).

    Args:
        pool: this rank's pages of one layer, ``[P, S, D]``, rows contiguous; mutated in place. May be a DTensor
            with the ``ownership`` placement (``rank`` then comes from its mesh; plain ``rows``/``locs`` are taken
            as this rank's ``Shard(0)`` piece).
        rows: rows computed on this rank, ``[N, D]``, ``pool.dtype``.
        locs: their logical token locations, int64/int32 ``[N]`` (:mod:`dtkv.page_table`); ``-1`` skipped.
        ownership: the page map (``PageOwnership`` or ``OwnershipSpec``); ``rank``: this rank.
        page_aligned: the caller's statement that the CP split hands out whole pages (each page computed by its
            owner). ``False`` is refused: use :func:`dtkv.ops.write_owned` on the gathered chunk instead.
        validate: check on the host that every location is in range and on a page owned by ``rank`` (one sync;
            raises with the pool untouched). ``None``: in eager yes; compiled only with ``DTKV_DEBUG=1``
            (otherwise foreign or out-of-range rows are silently skipped, with no sync).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``, as for :func:`dtkv.ops.write_owned`.

    Raises:
        ValueError: ``page_aligned`` is False, or a (validated) location is out of range or on a foreign page.
        TypeError / ValueError: bad dtype, shape or device. Nothing is written in any of these cases.
    """
    if page_aligned is not True:
        raise ValueError(
            f"direct_write needs a page-aligned CP split (each page computed by its owner), got "
            f"page_aligned={page_aligned!r}; gather the chunk and use write_owned instead"
        )
    pool, (rows, locs), rank = dtensor_args(pool, (rows, locs), ownership, rank, "shard0")
    cp_size, num_pages, code = ownership_args(ownership)
    torch.ops.dtkv.direct_write(
        pool, rows, locs, cp_size, num_pages, code, rank, should_validate(validate),
        resolve_backend(backend, pool.device),
    )  # fmt: skip
