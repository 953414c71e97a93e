"""Full-view materialization: let unmodified attention kernels read a sharded pool.

For one batch the logical pages it reads are known on every rank, in two groups: *history* pages (entirely
before every request's prefix end: not written this step, so they can be gathered a layer ahead) and *current*
pages (touched by this step's writes, gathered after them). :func:`plan_materialize` (host, once per batch)
decides which owned pages each rank packs. Per layer each rank packs its pages of a group into a send buffer
padded to the group's largest per-rank count and all-gathers it. The view is owner-major per group::

    view rows [0, cp*Mh)                   history: row r*Mh + m = rank r's m-th history page
    view rows [cp*Mh, cp*Mh + cp*Mc)       current: row cp*Mh + r*Mc + m = rank r's m-th current page

so no reordering copy follows a collective; page tables, token locations and top-k indices are remapped into
view coordinates with ``plan.page_map`` (:func:`dtkv.ops.remap`). The page-table format is defined in
:mod:`dtkv.page_table`.

Two run paths produce the same bytes: :func:`gather_view` (functional collectives, compiles with
``fullgraph=True``) and :class:`Materializer` (eager; preallocated double-buffered views, the history gather of
layer ``l + 1`` in flight while layer ``l`` computes, on a side stream on CUDA). Under ``DTKV_DEBUG=1`` each
view is checked against the owners' bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtkv import _env
from dtkv._collectives import all_gather_into, all_gather_rows, as_bytes
from dtkv.layouts import KVLayout
from dtkv.ops import PackPlan, pack_owned_pages, plan_pack
from dtkv.ownership import OwnershipSpec, PageOwnership, ownership_spec

__all__ = ["MaterializeError", "MaterializePlan", "Materializer", "gather_view", "plan_materialize", "scratch_bytes"]


class MaterializeError(RuntimeError):
    """A materialized view differs from the owners' bytes (raised by ``DTKV_DEBUG`` checks)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class MaterializePlan:
    """Host-built description of one batch's full view (tensors live on the pool's device).

    Attributes:
        ownership, rank: the pool's page map and this rank.
        spec: ``ownership`` as plain ints (what compiled code passes to the ops; every torch version traces it).
        history, current: the :class:`dtkv.ops.PackPlan` of each page group (owner-major send lists).
        pages: int64 ``[k]`` every logical page the batch reads (history first), unique.
        page_map: int32 ``[num_pages]`` logical page -> view row; ``-1`` for pages the batch does not read.
    """

    ownership: PageOwnership
    rank: int
    spec: OwnershipSpec
    history: PackPlan
    current: PackPlan
    pages: torch.Tensor
    page_map: torch.Tensor

    @property
    def num_history_rows(self) -> int:
        return self.history.num_gathered_rows

    @property
    def num_view_pages(self) -> int:
        return self.history.num_gathered_rows + self.current.num_gathered_rows

    @property
    def scratch_pages(self) -> int:
        """Pages of scratch one layer needs on this rank: the view plus both send buffers."""
        return self.num_view_pages + self.history.max_count + self.current.max_count


def _unique_in_order(p: torch.Tensor) -> torch.Tensor:
    if p.numel() == 0:
        return p
    uniq, inverse = torch.unique(p, return_inverse=True)
    first = torch.full((uniq.numel(),), p.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(p.numel()), reduce="amin")
    return uniq[torch.argsort(first)]


def plan_materialize(
    history_pages: torch.Tensor | Sequence[int],
    current_pages: torch.Tensor | Sequence[int],
    ownership: PageOwnership,
    rank: int,
    *,
    device: torch.device | str = "cpu",
) -> MaterializePlan:
    """Plan the full view of a batch (plan phase: host work; not for compiled code).

    Args:
        history_pages: logical pages read but not written this step (prefetchable); ``-1``/repeats dropped.
        current_pages: logical pages written this step; a page in both groups counts as current.
        ownership: the pool's page map.
        rank: this rank.

    Raises:
        ValueError: a page outside ``[0, num_pages)``.
    """
    h = torch.as_tensor(history_pages, dtype=torch.int64).flatten().cpu()
    c = torch.as_tensor(current_pages, dtype=torch.int64).flatten().cpu()
    ownership.check_pages("history_pages", h)
    ownership.check_pages("current_pages", c)
    c = _unique_in_order(c[c >= 0])
    h = _unique_in_order(h[h >= 0])
    h = h[~torch.isin(h, c)]
    hist, cur = plan_pack(h, ownership, device=device), plan_pack(c, ownership, device=device)
    page_map = torch.where(cur.page_map >= 0, cur.page_map + hist.num_gathered_rows, hist.page_map)
    return MaterializePlan(
        ownership=ownership,
        rank=rank,
        spec=ownership_spec(ownership),
        history=hist,
        current=cur,
        pages=torch.cat((h, c)).to(device),
        page_map=page_map,
    )


def scratch_bytes(
    layouts: Mapping[str, KVLayout], *, max_pages: int, cp: int, prefetch: bool = True, slack_pages: int | None = None
) -> int:
    """Bytes of materialization scratch on one rank for batches reading up to ``max_pages`` pages.

    Per layout: the view (``cp * M`` pages) plus the send buffers (``M`` pages), with
    ``M = ceil(max_pages / cp) + slack_pages`` (owner-balanced allocation keeps per-rank counts within about a
    page per request; the default slack is ``cp`` pages). Doubled when ``prefetch`` keeps two layers live.
    """
    slack = cp if slack_pages is None else slack_pages
    m = -(-max_pages // cp) + slack
    per_layer = sum((cp * m + m) * lay.page_bytes for lay in layouts.values())
    return per_layer * (2 if prefetch else 1)


def _pack(local: torch.Tensor, group_plan: PackPlan, plan: MaterializePlan) -> torch.Tensor:
    return pack_owned_pages(local, group_plan, plan.spec, plan.rank)


def gather_view(local: torch.Tensor, plan: MaterializePlan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full view of one layer's pool ``[num_view_pages, *page_shape]`` (run phase; compiles).

    Args:
        local: this rank's pages ``[num_local_pages, *page_shape]``.
        plan: from :func:`plan_materialize`.
        group: the CP group (``None`` when ``cp_size`` is 1).
    """
    parts = []
    for group_plan in (plan.history, plan.current):
        packed = _pack(local, group_plan, plan)
        parts.append(packed if group is None else all_gather_rows(packed, group))
    return torch.cat(parts, dim=0)


class Materializer:
    """Eager per-layer views with layer-ahead history prefetch into preallocated double buffers.

    Call ``prefetch(layer + 1)`` before computing ``layer``; ``view(layer)`` (after the layer's writes) waits
    for the history gather, gathers the current pages and returns the views. Bytes equal :func:`gather_view`.

    Args:
        pool: a :class:`dtkv.ShardedKVPool`.
        plan: from :func:`plan_materialize` with ``pool.ownership`` and ``pool.rank``.
        names: layouts to materialize (default: all).
    """

    def __init__(self, pool, plan: MaterializePlan, *, names: Sequence[str] | None = None) -> None:
        if plan.ownership != pool.ownership or plan.rank != pool.rank:
            raise ValueError(
                f"plan was built for {plan.ownership!r} rank {plan.rank}, "
                f"but pool has {pool.ownership!r} rank {pool.rank}"
            )
        self.pool, self.plan = pool, plan
        self.names = tuple(sorted(pool.layouts) if names is None else names)
        self._buffers = [
            {
                n: torch.empty(
                    (plan.num_view_pages, *pool.layouts[n].page_shape), dtype=pool.layouts[n].dtype, device=pool.device
                )
                for n in self.names
            }
            for _ in range(2)
        ]
        self._pending: dict[int, list] = {}
        cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=pool.device) if cuda else None
        self._events: dict[int, object] = {}

    def scratch_bytes(self) -> int:
        """Bytes of the preallocated double-buffered views on this rank."""
        return sum(t.numel() * t.element_size() for buf in self._buffers for t in buf.values())

    def _gather_into(self, layer: int, name: str, group_plan: PackPlan, lo: int, async_op: bool):
        out = self._buffers[layer % 2][name][lo : lo + group_plan.num_gathered_rows]
        packed = _pack(self.pool.local(name, layer), group_plan, self.plan)
        if self.pool.group is None:
            out.copy_(packed)
            return None
        return all_gather_into(out, packed, self.pool.group, async_op=async_op)

    def prefetch(self, layer: int) -> None:
        """Start gathering ``layer``'s history pages (returns before the collective completes)."""
        if layer >= self.pool.num_layers or layer in self._pending:
            return
        works = []
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            ctx = torch.cuda.stream(self._stream)
        else:
            import contextlib

            ctx = contextlib.nullcontext()
        with ctx:
            for n in self.names:
                works.append(self._gather_into(layer, n, self.plan.history, 0, True))
            if self._stream is not None:
                ev = torch.cuda.Event()
                ev.record(self._stream)
                self._events[layer] = ev
        self._pending[layer] = works

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s views (name -> ``[num_view_pages, *page_shape]``); call after the layer's writes."""
        self.prefetch(layer)
        for w in self._pending.pop(layer):
            if w is not None:
                w.wait()
        if layer in self._events:
            torch.cuda.current_stream(self.pool.device).wait_event(self._events.pop(layer))
        lo = self.plan.num_history_rows
        for n in self.names:
            self._gather_into(layer, n, self.plan.current, lo, False)
        views = dict(self._buffers[layer % 2])
        if _env.debug_enabled():
            check_view(self.pool, layer, self.plan, views)
        return views


def check_view(pool, layer: int, plan: MaterializePlan, views: Mapping[str, torch.Tensor]) -> None:
    """Synchronizing check that every view row equals its owner's page bytes (collective; ``DTKV_DEBUG``).

    Raises:
        MaterializeError: naming the layer, the layout, the logical page, its owner and the view row.
    """
    from dtkv.pool import gather_pages

    pages = plan.pages.to(torch.int64)
    rows = plan.page_map.to(torch.int64)[pages]
    for name, view in views.items():
        full = gather_pages(pool.local(name, layer), plan.ownership, pool.group)
        bad = ~(as_bytes(view[rows]) == as_bytes(full[pages])).flatten(1).all(1)
        if bool(bad.any()):
            page = int(pages[bad][0])
            raise MaterializeError(
                f"materialized view of layer {layer} layout {name!r} differs from the owner's bytes at logical "
                f"page {page} (owner rank {plan.ownership.owner(page)}, view row {int(rows[bad][0])})"
            )
