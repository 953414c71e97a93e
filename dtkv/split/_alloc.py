"""Owner-aware allocation of a split's extend pages: storage owner = compute owner where the split allows it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dtkv._checks import check_tensor
from dtkv._util import cdiv
from dtkv.allocator import AllocationError, PageAllocator
from dtkv.ownership import PageOwnership
from dtkv.split._compute import (
    _INTEGER_DTYPES,
    compute_owners,
    handoff_pages,
    local_locs,
    verify_direct_write,
)
from dtkv.split._plan import CPSplit

__all__ = ["SplitAllocation", "allocate_for_split"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SplitAllocation:
    """Result of :func:`allocate_for_split`: the page table of the batch after the extend's pages were taken."""

    split: CPSplit
    """The plan the pages were allocated for."""
    ownership: PageOwnership
    """The allocator's page map."""
    req_pages: torch.Tensor = field(repr=False)
    """int64 CPU ``[num_reqs, max_pages]``, ``-1`` padded: prefix pages as given, then the new pages."""
    new_pages: tuple[torch.Tensor, ...] = field(repr=False)
    """Per request, int64 CPU ``[k_i]``: the pages allocated now, in slot order (the partly filled first page
    of a prefix ending mid-page is not among them: it already exists)."""

    def handoff_pages(self, rank: int, req_idx: int | None = None) -> torch.Tensor:
        """Pages ``rank`` computes but does not store (:func:`dtkv.split.handoff_pages`)."""
        return handoff_pages(self.split, rank, self.req_pages, self.ownership, req_idx=req_idx)

    def verify_direct_write(self, rank: int, req_idx: int | None = None) -> bool:
        """:func:`dtkv.split.verify_direct_write` on this page table."""
        return verify_direct_write(self.split, rank, self.req_pages, self.ownership, req_idx=req_idx)

    def local_locs(self, rank: int) -> torch.Tensor:
        """:func:`dtkv.split.local_locs` on this page table (int64 CPU ``[local num_tokens]``)."""
        return local_locs(self.split, rank, self.req_pages)


def allocate_for_split(
    allocator: PageAllocator, split: CPSplit, req_pages: torch.Tensor | None = None
) -> SplitAllocation:
    """Allocate the pages of every request's extend so that compute owner = storage owner (SPMD, plan phase).

    Slots ``ceil(prefix_len / page_size)`` up to ``ceil((prefix_len + extend_len) / page_size)`` get new pages.
    For a page-aligned request each comes from its compute owner (``allocator.alloc(owners)``), which is what
    makes direct writes possible; every other request (fallback, round_robin, ``page_aligned=False``) gets
    ``allocator.alloc_balanced``. A prefix ending mid-page keeps its partly filled page and that page's owner:
    when it is not rank 0 (which computes segment 0), the page is a handoff page of rank 0
    (:meth:`SplitAllocation.handoff_pages`). Every rank must make the same calls in the same order.

    A compute owner with too few free pages -- a rank that stores no page at all (``block`` scheme with
    ``cp=8`` and 49 pages), or one whose pages are all taken -- does not fail the batch: in request then slot
    order, its slots beyond its free pages get balanced pages instead. They become handoff pages of that rank
    (its rows reach the owner through the owner-filtered write; :meth:`SplitAllocation.verify_direct_write`
    is False for it), and the other ranks still write directly. Only a batch needing more pages than
    ``allocator.num_free()`` raises.

    Args:
        allocator: the SPMD allocator (its ``ownership.cp_size`` must equal ``split.cp_size``).
        split: the plan.
        req_pages: page table ``[num_reqs, max_pages]`` (integer, ``-1`` padded) whose prefix slots
            (``< ceil(prefix_len / page_size)``) hold pages and whose extend slots are ``-1``; may be None when
            no request has a prefix.

    Returns:
        A :class:`SplitAllocation`; ``req_pages`` is widened to cover every request.

    Raises:
        ValueError: a prefix slot is ``-1``, an extend slot is already set, or ``req_pages`` is None while a
            request has a prefix.
        AllocationError: the batch needs more pages than are free; nothing stays allocated.
    """
    if not isinstance(allocator, PageAllocator):
        raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
    ownership = allocator.ownership
    if ownership.cp_size != split.cp_size:
        raise ValueError(
            f"allocator.ownership.cp_size must equal split.cp_size, got {ownership.cp_size} and {split.cp_size}"
        )
    ps, num_reqs = split.page_size, split.num_reqs
    prefix = np.asarray(split.prefix_lens, dtype=np.int64).reshape(num_reqs)
    extend = np.asarray(split.extend_lens, dtype=np.int64).reshape(num_reqs)
    have = cdiv(prefix, ps)  # slots already holding a page (partial first page included)
    need = cdiv(prefix + extend, ps)
    width = int(need.max()) if num_reqs else 0
    if req_pages is None:
        with_prefix = np.flatnonzero(prefix > 0)
        if with_prefix.size:
            i = int(with_prefix[0])
            raise ValueError(
                f"req_pages must be given when a request has a prefix, got req_pages=None and "
                f"prefix_lens[{i}]={int(prefix[i])}"
            )
        table = np.full((num_reqs, width), -1, dtype=np.int64)
    else:
        check_tensor("req_pages", req_pages, dtype=_INTEGER_DTYPES, ndim=2)
        if req_pages.shape[0] != num_reqs:
            raise ValueError(
                f"req_pages must have one row per request ([num_reqs={num_reqs}, max_pages]), "
                f"got req_pages.shape={list(req_pages.shape)}"
            )
        given = req_pages.detach().to("cpu", torch.int64).numpy()
        table = np.full((num_reqs, max(width, given.shape[1])), -1, dtype=np.int64)
        table[:, : given.shape[1]] = given
    cols = np.arange(table.shape[1], dtype=np.int64)[None, :]
    in_prefix = cols < have[:, None]
    is_new = (cols >= have[:, None]) & (cols < need[:, None])
    _first_bad("req_pages", table, in_prefix & (table < 0), "hold a page in every prefix slot")
    _first_bad("req_pages", table, is_new & (table >= 0), "be -1 in every slot the extend allocates")

    aligned = split.page_aligned.numpy()[:, None]
    owner_slots = is_new & aligned
    owners_all = compute_owners(split, table.shape[1]).numpy()
    owners = owners_all[owner_slots]  # request then slot order
    assert (owners >= 0).all(), "a page-aligned request has a new slot without a single compute owner"
    # An owner's k-th requested page (in that order) is placed on it only while it has a free page left.
    if owners.size:
        order = np.argsort(owners, kind="stable")
        rank_in_owner = np.empty_like(owners)
        sorted_owners = owners[order]
        group_start = np.searchsorted(sorted_owners, sorted_owners, side="left")
        rank_in_owner[order] = np.arange(owners.size) - group_start
        free = np.array([allocator.num_free(r) for r in range(ownership.cp_size)], dtype=np.int64)
        placed = rank_in_owner < free[owners]
    else:
        placed = np.zeros(0, dtype=bool)
    short = np.zeros_like(owner_slots)
    short[owner_slots] = ~placed
    owner_slots &= ~short
    owners = owners[placed]
    balanced_slots = (is_new & ~aligned) | short
    num_balanced = int(balanced_slots.sum())
    if owners.size + num_balanced > allocator.num_free():
        raise AllocationError(
            f"allocate_for_split needs {owners.size + num_balanced} new pages, only {allocator.num_free()} are "
            f"free (free per owner: {[allocator.num_free(r) for r in range(ownership.cp_size)]}); "
            "nothing was allocated"
        )
    pages_owned = allocator.alloc(torch.from_numpy(owners)) if owners.size else torch.empty(0, dtype=torch.int64)
    try:
        pages_balanced = allocator.alloc_balanced(num_balanced) if num_balanced else torch.empty(0, dtype=torch.int64)
    except AllocationError:
        allocator.free(pages_owned)
        raise
    table[owner_slots] = pages_owned.numpy()
    table[balanced_slots] = pages_balanced.numpy()
    out = torch.from_numpy(table)
    new_pages = tuple(out[i, int(have[i]) : int(max(have[i], need[i]))].clone() for i in range(num_reqs))
    return SplitAllocation(split=split, ownership=ownership, req_pages=out, new_pages=new_pages)


def _first_bad(name: str, table: np.ndarray, bad: np.ndarray, rule: str) -> None:
    where = np.argwhere(bad)
    if where.size:
        i, s = (int(v) for v in where[0])
        raise ValueError(f"{name} must {rule}, got {name}[{i}, {s}]={int(table[i, s])}")
