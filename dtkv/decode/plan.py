"""Plan phase of sharded decode: which of a batch's pages this rank scores, and where its new pages go.

Legend: ``B`` requests (one query each: the token being decoded), ``L`` this rank's largest per-request count of
owned pages (``>= 1``), ``M`` the batch's largest page count.

:func:`plan_decode` turns page tables (:mod:`dtkv.page_table`) and sequence lengths into a :class:`DecodePlan`
(host work, once per step; the same on every rank up to the rank's own pages). :func:`alloc_decode_pages` gives a
request that crosses a page boundary its next page on the rank holding the fewest of its pages, so a long decode
spreads its pages (and its attention work) evenly over the ranks, whatever its prompt's placement was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtkv._checks import check_int
from dtkv._util import cdiv
from dtkv.allocator import AllocationError, PageAllocator
from dtkv.decode.topk import MAX_POSITION
from dtkv.ownership import PageOwnership, check_ownership

__all__ = ["DecodePlan", "alloc_decode_pages", "plan_decode"]


@dataclass(frozen=True, kw_only=True, eq=False)
class DecodePlan:
    """Host-built metadata of one sharded decode step on one rank (tensors on the pool's device).

    Attributes:
        rank, cp_size, page_size: this rank, the group size and tokens per page.
        topk: keys each query attends to (fewer when a request is shorter).
        query_pos: int64 ``[B]`` position of each query (``seq_len - 1``).
        new_locs: int64 ``[B]`` logical token location of each query's new KV row (written by its page's owner).
        owned_slots: int64 ``[B, L]`` indices into each request's page list of the pages this rank owns, in
            order; ``-1`` padding.
        owned_local_pages: int64 ``[B, L]`` those pages' rows in this rank's pool; ``-1`` padding.
        slot_local_page: int64 ``[B, M]`` for every page slot, its local row when this rank owns it, else ``-1``.
    """

    rank: int
    cp_size: int
    page_size: int
    topk: int
    query_pos: torch.Tensor
    new_locs: torch.Tensor
    owned_slots: torch.Tensor
    owned_local_pages: torch.Tensor
    slot_local_page: torch.Tensor

    @property
    def num_queries(self) -> int:
        return int(self.query_pos.shape[0])

    @property
    def num_local_keys(self) -> int:
        """Key slots this rank scores per query (``L * page_size``, padding included)."""
        return int(self.owned_slots.shape[1]) * self.page_size


def _page_table(page_tables: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    if isinstance(page_tables, torch.Tensor):
        if page_tables.dim() != 2 or page_tables.dtype.is_floating_point or page_tables.dtype == torch.bool:
            raise ValueError(
                f"page_tables must be an integer tensor [num_reqs, max_pages], got {page_tables.dtype} "
                f"{list(page_tables.shape)}"
            )
        return page_tables.detach().to("cpu", torch.int64)
    rows = [list(r) for r in page_tables]
    width = max([len(r) for r in rows] + [1])
    table = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        for p in r:
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(f"page_tables[{i}] must hold ints, got {p!r} ({type(p).__name__})")
        if r:
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return table


def plan_decode(
    page_tables: Sequence[Sequence[int]] | torch.Tensor,
    seq_lens: Sequence[int],
    ownership: PageOwnership,
    rank: int,
    *,
    page_size: int,
    topk: int,
    device: torch.device | str = "cpu",
) -> DecodePlan:
    """Plan one decode step of ``B`` requests on ``rank`` (plan phase: host work, not for compiled code).

    Args:
        page_tables: each request's logical pages in token order, a list of lists or an int tensor ``[B, M]``
            (``-1`` padded); request ``b`` must have ``ceil(seq_lens[b] / page_size)`` pages, more are ignored.
        seq_lens: tokens of each request *including* the one being decoded (its KV row is written this step).
        ownership: the pool's page map.
        rank: this rank in ``[0, ownership.cp_size)``.
        page_size: tokens per page.
        topk: keys each query attends to (>= 1).
        device: where the plan's tensors go.

    Raises:
        ValueError / TypeError: a length < 1 or too long for the keys, too few pages, pages outside the pool or
            repeated within a request, a bad rank or topk. Nothing is planned.
    """
    check_ownership(ownership, rank)
    check_int("page_size", page_size, min_value=1)
    check_int("topk", topk, min_value=1)
    table = _page_table(page_tables)
    lens = [check_int(f"seq_lens[{i}]", n, min_value=1) for i, n in enumerate(seq_lens)]
    if len(lens) != table.shape[0]:
        raise ValueError(f"seq_lens must have one entry per request ({table.shape[0]}), got {len(lens)}")
    for i, n in enumerate(lens):
        if n - 1 > MAX_POSITION:
            raise ValueError(f"seq_lens[{i}] must be <= {MAX_POSITION + 1} (positions travel in 32 bits), got {n}")
    ps = page_size
    need = torch.tensor([cdiv(n, ps) for n in lens], dtype=torch.int64)
    slots = torch.arange(table.shape[1], dtype=torch.int64)[None, :]
    used = slots < need[:, None]
    have = ((table >= 0) & used).sum(1)
    short = torch.nonzero(have < need).flatten()
    if short.numel():
        i = int(short[0])
        raise ValueError(
            f"page_tables[{i}] must hold ceil(seq_lens[{i}] / page_size) = {int(need[i])} pages (no -1 among them) "
            f"for seq_lens[{i}]={lens[i]}, got {int(have[i])}"
        )
    table = torch.where(used, table, torch.full_like(table, -1))
    ownership.check_pages("page_tables", table)
    for i in range(table.shape[0]):
        row = table[i][table[i] >= 0]
        if torch.unique(row).numel() != row.numel():
            raise ValueError(f"page_tables[{i}] must not repeat a page, got {row.tolist()}")
    owners = ownership.owner(table)
    mine = used & (owners == rank)
    local = ownership.local_index(table)
    slot_local_page = torch.where(mine, local, torch.full_like(local, -1))
    width = max([1] + mine.sum(1).tolist())
    order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)[:, :width]  # owned slots first, in order
    count = mine.sum(1, keepdim=True)
    keep = torch.arange(width)[None, :] < count
    owned_slots = torch.where(keep, order, torch.full_like(order, -1))
    owned_local = torch.where(keep, slot_local_page.gather(1, order.clamp(min=0)), torch.full_like(order, -1))
    pos = torch.tensor(lens, dtype=torch.int64) - 1
    new_pages = table.gather(1, (pos // ps)[:, None]).squeeze(1)
    dev = torch.device(device)
    return DecodePlan(
        rank=rank,
        cp_size=ownership.cp_size,
        page_size=ps,
        topk=topk,
        query_pos=pos.to(dev),
        new_locs=(new_pages * ps + pos % ps).to(dev),
        owned_slots=owned_slots.to(dev),
        owned_local_pages=owned_local.to(dev),
        slot_local_page=slot_local_page.to(dev),
    )


def alloc_decode_pages(
    allocator: PageAllocator, pages: Sequence[Sequence[int]], needs: Sequence[int]
) -> list[list[int]]:
    """New pages for a decode step: ``needs[b]`` pages for request ``b``, each on the rank holding fewest of its pages.

    SPMD: every rank makes the same call and gets the same pages. Ties go to the first rank after the owner of the
    request's last page (rotation); a rank with no free page is skipped. All or nothing: if the pool cannot serve
    every request, :class:`dtkv.AllocationError` is raised and nothing is allocated.

    Args:
        allocator: the SPMD allocator of the pool (its ``ownership`` decides owners).
        pages: each request's current pages.
        needs: new pages per request (>= 0).

    Returns:
        The new pages of each request (empty lists where ``needs[b] == 0``).
    """
    if len(pages) != len(needs):
        raise ValueError(f"pages and needs must have one entry per request, got {len(pages)} and {len(needs)}")
    own = allocator.ownership
    cp = own.cp_size
    free = [allocator.num_free(r) for r in range(cp)]
    owners: list[int] = []
    for b, (req_pages, n) in enumerate(zip(pages, needs)):
        check_int(f"needs[{b}]", n, min_value=0)
        if not n:  # most requests of a step take no page: their pages are not counted (a 128K request has 2048)
            continue
        counts = [0] * cp
        for p in req_pages:
            counts[own.owner(int(p))] += 1
        last = own.owner(int(req_pages[-1])) if len(req_pages) else cp - 1
        for _ in range(n):
            order = [(last + 1 + i) % cp for i in range(cp)]
            choices = [r for r in order if free[r] > 0]
            if not choices:
                raise AllocationError(
                    f"alloc_decode_pages needs {sum(needs)} free pages, the pool has {allocator.num_free()}; "
                    "nothing was allocated"
                )
            r = min(choices, key=lambda x: counts[x])  # min keeps the first of equals: rotation order
            owners.append(r)
            free[r] -= 1
            counts[r] += 1
            last = r
    got = allocator.alloc(owners).tolist() if owners else []
    out, i = [], 0
    for n in needs:
        out.append(got[i : i + n])
        i += n
    return out
