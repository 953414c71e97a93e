"""The host side of one extend step (plan phase): CP split, allocation, locations, key table, materialization plan.

:func:`plan_extend` builds a :class:`ExtendPlan` on every rank from the same inputs (SPMD); the run phase
(:meth:`dtkv.runtime.Runtime.forward`) only moves tensors.

The *key table* lists, request by request, every position the step's queries may read (``0`` up to
``prefix_len + extend_len - 1``) with its logical token location (:mod:`dtkv.page_table`) and its row in the view
the step reads (``key_slots``: remapped with :func:`dtkv.ops.remap` when the pool is sharded, the location itself
when it is whole). Request ``i``'s entries are ``[key_indptr[i], key_indptr[i + 1])`` in position order, so a
model's top-k over them breaks ties by position; local row ``r`` reads ``[key_start[r], key_end[r])``.

The plan's index tensors are built on the host and reach the device in one copy: packed into one pinned buffer,
copied without blocking, each field a view of the device buffer (:func:`_to_device`), so planning a step never
waits for the previous step's kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dtkv import ops
from dtkv._util import cdiv
from dtkv.allocator import PageAllocator
from dtkv.materialize import MaterializePlan, plan_materialize
from dtkv.ownership import PageOwnership
from dtkv.split import CPSplit, allocate_for_split, plan_cp_split

__all__ = ["ExtendPlan", "alloc_pages", "plan_extend"]


@dataclass(frozen=True, kw_only=True, eq=False)
class ExtendPlan:
    """One extend step on one rank: what the run phase reads (device tensors unless said otherwise).

    ``n`` is this rank's row count, ``K`` the key-table length, ``T`` the step's total extend tokens.
    """

    num_reqs: int
    """Requests of the step (host)."""
    extend_lens: tuple[int, ...]
    """Per request, tokens computed in this step (host)."""
    ids: torch.Tensor
    """int64 ``[n]``: token ids of the local rows (local order: per request, prev then next segment)."""
    positions: torch.Tensor
    """int64 ``[n]``: absolute positions of the local rows."""
    req_idx: torch.Tensor
    """int64 ``[n]``: request (index in the batch) of each local row."""
    locs: torch.Tensor
    """int64 ``[n]``: logical token locations of the local rows."""
    locs_gathered: torch.Tensor
    """int64 ``[cp * max_local]``: locations of the rank-major all-gathered rows (``-1`` = padding)."""
    max_local: int
    """Rows per rank of padded all-gathers (host)."""
    direct_rows: torch.Tensor
    """int64: local rows written directly (``sharded_direct``)."""
    handoff_rows: torch.Tensor
    """int64: local rows sent to their owner through a small all-gather (``sharded_direct``)."""
    handoff_locs_gathered: torch.Tensor
    """int64 ``[cp * max_handoff]``: their locations after the all-gather."""
    max_handoff: int
    """Handoff rows per rank of that all-gather (host; 0 skips it)."""
    groups: tuple[tuple[int, int, int, int], ...]
    """Host ``(request index, local row lo, hi, kv_len)``: the local rows of one request segment (prev or next)
    and how many of its request's positions they may read."""
    key_indptr: tuple[int, ...]
    """Host ``[num_reqs + 1]``: request ``i``'s key-table entries are ``[key_indptr[i], key_indptr[i + 1])``."""
    key_locs: torch.Tensor
    """int64 ``[K]``: logical location of each key-table entry."""
    key_req: torch.Tensor
    """int64 ``[K]``: request of each key-table entry."""
    key_pos: torch.Tensor
    """int64 ``[K]``: position of each key-table entry."""
    key_slots: torch.Tensor
    """int64 ``[K]``: view row (token slot) of each key-table entry."""
    key_start: torch.Tensor
    """int64 ``[n]``: the first key-table entry each local row may read (its request's first entry)."""
    key_end: torch.Tensor
    """int64 ``[n]``: one past the last (its request's entry at the row's own position): a row reads the entries
    ``[key_start, key_end)``, its request's keys up to its position (request and causal visibility in one range)."""
    mat_plan: MaterializePlan | None
    """Full-view plan (None when the pool is whole: ``single`` and ``replicated``)."""
    restore_rows: torch.Tensor
    """int64 ``[T]``: gathered row of each natural-order token of the step."""
    last_rows: torch.Tensor
    """int64 ``[num_reqs]``: gathered row of each request's last token of the step."""
    page_aligned: bool
    """Every request of the step was split on page edges (host)."""
    key_stride: int = 0
    """Host. ``> 0``: a decode plan whose request ``i`` holds key-table entries ``[i * key_stride, (i + 1) *
    key_stride)`` (positions ``0, 1, ...``, whole pages: ``key_stride`` is a multiple of the page size and the first
    slot of page ``l`` is ``page * S``; slots past its length ``-1``) and whose row ``i`` is request ``i``'s query
    (a CUDA-graph bucket's, :mod:`dtkv.runtime._graphs`): a model's top-k may score each query's block alone, linear
    in the batch. ``0``: one flat key table."""

    @property
    def decoding(self) -> bool:
        """One token per request: a decode step (each query its own request's last position)."""
        return all(n == 1 for n in self.extend_lens)


def _to_device(fields: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The int64 1-D host tensors of ``fields`` on ``device``: on CUDA one pinned buffer, one non-blocking copy,
    each field a view of the device buffer (no host synchronization: a pageable ``.to(device)`` waits for the
    stream); elsewhere each field as it is."""
    if torch.device(device).type != "cuda":
        return {name: t.to(device) for name, t in fields.items()}
    sizes = [t.numel() for t in fields.values()]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    torch.cat([t.reshape(-1).to(torch.int64) for t in fields.values()], out=host)
    dev = host.to(device, non_blocking=True)  # the pinned block is not reused before the copy ends
    return dict(zip(fields, torch.split(dev, sizes)))


def _locs(pages: list[int], lo: int, hi: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(lo, hi)
    return torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size


def _allocate(allocator: PageAllocator, reqs: Sequence, split: CPSplit, *, direct: bool, page_size: int) -> None:
    """Give every request the pages its extend needs: compute-owner pages (``direct``) or balanced ones.

    All or nothing: one allocator call for the whole batch (``AllocationError`` leaves every request as it was).
    """
    if direct:
        width = max([len(r.pages) for r in reqs] + [1])
        table = torch.full((len(reqs), width), -1, dtype=torch.int64)
        for i, r in enumerate(reqs):
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int64)
        for r, new in zip(reqs, allocate_for_split(allocator, split, table).new_pages):
            r.pages.extend(new.tolist())
        return
    alloc_pages(allocator, reqs, split.extend_lens, page_size)


def alloc_pages(allocator: PageAllocator, reqs: Sequence, lens: Sequence[int], page_size: int) -> None:
    """Balanced pages for ``reqs`` extended by ``lens``, in request order (host; all or nothing)."""
    needs = [max(0, cdiv(r.num_computed + n, page_size) - len(r.pages)) for r, n in zip(reqs, lens)]
    if not any(needs):
        return
    pages = allocator.alloc_balanced(sum(needs)).tolist()  # the same pages as one call per request, in order
    for r, n in zip(reqs, needs):
        r.pages.extend(pages[:n])
        del pages[:n]


def plan_extend(
    reqs: Sequence,
    lens: Sequence[int],
    *,
    allocator: PageAllocator,
    ownership: PageOwnership,
    cp_size: int,
    rank: int,
    page_size: int,
    split_mode: Literal["zigzag", "round_robin"],
    mode: str,
    device: torch.device,
    group=None,
    make_room: Callable[[CPSplit], None] | None = None,
) -> ExtendPlan:
    """Split, allocate pages and build every index of one extend step (host; identical on every rank).

    Args:
        reqs, lens: the step's requests and their extend lengths (already checked: :mod:`dtkv.runtime._batch`).
        allocator: the SPMD allocator (over the CP group's ownership in the sharded modes).
        ownership: the pool's page map (``cp_size`` 1 for ``single`` and ``replicated``).
        cp_size: ranks of the CP group (the split's).
        rank: this rank in the CP group.
        page_size: tokens per page.
        split_mode: ``"zigzag"`` or ``"round_robin"``.
        mode: the runtime's KV mode (:mod:`dtkv.runtime`).
        device: where the plan's tensors go.
        group: with a sharded pool, the ranks check that they planned the same view (collective; every rank raises
            together otherwise, see :func:`dtkv.materialize.plan_materialize`).
        make_room: called with the split before allocation (the prefix cache evicts what the allocation needs).

    Pages are appended to each request's ``pages``; nothing else of the requests changes.
    """
    cp, ps = cp_size, page_size
    lens = [int(n) for n in lens]
    prefix = [r.num_computed for r in reqs]
    split = plan_cp_split(prefix, lens, cp_size=cp, page_size=ps, mode=split_mode)
    if make_room is not None:
        make_room(split)
    _allocate(allocator, reqs, split, direct=mode == "sharded_direct", page_size=ps)
    ids_nat = torch.tensor([t for r, p, n in zip(reqs, prefix, lens) for t in r.token_range(p, p + n)],
                           dtype=torch.int64)  # fmt: skip
    locs_nat = torch.cat([_locs(r.pages, p, p + n, ps) for r, p, n in zip(reqs, prefix, lens)])
    loc = split.local(rank)
    tok = loc.token_index.cpu()
    gi = split.gather_index.cpu()
    locs_gathered = torch.where(gi >= 0, locs_nat[gi.clamp(min=0)], torch.full_like(gi, -1))
    # attention groups: prev then next segment of each request, with their causal KV extents
    groups, row = [], 0
    for i in range(len(reqs)):
        for n_q, kv_len in (
            (int(loc.actual_seq_q_prev[i]), int(loc.kv_len_prev[i])),
            (int(loc.actual_seq_q_next[i]), int(loc.kv_len_next[i])),
        ):
            if n_q:
                groups.append((i, row, row + n_q, kv_len))
            row += n_q
    # the key table: every position each request's queries may read, in (request, position) order
    kv_lens = [p + n for p, n in zip(prefix, lens)]
    key_locs = torch.cat([_locs(r.pages, 0, k, ps) for r, k in zip(reqs, kv_lens)])
    key_req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(kv_lens, dtype=torch.int64))
    key_pos = torch.cat([torch.arange(k) for k in kv_lens])
    key_indptr = [0]
    for k in kv_lens:
        key_indptr.append(key_indptr[-1] + k)
    row_req = loc.req_idx.cpu().to(torch.int64)
    key_start = torch.tensor(key_indptr[:-1], dtype=torch.int64)[row_req]
    key_end = key_start + loc.positions.cpu().to(torch.int64) + 1
    direct_rows = handoff_rows = handoff_locs = torch.zeros(0, dtype=torch.int64)
    max_handoff = 0
    if mode == "sharded_direct":  # rows of aligned requests on pages this rank stores go straight in
        per_rank = []
        for r_ in range(cp):
            lr = split.local(r_)
            lt = lr.token_index.cpu()
            keep = split.page_aligned[lr.req_idx.cpu()] & (ownership.owner(locs_nat[lt] // ps) == r_)
            per_rank.append(locs_nat[lt[~keep]])
            if r_ == rank:
                direct_rows, handoff_rows = torch.nonzero(keep).flatten(), torch.nonzero(~keep).flatten()
        max_handoff = max(int(h.numel()) for h in per_rank)
        handoff_locs = torch.full((cp, max_handoff), -1, dtype=torch.int64)
        for r_, h in enumerate(per_rank):
            handoff_locs[r_, : h.numel()] = h
        handoff_locs = handoff_locs.flatten()
    restore = split.restore_index.cpu()
    last_nat = torch.tensor(split.extend_indptr[1:], dtype=torch.int64) - 1
    t = _to_device({
        "ids": ids_nat[tok], "positions": loc.positions.cpu(), "req_idx": loc.req_idx.cpu(), "locs": locs_nat[tok],
        "locs_gathered": locs_gathered, "direct_rows": direct_rows, "handoff_rows": handoff_rows,
        "handoff_locs_gathered": handoff_locs, "key_locs": key_locs, "key_req": key_req, "key_pos": key_pos,
        "key_start": key_start, "key_end": key_end, "restore_rows": restore, "last_rows": restore[last_nat],
    }, device)  # fmt: skip
    mat_plan, key_slots = None, t["key_locs"]
    if mode in ("sharded", "sharded_direct"):  # history pages (before each prefix end) and pages written now
        hist = [pg for r, p in zip(reqs, prefix) for pg in r.pages[: p // ps]]
        cur = [pg for r, p, k in zip(reqs, prefix, kv_lens) for pg in r.pages[p // ps : cdiv(k, ps)]]
        mat_plan = plan_materialize(hist, cur, ownership, rank, device=device, group=group)
        key_slots = ops.remap(key_slots, mat_plan.page_map, page_size=ps)
    return ExtendPlan(
        num_reqs=len(reqs),
        extend_lens=tuple(lens),
        max_local=split.max_local_tokens,
        max_handoff=max_handoff,
        groups=tuple(groups),
        key_indptr=tuple(key_indptr),
        key_slots=key_slots.to(torch.int64),
        mat_plan=mat_plan,
        page_aligned=split.all_page_aligned,
        ids=t["ids"], positions=t["positions"], req_idx=t["req_idx"], locs=t["locs"], locs_gathered=t["locs_gathered"],
        direct_rows=t["direct_rows"], handoff_rows=t["handoff_rows"], handoff_locs_gathered=t["handoff_locs_gathered"],
        key_locs=t["key_locs"], key_req=t["key_req"], key_pos=t["key_pos"], key_start=t["key_start"],
        key_end=t["key_end"], restore_rows=t["restore_rows"], last_rows=t["last_rows"],
    )  # fmt: skip
