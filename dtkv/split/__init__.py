"""Context-parallel split metadata of an extend (prefill) batch, and which rank computes each KV page.

Entry points: :func:`plan_cp_split` -> :class:`CPSplit` (and :meth:`CPSplit.local` -> :class:`LocalSplit`);
row helpers :func:`take_local`, :func:`pad_local`, :func:`restore_natural`, :func:`split_prev_next`,
:func:`merge_prev_next`; compute owners :func:`compute_owners`, :func:`compute_pages`,
:func:`handoff_pages`, :func:`local_locs`, :func:`verify_direct_write`; owner-aware allocation
:func:`allocate_for_split` -> :class:`SplitAllocation`.

The rules, stated once. A request has ``prefix_len`` tokens in the KV pool and ``extend_len = n`` tokens computed
now, at absolute positions ``prefix_len + offset`` for ``offset`` in ``[0, n)``. The batch's *natural order*
concatenates the extends, request by request: request ``i`` owns rows ``extend_indptr[i]:extend_indptr[i+1]``.
Zigzag splits each request independently; round-robin rotates across the batch.

- **zigzag, token-balanced**: the extend is cut into ``2cp`` segments of ``n // 2cp`` tokens, the first
  ``n % 2cp`` one longer. Rank ``r`` computes segment ``r`` ("prev") and segment ``2cp-1-r`` ("next").
- **zigzag, page-aligned** (``page_aligned=True``, the default): each internal boundary ``k`` moves to the page
  multiple (absolute position) nearest to its token-balanced position, ties going up; boundaries are then made
  strictly increasing by pushing each one right of its predecessor, and capped so every later segment keeps at
  least one page. Every page the extend touches is then computed by one rank. Segment lengths differ. A request
  touching fewer than ``2cp`` pages (``ceil((prefix+n)/ps) - prefix // ps < 2cp``) cannot be aligned: it keeps
  the token-balanced boundaries and ``page_aligned[i]`` is False.
- **round_robin**: row ``t`` of the batch (natural order) goes to rank ``t % cp``, so request ``i``'s offset
  ``o`` goes to rank ``(extend_indptr[i] + o) % cp`` and per-rank token counts of the whole batch differ by at
  most one (a batch of one-token requests is dealt over the ranks, not piled on rank 0). Locally "prev" holds
  every local token of the request and "next" is empty; ``kv_len_prev == kv_len_next`` is ``prefix_len + 1 +``
  the offset of the request's last local token, or ``prefix_len`` without one (kernels need per-token
  ``positions`` here). Never page-aligned.
- **lengths**: ``prefix_len + extend_len`` and ``sum(extend_lens)`` must stay below ``2**31``: the per-request
  lengths and indptrs handed to kernels are int32, so larger values are rejected, never wrapped.
- ``extend_len == 0``: the request contributes no rows on any rank (all its segments are empty, its kv lengths
  equal ``prefix_len``) and, touching no page, is not page-aligned -- so it makes ``all_page_aligned`` False;
  leave empty extends out of CP batches that should write directly.

Rank ``r``'s local rows are, request by request, its prev segment then its next segment. An all-gather of every
rank's rows padded to ``max_local_tokens`` gives the rank-major tensor ``[cp * max_local_tokens, ...]``;
``restore_index`` maps natural row -> gathered row and ``gather_index`` is its inverse. For ``cp=2``, page size 4,
``prefix_len=5``, ``extend_len=23`` (absolute positions 5..27; ``|`` marks page edges at 8, 12, ..., 24)::

    token-balanced   [0, 6, 12, 18, 23]  lengths 6 6 6 5   abs 11, 17, 23 (not page edges)
    page-aligned     [0, 7, 11, 19, 23]  lengths 7 4 8 4   abs 12, 16, 24
    rank 0           segment 0 (offsets 0..6)   + segment 3 (offsets 19..22)  -> 11 rows
    rank 1           segment 1 (offsets 7..10)  + segment 2 (offsets 11..18)  -> 12 rows

Page ownership terms (see :mod:`dtkv.page_table` for the page-table format): a page's *compute owner* is the
rank computing its extend tokens; its *storage owner* is ``ownership.owner(page)``. A rank may write a page
directly only if the request is page-aligned and it is the storage owner of every page it computes
(:func:`verify_direct_write`). Pages a rank computes but does not store are its *handoff pages*. For an aligned
request allocated by :func:`allocate_for_split` they are the partly filled first page of a request whose prefix
ends mid-page (it keeps the owner it was allocated with) and, only when the rank is short of free pages (it stores
no page at all, or its pages are taken), the pages placed elsewhere instead.
"""

from __future__ import annotations

from dtkv.split._alloc import SplitAllocation, allocate_for_split
from dtkv.split._compute import (
    MULTIPLE_COMPUTE_OWNERS,
    NO_COMPUTE_OWNER,
    compute_owners,
    compute_pages,
    handoff_pages,
    local_locs,
    verify_direct_write,
)
from dtkv.split._local import merge_prev_next, pad_local, restore_natural, split_prev_next, take_local
from dtkv.split._plan import CPSplit, LocalSplit, SplitMode, plan_cp_split

__all__ = [
    "MULTIPLE_COMPUTE_OWNERS",
    "NO_COMPUTE_OWNER",
    "CPSplit",
    "LocalSplit",
    "SplitAllocation",
    "SplitMode",
    "allocate_for_split",
    "compute_owners",
    "compute_pages",
    "handoff_pages",
    "local_locs",
    "merge_prev_next",
    "pad_local",
    "plan_cp_split",
    "restore_natural",
    "split_prev_next",
    "take_local",
    "verify_direct_write",
]
