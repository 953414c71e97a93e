"""The compilable view path (:func:`gather_view`) and the synchronizing ``DTKV_DEBUG`` check (:func:`check_view`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_rows, as_bytes
from dtkv.ops import pack_owned_pages

from ._plan import MaterializeError, MaterializePlan, agree_plan

__all__ = ["check_view", "gather_view"]


def gather_view(local: torch.Tensor, plan: MaterializePlan, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full view of one layer's pool ``[num_view_pages, *page_shape]`` (run phase; compiles).

    One registered pack (``dtkv::pack_owned_pages``) and one all-gather per non-empty page group; nothing for an
    empty group, and zeros instead of a pack on a rank with no page in the group. In eager mode the plan's digest
    is checked across ``group`` on its first use (collective, once per plan; see :func:`plan_materialize`);
    compiled code relies on the plan having been checked when it was made.

    Args:
        local: this rank's pages ``[num_local_pages, *page_shape]``.
        plan: from :func:`plan_materialize`.
        group: the CP group (``None`` when ``cp_size`` is 1).

    Returns:
        ``[plan.num_view_pages, *page_shape]`` of ``local.dtype``; rows no page maps to are zero.
    """
    if group is not None and not torch.compiler.is_compiling():
        agree_plan(plan, group)
    parts = []
    for gp in (plan.history, plan.current):
        rows = gp.send_local_idx.shape[1]  # (compiled code must not read the PageOwnership placement)
        if rows == 0:
            continue
        if gp.counts[plan.rank] == 0:
            packed = local.new_zeros((rows, *local.shape[1:]))
        else:
            packed = pack_owned_pages(local, gp, plan.spec, plan.rank)
        parts.append(packed if group is None else all_gather_rows(packed, group))
    if not parts:
        return local.new_zeros((0, *local.shape[1:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def check_view(
    pool, layer: int, plan: MaterializePlan, views: Mapping[str, torch.Tensor], *, pages: torch.Tensor | None = None
) -> None:
    """Synchronizing check that view rows equal their owners' page bytes (collective; ``DTKV_DEBUG``).

    Args:
        pool, layer: the :class:`dtkv.ShardedKVPool` and layer the views were made from.
        plan, views: the plan and its views (name -> ``[num_view_pages, *page_shape]``).
        pages: logical pages to check (default: every page of the plan).

    Raises:
        MaterializeError: naming the layer, the layout, the logical page, its owner and the view row.
    """
    from dtkv.pool import gather_pages

    pages = (plan.pages if pages is None else pages).to(torch.int64)
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
