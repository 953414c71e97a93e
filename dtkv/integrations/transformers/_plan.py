"""The host side of one step (plan phase): CP split, page allocation, locations, materialization plan, key table.

:func:`plan_step` builds a :class:`StepPlan` on every rank from the same inputs (SPMD); the run phase
(:meth:`dtkv.integrations.transformers.DSAModelRunner.forward`) only moves tensors.

The *key table* lists, request by request, every position the step's queries may attend to (``0`` up to
``prefix_len + extend_len - 1``) with its logical token location (:mod:`dtkv.page_table`) and its row in the
materialized view (``key_slots``, remapped with :func:`dtkv.ops.remap`). The indexer scores each local query
against the keys of its own request, in position order, so its top-k breaks ties by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dtkv import ops
from dtkv._util import as_int_list, cdiv
from dtkv.allocator import PageAllocator
from dtkv.materialize import MaterializePlan, plan_materialize
from dtkv.ownership import PageOwnership
from dtkv.split import CPSplit, allocate_for_split, plan_cp_split

__all__ = ["Request", "StepPlan", "plan_step"]


@dataclass
class Request:
    """One sequence: prompt, generated tokens and logical pages (identical on every rank)."""

    rid: int
    prompt: list[int]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose KV is stored."""
    output: list[int] = field(default_factory=list)
    """Generated tokens (the first one comes from the prefill's last logits)."""
    finished: bool = False
    """Pages released (:meth:`DSAModelRunner.free_request`): never stepped again."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True, kw_only=True, eq=False)
class StepPlan:
    """One step on one rank: what the run phase reads (device tensors unless said otherwise).

    ``n`` is this rank's row count, ``K`` the key-table length, ``T`` the step's total extend tokens.
    """

    num_reqs: int
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
    key_locs: torch.Tensor
    """int64 ``[K]``: logical location of each key-table entry."""
    key_req: torch.Tensor
    """int64 ``[K]``: request of each key-table entry."""
    key_pos: torch.Tensor
    """int64 ``[K]``: position of each key-table entry."""
    key_slots: torch.Tensor
    """int64 ``[K]``: view row (token slot) of each key-table entry."""
    mat_plan: MaterializePlan | None
    """Full-view plan (None without CP)."""
    restore_rows: torch.Tensor
    """int64 ``[T]``: gathered row of each natural-order token of the step."""
    last_rows: torch.Tensor
    """int64 ``[num_reqs]``: gathered row of each request's last token of the step."""
    page_aligned: bool
    """Every request of the step was split on page edges (host)."""


def _allocate(allocator: PageAllocator, reqs: Sequence[Request], lens: Sequence[int], split: CPSplit, *,
              direct: bool, page_size: int) -> None:  # fmt: skip
    if direct:
        width = max([len(r.pages) for r in reqs] + [1])
        table = torch.full((len(reqs), width), -1, dtype=torch.int64)
        for i, r in enumerate(reqs):
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int64)
        for r, new in zip(reqs, allocate_for_split(allocator, split, table).new_pages):
            r.pages.extend(new.tolist())
        return
    for r, n in zip(reqs, lens):
        need = cdiv(r.num_computed + n, page_size) - len(r.pages)
        if need > 0:
            r.pages.extend(allocator.alloc_balanced(need).tolist())


def _locs(pages: list[int], lo: int, hi: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(lo, hi)
    return torch.tensor(pages, dtype=torch.int64)[pos // page_size] * page_size + pos % page_size


def plan_step(
    reqs: Sequence[Request],
    extend_lens: Sequence[int],
    *,
    allocator: PageAllocator,
    ownership: PageOwnership,
    rank: int,
    page_size: int,
    split_mode: str,
    mode: str,
    device: torch.device,
    group=None,
) -> StepPlan:
    """Split, allocate pages and build every index of one step (host; identical on every rank).

    ``mode`` is the runner's KV mode (``single``, ``sharded`` or ``sharded_direct``). Pages are appended to
    each request's ``pages``; nothing else of the requests changes. The batch's rules
    (:func:`dtkv._batch.check_batch`) are the caller's: :meth:`DSAModelRunner.plan_step` checks them first. With
    ``group`` the ranks check that they planned the same view (collective; every rank raises together otherwise,
    see :func:`dtkv.materialize.plan_materialize`).
    """
    cp, ps = allocator.ownership.cp_size, page_size
    lens = as_int_list("extend_lens", extend_lens, min_value=1)
    prefix = [r.num_computed for r in reqs]
    split = plan_cp_split(prefix, lens, cp_size=cp, page_size=ps, mode=split_mode)
    _allocate(allocator, reqs, lens, split, direct=mode == "sharded_direct", page_size=ps)
    ids_nat = torch.cat([torch.tensor(r.tokens[p : p + n], dtype=torch.int64) for r, p, n in zip(reqs, prefix, lens)])
    locs_nat = torch.cat([_locs(r.pages, p, p + n, ps) for r, p, n in zip(reqs, prefix, lens)])
    loc = split.local(rank)
    tok = loc.token_index.cpu()
    gi = split.gather_index.cpu()
    locs_gathered = torch.where(gi >= 0, locs_nat[gi.clamp(min=0)], torch.full_like(gi, -1))
    # the key table: every position each request's queries may read, in (request, position) order
    kv_lens = [p + n for p, n in zip(prefix, lens)]
    key_locs = torch.cat([_locs(r.pages, 0, k, ps) for r, k in zip(reqs, kv_lens)])
    key_req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(kv_lens, dtype=torch.int64))
    key_pos = torch.cat([torch.arange(k) for k in kv_lens])
    mat_plan = None
    key_slots = key_locs.to(device)
    if mode != "single":  # history pages (before each prefix end, prefetchable) and pages written now
        hist = [pg for r, p in zip(reqs, prefix) for pg in r.pages[: p // ps]]
        cur = [pg for r, p, k in zip(reqs, prefix, kv_lens) for pg in r.pages[p // ps : cdiv(k, ps)]]
        mat_plan = plan_materialize(hist, cur, ownership, rank, device=device, group=group)
        key_slots = ops.remap(key_slots, mat_plan.page_map, page_size=ps)
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
    dev = device
    return StepPlan(
        num_reqs=len(reqs),
        extend_lens=tuple(lens),
        ids=ids_nat[tok].to(dev),
        positions=loc.positions.to(dev),
        req_idx=loc.req_idx.to(dev),
        locs=locs_nat[tok].to(dev),
        locs_gathered=locs_gathered.to(dev),
        max_local=split.max_local_tokens,
        direct_rows=direct_rows.to(dev),
        handoff_rows=handoff_rows.to(dev),
        handoff_locs_gathered=handoff_locs.to(dev),
        max_handoff=max_handoff,
        key_locs=key_locs.to(dev),
        key_req=key_req.to(dev),
        key_pos=key_pos.to(dev),
        key_slots=key_slots.to(torch.int64),
        mat_plan=mat_plan,
        restore_rows=restore.to(dev),
        last_rows=restore[last_nat].to(dev),
        page_aligned=split.all_page_aligned,
    )
