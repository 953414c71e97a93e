"""Index construction from dtkv's page-table format (:mod:`dtkv.page_table`), on the device, with no host sync.

- :func:`dense_page_table`: the CSR page table (``kv_indptr``, ``kv_indices``) as a dense ``[num_reqs, max_pages]``
  one, ``-1`` padded (what :meth:`dtkv.attention.AttentionBackend.indices` and :func:`positions_to_locs` take).
- :func:`positions_to_locs`: key positions of each query's request (what an indexer's top-k gives) -> logical token
  locations, through the requests' page tables.
- :func:`owned_page_map`: logical page -> this rank's local page (``-1`` for pages it does not store): the page map
  of sharded decode over a rank's own pages.
- the slots themselves: :meth:`dtkv.attention.AttentionBackend.indices` / :func:`dtkv.ops.sparse_indices`
  (locations -> view, pool or own-page slots; ``-1`` preserved; bounded; padded to the kernel's multiple).
"""

from __future__ import annotations

import torch

from dtkv._checks import check_int, check_tensor
from dtkv.ownership import PageOwnership, check_ownership

__all__ = ["dense_page_table", "owned_page_map", "positions_to_locs"]


def dense_page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, max_pages: int) -> torch.Tensor:
    """The CSR page table as a dense one: int64 ``[num_reqs, max_pages]``, ``-1`` padded (run phase: no host sync).

    Args:
        kv_indptr: int ``[num_reqs + 1]``, kv_indices: int ``[kv_indptr[-1]]`` (:mod:`dtkv.page_table`).
        max_pages: columns (a host int, e.g. the plan's longest request); pages past it are dropped.
    """
    check_int("max_pages", max_pages, min_value=0)
    check_tensor("kv_indptr", kv_indptr, ndim=1)
    check_tensor("kv_indices", kv_indices, ndim=1, device=kv_indptr.device)
    start = kv_indptr[:-1].to(torch.int64)
    count = kv_indptr[1:].to(torch.int64) - start
    col = torch.arange(max_pages, device=kv_indptr.device)
    ok = col[None, :] < count[:, None]
    src = torch.where(ok, start[:, None] + col[None, :], torch.zeros_like(ok, dtype=torch.int64))
    if kv_indices.numel() == 0:
        return torch.full(ok.shape, -1, dtype=torch.int64, device=kv_indptr.device)
    return torch.where(ok, kv_indices.to(torch.int64)[src], torch.full_like(src, -1))


def positions_to_locs(
    positions: torch.Tensor, page_table: torch.Tensor, *, page_size: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Logical token locations ``[N, K]`` int64 of key positions, through dense page tables (run phase).

    ``loc = page_table[rows[n], pos // page_size] * page_size + pos % page_size``; ``-1`` where ``pos < 0``, the
    page slot is past the table's width or holds ``-1``.

    Args:
        positions: integer ``[N, K]`` key positions in each query's request (``-1`` padding).
        page_table: integer ``[B, M]`` logical pages of each request in token order, ``-1`` padded
            (:mod:`dtkv.page_table`'s dense form; a rank-local table with ``-1`` for pages it does not own works too).
        page_size: tokens per page.
        rows: int ``[N]`` request (row of ``page_table``) of each query; None: query ``n`` is request ``n``.
    """
    check_int("page_size", page_size, min_value=1)
    check_tensor("positions", positions, ndim=2)
    check_tensor("page_table", page_table, ndim=2, device=positions.device)
    pos = positions.to(torch.int64)
    slot = torch.div(pos, page_size, rounding_mode="floor")
    width = page_table.shape[1]
    ok = (pos >= 0) & (slot < width)
    table = page_table.to(torch.int64)
    if rows is not None:
        check_tensor("rows", rows, ndim=1, shape=(positions.shape[0],), device=positions.device)
        table = table[rows.to(torch.int64)]
    elif table.shape[0] != positions.shape[0]:
        raise ValueError(
            f"page_table must have one row per query without rows=, got page_table.shape={list(page_table.shape)} "
            f"for positions.shape={list(positions.shape)}"
        )
    if width == 0:
        return torch.full_like(pos, -1)
    page = table.gather(1, torch.where(ok, slot, torch.zeros_like(slot)))
    ok = ok & (page >= 0)
    return torch.where(ok, page * page_size + (pos - slot * page_size), torch.full_like(pos, -1))


def owned_page_map(ownership: PageOwnership, rank: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 ``[num_pages]``: logical page -> its local page on ``rank`` if ``rank`` stores it, else ``-1`` (plan).

    With it, :meth:`dtkv.attention.AttentionBackend.indices` turns a global top-k (logical locations) into slots of
    this rank's own pages, every row another rank owns set to ``-1``: what sharded decode passes to
    :meth:`~dtkv.attention.AttentionBackend.decode` before merging the ranks' partials.
    """
    check_ownership(ownership, rank)
    pages = torch.arange(ownership.num_pages, dtype=torch.int64)
    mine = ownership.owner(pages) == rank
    local = torch.where(mine, ownership.local_index(pages), torch.full_like(pages, -1))
    return local.to(torch.int32).to(device)
