"""``dtkv::pack_owned_pages``: gather this rank's pages of a page list into an all-gather send buffer.

Entry points: :func:`plan_pack` (plan, host side: one sync per batch), :func:`pack_owned_pages` (run: one kernel,
no sync, compiles with ``fullgraph=True``) and :func:`gathered_page_table`.

Given a list of logical pages (identical on every rank, ``-1`` padding ignored, duplicates kept once at their first
position), rank ``r`` sends its owned pages in list order, padded with zero pages to
``rows_per_rank = max over ranks of owned pages in the list``. A plain all-gather of the send buffers then yields
the **owner-major** buffer ``[cp * rows_per_rank, ...]`` in which logical page ``p`` sits at row
``owner(p) * rows_per_rank + j``, ``j`` its position among ``owner(p)``'s pages of the list. ``page_map`` records
that row, so readers index the gathered buffer directly (:func:`dtkv.ops.remap`) and nothing is reordered after
the collective. Example, ``cp=2`` interleave, list ``[4, 1, 2, 7, -1]``::

    rank 0 sends local pages of [4, 2]       rank 1 sends [1, 7]       rows_per_rank = 2
    gathered rows: 0:p4 1:p2 2:p1 3:p7       page_map[4, 1, 2, 7] = 0, 2, 1, 3     rows = [0, 2, 1, 3, -1]

A rank that stores no pages (e.g. the block scheme with ``cp=3`` and 4 pages: ``[2, 2, 0]``) has an empty local
pool; it sends ``rows_per_rank`` zero pages like any rank whose pages are not in the list.

Legend: ``P`` local pages, ``M`` rows_per_rank, ``K`` list length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from dtkv._checks import check_tensor
from dtkv.ownership import OwnershipScheme, PageOwnership

from ._common import (
    OwnershipLike,
    check_pages_contiguous,
    check_rank,
    index_arg,
    ownership_spec,
    resolve_backend,
    word_view,
)
from ._sharding import dtensor_args, register_pool_rule
from .pack_layer_pages import _words, launch_pack

__all__ = ["PackPlan", "gathered_page_table", "pack_owned_pages", "pack_owned_pages_torch", "plan_pack"]


# ----------------------------------------------------------------------------------------- plan (host)
@dataclass(frozen=True, kw_only=True, slots=True)
class PackPlan:
    """What :func:`plan_pack` computed for one page list; tensors live on the pool's device."""

    ownership: PageOwnership
    """The page map the plan was made for."""
    rows_per_rank: int
    """Rows of every rank's send buffer (largest per-rank count of owned pages in the list)."""
    counts: tuple[int, ...]
    """Owned pages in the list, per rank."""
    send_local_idx: torch.Tensor
    """int64 ``[cp_size, rows_per_rank]``: local page index of each send row, per rank; ``-1`` = zero padding."""
    page_map: torch.Tensor
    """int32 ``[num_pages]``: logical page -> row of the owner-major gathered buffer; ``-1`` if not in the list."""
    rows: torch.Tensor
    """int32 ``[K]``: gathered row of each list position (``-1`` for padding)."""

    @property
    def num_gathered_rows(self) -> int:
        """Rows of the all-gathered buffer (``cp_size * rows_per_rank``)."""
        return self.ownership.cp_size * self.rows_per_rank


def plan_pack(pages: torch.Tensor, ownership: OwnershipLike, *, device: torch.device | str | None = None) -> PackPlan:
    """Plan a pack for the page list ``pages`` (int ``[K]``, logical pages or ``-1``), identically on every rank.

    A plan function: copies ``pages`` to the host once (one sync), computes the tables there and moves them to
    ``device`` (default: ``pages.device``). Not for use inside ``torch.compile``; pass the plan to the run.

    Raises:
        TypeError / ValueError: ``pages`` is not a 1-D integer tensor, or holds values outside ``[-1, num_pages)``.
    """
    check_tensor("pages", pages, dtype=(torch.int64, torch.int32), ndim=1)
    spec = ownership_spec(ownership)
    ownership = PageOwnership(spec.cp_size, spec.num_pages, cast(OwnershipScheme, spec.scheme))
    device = pages.device if device is None else torch.device(device)
    p = pages.to("cpu", torch.int64)
    ownership.check_pages("pages", p)
    k, cp = p.numel(), ownership.cp_size
    pos = torch.arange(k)
    valid = p >= 0
    uniq, inv = torch.unique(p, return_inverse=True)
    first = torch.full((uniq.numel(),), k, dtype=torch.int64).scatter_reduce(0, inv, pos, "amin")
    is_first = valid & (first[inv] == pos)
    owner, local = ownership.owner(p), ownership.local_index(p)
    onehot = (owner[:, None] == torch.arange(cp)[None, :]) & is_first[:, None]  # [K, cp]
    j = (onehot.cumsum(0) - 1).gather(1, owner.clamp(min=0)[:, None]).squeeze(1)
    counts = onehot.sum(0)
    rows_per_rank = int(counts.max()) if k else 0
    page_map = torch.full((ownership.num_pages,), -1, dtype=torch.int32)
    page_map[p[is_first]] = (owner * rows_per_rank + j)[is_first].to(torch.int32)
    rows = torch.where(valid, page_map[p.clamp(min=0)], torch.full_like(page_map[:1], -1))
    send = torch.full((cp, rows_per_rank), -1, dtype=torch.int64)
    send[owner[is_first], j[is_first]] = local[is_first]
    return PackPlan(
        ownership=ownership, rows_per_rank=rows_per_rank, counts=tuple(int(c) for c in counts),
        send_local_idx=send.to(device), page_map=page_map.to(device), rows=rows.to(device),
    )  # fmt: skip


def gathered_page_table(pages: torch.Tensor, ownership: OwnershipLike) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page_map int32 [num_pages], rows int32 [K])`` of :func:`plan_pack` (same rules; a plan function)."""
    plan = plan_pack(pages, ownership)
    return plan.page_map, plan.rows


# ----------------------------------------------------------------------------------------- torch reference
def pack_owned_pages_torch(pool: torch.Tensor, send_idx: torch.Tensor) -> torch.Tensor:
    """Reference: ``pool.index_select(0, send_idx)`` with zero pages where ``send_idx`` is outside ``[0, P)``.

    ``pool`` ``[P, ...]`` (``P`` may be 0: a rank that stores no pages sends zeros); ``send_idx`` int32/int64 ``[M]``.
    """
    if pool.shape[0] == 0:
        return pool.new_zeros((send_idx.shape[0], *pool.shape[1:]))
    words = word_view(pool)
    idx = send_idx.to(torch.int64)
    ok = (idx >= 0) & (idx < pool.shape[0])
    out = words.index_select(0, torch.where(ok, idx, torch.zeros_like(idx)))
    out.masked_fill_(~ok.view(-1, *([1] * (pool.dim() - 1))), 0)
    return out.view(pool.dtype)


def _check(pool: torch.Tensor, send_idx: torch.Tensor) -> None:
    check_pages_contiguous("pool", pool)
    check_tensor("send_idx", send_idx, dtype=(torch.int64, torch.int32), ndim=1, device=pool.device)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::pack_owned_pages", mutates_args=())
def _pack_owned_pages_op(pool: torch.Tensor, send_idx: torch.Tensor, backend: str) -> torch.Tensor:
    _check(pool, send_idx)
    send_idx = index_arg(send_idx, torch.int64)
    if backend != "triton":
        return pack_owned_pages_torch(pool, send_idx)
    out = pool.new_empty((send_idx.shape[0], *pool.shape[1:]))
    if out.numel() == 0:
        return out
    if pool.shape[0] == 0:  # a rank that stores no pages: nothing to read, every row is padding
        return out.zero_()
    # the page copy of dtkv::pack_layer_pages (one layout), configured by ops/_tuned.py entry "pack_owned_pages"
    dst, src = _words(out, pool)
    launch_pack([dst], [src], send_idx, pool.shape[0], op="pack_owned_pages")
    return out


@_pack_owned_pages_op.register_fake
def _fake_pack_owned_pages(pool, send_idx, backend):
    _check(pool, send_idx)
    return pool.new_empty((send_idx.shape[0], *pool.shape[1:]))


# The send buffers of all ranks, concatenated, are the owner-major gathered buffer: output Shard(0).
register_pool_rule(torch.ops.dtkv.pack_owned_pages.default, {"send_idx": "shard0"}, outputs=("shard0",))


# ----------------------------------------------------------------------------------------- public wrapper
def pack_owned_pages(
    pool: torch.Tensor,
    pages: torch.Tensor | PackPlan,
    ownership: OwnershipLike,
    rank: int,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """This rank's owned pages of the list, in list order, as the send buffer of an owner-major all-gather.

    Args:
        pool: this rank's pages of one layer, ``[P, ...]`` (pages contiguous, any page stride, any dtype). May be
            a DTensor with the ``ownership`` placement: the result is then a ``Shard(0)`` DTensor whose
            ``full_tensor()`` is the gathered buffer.
        pages: the page list, int ``[K]`` (plans on the fly: one host sync, not compilable), or the
            :class:`PackPlan` of :func:`plan_pack` (the run: no sync, compiles with ``fullgraph=True``).
        ownership, rank: the page map (``PageOwnership`` or ``OwnershipSpec``) and this rank.
        backend: ``"auto"`` | ``"torch"`` (``index_select``) | ``"triton"``.

    Returns:
        ``[plan.rows_per_rank, *pool.shape[1:]]``, ``pool.dtype``; rows past this rank's count are zero (all of
        them on a rank that stores no pages). All-gather it (e.g. ``all_gather_single``) to get the owner-major
        buffer that ``plan.page_map`` indexes.

    Raises:
        ValueError: ``rank`` outside ``[0, cp_size)``, a plan made for another ownership, or a bad ``pool``.
    """
    plan = pages if isinstance(pages, PackPlan) else plan_pack(pages, ownership, device=pool.device)
    if not torch.compiler.is_compiling() and ownership_spec(plan.ownership) != ownership_spec(ownership):
        raise ValueError(f"pages was planned for {plan.ownership!r}, got ownership={ownership!r}")
    api_pool = pool
    if hasattr(pool, "device_mesh") and hasattr(pool, "placements"):  # DTensor: rank from its mesh
        rank = pool.device_mesh.get_local_rank()
    check_rank(rank, plan.send_local_idx.shape[0])
    api_pool, (idx,), rank = dtensor_args(api_pool, (plan.send_local_idx[rank],), ownership, rank, "shard0")
    return torch.ops.dtkv.pack_owned_pages(api_pool, idx, resolve_backend(backend, pool.device))
