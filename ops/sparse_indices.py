"""``dtkv::sparse_indices``: logical token locations -> the int32 token slots a sparse-attention kernel reads.

Entry point: :func:`sparse_indices`. One launch does what a sparse MLA kernel (FlashMLA, :func:`dtkv.ops.sparse_mla`)
needs from dtkv's coordinates (:mod:`dtkv.page_table`): for each query row ``n`` and column ``j < W``::

    x = locs[n, j]                      if j < K, else -1          (the padding columns, up to W)
    x = table[n, x // S] * S + x % S    if page_table is given    (key positions -> locations: request n's pages)
    x = remap(x, page_map, page_size)   if page_map is given      (:func:`dtkv.ops.remap`: logical -> view/pool slot)
    out[n, j] = x  if 0 <= x < num_slots  else -1

so ``-1`` stays ``-1``, a page the map does not hold becomes ``-1``, and *no entry ever points past the KV the kernel
reads* (``num_slots`` = its rows): FlashMLA's decode kernel checks no upper bound (an index past the cache faults),
so this bound is what makes the seam safe. ``W`` pads the width to a kernel's multiple (FlashMLA: 64) with ``-1``,
which every kernel skips exactly.

With ``page_table`` (dense ``[N, M]``, ``-1`` padded: each query row's pages in token order, :mod:`dtkv.page_table`),
``locs`` are key *positions* in each query's request (what an indexer's top-k gives); a position whose page slot is
past ``M`` or holds ``-1`` becomes ``-1``. A rank-local table (its local page where it owns the slot's page, else
``-1``, e.g. :attr:`dtkv.decode.DecodePlan.slot_local_page`) gives own-page slots in the same one launch.

Page maps: a materialized view's ``plan.page_map`` (logical page -> view page), a pool's page table as a map, or a
rank's own-page map (logical page -> local page, ``-1`` for pages it does not store; see
:func:`dtkv.attention.owned_page_map`) for sharded decode over a rank's own pages.

Legend: ``N`` query rows, ``K`` locations per row, ``W`` output width (``>= K``), ``S`` page size, ``M`` table width.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor

from ._common import cdiv, device_ctx, index_arg, resolve_backend, tl, triton
from .remap import remap_torch

__all__ = ["sparse_indices", "sparse_indices_torch"]

MAX_SLOTS = 2**31 - 1
"""Token slots must fit int32 (the kernels' index dtype)."""


# ----------------------------------------------------------------------------------------- torch reference
def sparse_indices_torch(
    locs: torch.Tensor,
    page_map: torch.Tensor | None,
    page_size: int,
    num_slots: int,
    width: int,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`sparse_indices` (table, remap, bound, pad; no synchronization)."""
    x = locs.to(torch.int64)
    if page_table is not None:
        table = page_table.to(torch.int64)
        slot = torch.div(x, page_size, rounding_mode="floor")
        ok = (x >= 0) & (slot < table.shape[1])
        page = table.gather(1, torch.where(ok, slot, torch.zeros_like(slot))) if table.shape[1] else slot
        ok = ok & (page >= 0)
        x = torch.where(ok, page * page_size + (x - slot * page_size), torch.full_like(x, -1))
    if page_map is not None:
        x = remap_torch(x, page_map, page_size)
    x = torch.where((x >= 0) & (x < num_slots), x, torch.full_like(x, -1))
    out = torch.full((locs.shape[0], width), -1, dtype=torch.int32, device=locs.device)
    out[:, : locs.shape[1]] = x.to(torch.int32)
    return out


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _sparse_indices_kernel(
    out_ptr,  # [N, W] int32, contiguous
    locs_ptr,  # [N, K] int32/int64, strides (stride_n, stride_k)
    map_ptr,  # [num_map] int32/int64, contiguous (unused without HAS_MAP)
    table_ptr,  # [N, M] int32/int64, row stride stride_t (unused without HAS_TABLE)
    stride_n,
    stride_k,
    stride_t,
    num_cols,  # K
    width,  # W
    num_map,
    table_width,  # M
    num_slots,
    PAGE_SIZE: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``(n, b)``: columns ``[b * BLOCK, +BLOCK)`` of row ``n``."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_w = j < width
    x = tl.load(locs_ptr + n * stride_n + j * stride_k, mask=j < num_cols, other=-1).to(tl.int64)
    if HAS_TABLE:
        slot = x // PAGE_SIZE
        ok = (x >= 0) & (slot < table_width)
        page = tl.load(table_ptr + n * stride_t + slot, mask=in_w & ok, other=-1).to(tl.int64)
        x = tl.where(ok & (page >= 0), page * PAGE_SIZE + (x - slot * PAGE_SIZE), -1)
    if HAS_MAP:
        page = x // PAGE_SIZE
        ok = (x >= 0) & (page < num_map)
        mapped = tl.load(map_ptr + page, mask=in_w & ok, other=-1).to(tl.int64)
        x = tl.where(ok & (mapped >= 0), mapped * PAGE_SIZE + (x - page * PAGE_SIZE), -1)
    x = tl.where((x >= 0) & (x < num_slots), x, -1)
    tl.store(out_ptr + n * width + j, x.to(tl.int32), mask=in_w)


KERNEL_CONFIG: dict[str, int] = {"block": 256, "num_warps": 4}
"""Columns per program and warps (2048-wide rows: 8 programs a row)."""


def _check(locs, page_map, page_size: int, num_slots: int, width: int, page_table=None) -> None:
    check_tensor("locs", locs, dtype=(torch.int64, torch.int32), ndim=2)
    if page_map is not None:
        check_tensor("page_map", page_map, dtype=(torch.int32, torch.int64), ndim=1, device=locs.device)
    if page_table is not None:
        check_tensor("page_table", page_table, dtype=(torch.int32, torch.int64), ndim=2, device=locs.device)
        if page_table.shape[0] != locs.shape[0]:
            raise ValueError(
                f"page_table must have one row per row of locs ({locs.shape[0]}), got "
                f"page_table.shape={list(page_table.shape)}"
            )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
    if not 0 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"num_slots must be in [0, 2**31 - 1] (int32 token slots), got num_slots={num_slots}")
    if width < locs.shape[1]:
        raise ValueError(f"width must be >= locs.shape[1]={locs.shape[1]} (it only pads), got width={width}")


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::sparse_indices", mutates_args=())
def _sparse_indices_op(
    locs: torch.Tensor,
    page_map: torch.Tensor | None,
    page_table: torch.Tensor | None,
    page_size: int,
    num_slots: int,
    width: int,
    backend: str,
) -> torch.Tensor:
    _check(locs, page_map, page_size, num_slots, width, page_table)
    pmap = None if page_map is None else index_arg(page_map)
    if backend != "triton":
        return sparse_indices_torch(locs, pmap, page_size, num_slots, width, page_table)
    table = None if page_table is None or page_table.shape[1] == 0 else page_table
    if table is not None and table.stride(1) != 1:
        table = table.contiguous()
    n = locs.shape[0]
    out = torch.empty((n, width), dtype=torch.int32, device=locs.device)
    if n and width:
        block = KERNEL_CONFIG["block"]
        with device_ctx(locs.device):
            _sparse_indices_kernel[(n, cdiv(width, block))](
                out,
                locs,
                out if pmap is None else pmap,
                out if table is None else table,
                locs.stride(0),
                locs.stride(1),
                0 if table is None else table.stride(0),
                locs.shape[1],
                width,
                0 if pmap is None else pmap.shape[0],
                0 if table is None else table.shape[1],
                num_slots,
                PAGE_SIZE=page_size,
                HAS_MAP=pmap is not None,
                HAS_TABLE=page_table is not None,
                BLOCK=block,
                num_warps=KERNEL_CONFIG["num_warps"],
            )
    return out


@_sparse_indices_op.register_fake
def _fake_sparse_indices(locs, page_map, page_table, page_size, num_slots, width, backend):
    _check(locs, page_map, page_size, num_slots, width, page_table)
    return locs.new_empty((locs.shape[0], width), dtype=torch.int32)


# ----------------------------------------------------------------------------------------- public wrapper
def sparse_indices(
    locs: torch.Tensor,
    *,
    num_slots: int,
    page_map: torch.Tensor | None = None,
    page_size: int = 1,
    width: int | None = None,
    page_table: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Token slots of a sparse-attention kernel from logical token locations (see the module docstring).

    Run phase: one launch, no host synchronization, capture-safe.

    Args:
        locs: int32/int64 ``[N, K]`` (any strides): logical token locations (``page * page_size + offset``,
            :mod:`dtkv.page_table`), or slots already when ``page_map`` is None; ``-1`` is padding.
        num_slots: token slots of the KV the kernel reads (``kv.shape[0] * page_size``, at most ``2**31 - 1``):
            every entry at or past it becomes ``-1``.
        page_map: int32/int64 ``[num_pages]`` logical page -> page of the KV read (``-1``: not there), e.g.
            ``MaterializePlan.page_map``; None: ``locs`` are slots.
        page_size: tokens per page of the map's and the table's coordinates.
        width: output columns ``W >= K`` (default ``K``); columns past ``K`` are ``-1``.
        page_table: int32/int64 ``[N, M]`` each row's pages (``-1`` padded): ``locs`` are then key positions.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``.

    Returns:
        int32 ``[N, W]``, contiguous (``stride(0) = W``).
    """
    w = locs.shape[1] if width is None and locs.dim() == 2 else width
    if w is None:
        check_tensor("locs", locs, ndim=2)
    return torch.ops.dtkv.sparse_indices(
        locs, page_map, page_table, page_size, num_slots, w, resolve_backend(backend, locs.device)
    )
