"""Direct writes of plain rows: this rank's locally computed rows go straight into its own pages.

Entry point: :func:`direct_write`, the plain-row convenience for ``write_owned(..., direct=True)``; the quantizing
writes take the same ``direct=True`` switch. Valid only when the CP split is page-aligned, i.e. each page's tokens
were all computed by its owner (``PageOwnership`` pages handed out whole); then no rank needs the others' rows and
the all-gather before the write disappears. Every target page must be owned by this rank: the op refuses
otherwise, before any byte is written (eager host check; under ``torch.compile`` only with ``DTKV_DEBUG=1``,
since the check synchronizes, while the kernel's mask keeps foreign rows out of the pool regardless).

There is no separate registered op or kernel: the call is ``dtkv::write_owned`` with ``direct=True`` (the same
masked scatter of whole rows, Triton kernel ``_write_owned_kernel``; only validation and the sharding of
``rows``/``locs`` differ).

Legend: ``P`` local pages, ``S`` page size, ``D`` elements per row, ``N`` rows.
"""

from __future__ import annotations

import torch

from ._common import OwnershipLike
from .write_owned import write_owned, write_owned_torch

__all__ = ["direct_write", "direct_write_torch"]


# ----------------------------------------------------------------------------------------- torch reference
def direct_write_torch(
    pool: torch.Tensor,  # [P, S, D]
    rows: torch.Tensor,  # [N, D], pool.dtype; this rank's rows
    locs: torch.Tensor,  # [N], int32/int64; every page owned by rank (or -1)
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
) -> None:
    """Reference: ``pool[local(page), offset] = row`` for every non-``-1`` row (an ``index_put_``).

    Meant for rows already validated as owned; a foreign row is skipped exactly as in ``write_owned_torch``
    (``ops/write_owned.py``), which this is (a direct write differs in what it promises, not in the store).
    """
    write_owned_torch(pool, rows, locs, cp_size, num_pages, scheme_code, rank)


# ----------------------------------------------------------------------------------------- public wrapper
def direct_write(
    pool: torch.Tensor,
    rows: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    *,
    validate: bool | None = None,
    backend: str = "auto",
) -> None:
    """Write this rank's own rows into its own pages: ``write_owned(..., direct=True)``.

    Args:
        pool: this rank's pages of one layer, ``[P, S, D]``, rows contiguous; mutated in place. May be a DTensor
            with the ``ownership`` placement (``rank`` then comes from its mesh; plain ``rows``/``locs`` are taken
            as this rank's ``Shard(0)`` piece).
        rows: rows computed on this rank, ``[N, D]``, ``pool.dtype``.
        locs: their logical token locations, int64/int32 ``[N]`` (:mod:`dtkv.page_table`), any strides; ``-1``
            skipped.
        ownership: the page map (``PageOwnership`` or ``OwnershipSpec``); ``rank``: this rank.
        validate: check on the host that every location is in range and on a page owned by ``rank`` (one sync;
            raises with the pool untouched). ``None``: in eager yes; compiled only with ``DTKV_DEBUG=1``
            (otherwise foreign or out-of-range rows are silently skipped, with no sync).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``, as for :func:`dtkv.ops.write_owned`.

    Raises:
        ValueError: a (validated) location is out of range or on a foreign page.
        TypeError / ValueError: bad dtype, shape or device. Nothing is written in any of these cases.
    """
    write_owned(pool, rows, locs, ownership, rank, direct=True, validate=validate, backend=backend)
