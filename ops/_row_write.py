"""One prologue for the row-write ops: ``dtkv::write_owned`` (and :func:`dtkv.ops.direct_write`),
``dtkv::quantize_write_mla_fp8`` and ``dtkv::quantize_write_indexer_fp8``.

Every row write stores rows ``[N, ...]`` at logical token locations ``locs`` ``[N]`` into the pages ``rank`` owns,
and every one has the same schema tail ``(cp_size, num_pages, scheme_code, rank, *geometry, direct, validate,
backend)``. What they share lives here, once:

- the public side (:func:`call_row_write`): DTensor arguments, ownership ints, the ``validate`` default, backend
  choice with the torch fallback for geometries a kernel does not take, and the ``direct`` switch;
- the op side (:class:`RowWriteOp`): metadata checks, ownership checks, the normalization of ``locs``
  (:func:`dtkv.ops._common.index_arg`), host validation, and the backend dispatch; the fake runs the same checks;
- the row mask of the torch references (:func:`owned_rows_torch`) and the host check (:func:`validate_locs`),
  the torch twins of the kernels' :func:`dtkv.ops._common.locate_rows`;
- the launch of the row kernels (:func:`launch_rows`) and the DTensor sharding rule (:func:`register_row_write_rule`).

**Direct writes.** ``direct=False`` (the owner filter): ``rows`` is the full chunk every rank sees, rows of foreign
pages are skipped. ``direct=True``: ``rows`` holds this rank's own rows of a page-aligned split (each page
computed by its owner), every target page must be owned by ``rank``; a validated foreign page raises instead of
being skipped. Either way, a location outside ``[0, num_pages * page_size)`` raises when validated and is
skipped when not (``-1`` is always skipped), so the same rows are written with and without validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtkv._checks import check_tensor

from ._common import (
    OwnershipLike,
    cdiv,
    check_ownership_ints,
    device_ctx,
    index_arg,
    locate_args,
    owner_and_local,
    ownership_args,
    resolve_backend,
    should_validate,
)
from ._sharding import dtensor_args, register_pool_rule

__all__ = [
    "RowWriteOp",
    "call_row_write",
    "check_locs",
    "check_rows_contiguous",
    "launch_rows",
    "owned_rows_torch",
    "register_row_write_rule",
    "validate_locs",
]


# ----------------------------------------------------------------------------------------- checks
def check_locs(locs: torch.Tensor, num_rows: int, device: torch.device) -> None:
    """``locs``: int32/int64 ``[num_rows]`` on ``device`` (any strides: :func:`index_arg` makes them contiguous)."""
    check_tensor("locs", locs, dtype=(torch.int64, torch.int32), shape=(num_rows,), device=device)


def check_rows_contiguous(pool: torch.Tensor, dim: int, what: str) -> None:
    """The pool's stored rows (or pages) must be contiguous in ``dim``; any stride is fine above it."""
    if pool.stride(dim) != 1:
        raise ValueError(f"pool {what} must be contiguous (stride 1 in dim {dim}), got pool.stride()={pool.stride()}")


def _locate_torch(locs, page_size, cp_size, num_pages, scheme_code):
    """``(loc, page, owner, local)`` of each entry, int64 (owner and local of page 0 for negative entries)."""
    x = locs.to(torch.int64)
    page = torch.div(x, page_size, rounding_mode="floor")
    owner, local = owner_and_local(page.clamp(min=0), cp_size, num_pages, scheme_code)
    return x, page, owner, local


def owned_rows_torch(
    locs: torch.Tensor,
    page_size: int,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    num_local_pages: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows a rank keeps: ``(row_idx, local_page, offset)``, each int64 ``[kept]`` (synchronizes on CUDA).

    A row is kept when its location lies in ``[0, num_pages * page_size)`` (``-1`` and every other value outside
    are skipped), its page is owned by ``rank`` and the page's local index fits the pool: the mask of the
    kernels' :func:`dtkv.ops._common.locate_rows`, computed in int64.
    """
    x, page, owner, local = _locate_torch(locs, page_size, cp_size, num_pages, scheme_code)
    keep = (x >= 0) & (x < num_pages * page_size) & (owner == rank) & (local < num_local_pages)
    sel = keep.nonzero().squeeze(1)
    return sel, local[sel], (x - page * page_size)[sel]


def validate_locs(
    locs: torch.Tensor,
    *,
    page_size: int,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    num_local_pages: int,
    direct: bool,
) -> None:
    """Host check of token locations before any write (synchronizes once on CUDA).

    Every entry must be ``-1`` (skipped) or a location of a logical page in ``[0, num_pages)`` whose local index
    fits the pool; for a ``direct`` write the page must also be owned by ``rank``. These are exactly the rows
    :func:`owned_rows_torch` and the kernels skip besides ``-1`` and, without ``direct``, foreign rows.

    Raises:
        ValueError: naming the first bad entry, its page, and the rule it breaks.
    """
    if locs.numel() == 0:
        return
    x, page, owner, local = _locate_torch(locs, page_size, cp_size, num_pages, scheme_code)
    limit = num_pages * page_size
    bad_range = (x < -1) | (x >= limit)
    valid = x >= 0
    bad_local = valid & ~bad_range & (owner == rank) & (local >= num_local_pages)
    bad_owner = valid & ~bad_range & (owner != rank) if direct else torch.zeros_like(valid)
    flags = torch.stack([bad_range.any(), bad_local.any(), bad_owner.any()]).cpu().tolist()
    if flags[0]:
        i = int(bad_range.nonzero()[0, 0])
        raise ValueError(
            f"locs must hold token locations in [-1, {limit}) (num_pages={num_pages} * page_size={page_size}; "
            f"-1 is skipped), got locs[{i}]={int(x[i])}"
        )
    if flags[1]:
        i = int(bad_local.nonzero()[0, 0])
        raise ValueError(
            f"locs[{i}]={int(x[i])} is in logical page {int(page[i])}, local page {int(local[i])} of rank {rank}, "
            f"but pool holds only {num_local_pages} local pages"
        )
    if flags[2]:
        i = int(bad_owner.nonzero()[0, 0])
        raise ValueError(
            f"locs[{i}]={int(x[i])} is in logical page {int(page[i])}, owned by rank {int(owner[i])}, not by "
            f"rank {rank}: a direct write may only target this rank's own pages (page-aligned split)"
        )


# ----------------------------------------------------------------------------------------- op side
@dataclass(frozen=True, kw_only=True, slots=True)
class RowWriteOp:
    """The per-op parts of a row write; :meth:`run` and :meth:`fake` are the registered op's body and fake.

    Each callable takes ``(pool, src, locs, cp_size, num_pages, scheme_code, rank, *geometry)``, where ``src`` is
    the op's row tensor (``rows``, ``kv`` or ``k``) and ``geometry`` the op's layout ints.
    """

    check: Callable[..., int]
    """Metadata checks of the tensors and the geometry (eager, fake and meta alike); returns the page size."""
    torch_impl: Callable[..., None]
    """The torch reference (``index_put_`` of the rows :func:`owned_rows_torch` keeps)."""
    triton_impl: Callable[..., None]
    """The Triton launch; also takes ``direct=`` (tiles may be sized for the owner filter)."""

    def run(self, pool, src, locs, cp_size, num_pages, scheme_code, rank, *geometry, direct, validate, backend):
        """Checks, ``locs`` normalization, host validation (``validate``), then the backend's write."""
        page_size = self.check(pool, src, locs, *geometry)
        check_ownership_ints(cp_size, num_pages, scheme_code, rank)
        locs = index_arg(locs)
        if validate:
            validate_locs(
                locs, page_size=page_size, cp_size=cp_size, num_pages=num_pages, scheme_code=scheme_code,
                rank=rank, num_local_pages=pool.shape[0], direct=direct,
            )  # fmt: skip
        args = (pool, src, locs, cp_size, num_pages, scheme_code, rank, *geometry)
        if backend == "triton":
            self.triton_impl(*args, direct=direct)
        else:
            self.torch_impl(*args)

    def fake(self, pool, src, locs, cp_size, num_pages, scheme_code, rank, *geometry) -> None:
        """The registered fake: the metadata checks of :meth:`run` (mutating ops return nothing)."""
        self.check(pool, src, locs, *geometry)
        check_ownership_ints(cp_size, num_pages, scheme_code, rank)


def launch_rows(
    kernel,
    pool: torch.Tensor,
    src: torch.Tensor,
    locs: torch.Tensor,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    page_size: int,
    *,
    block_r: int,
    num_warps: int,
    grid: tuple[int, ...] | None = None,
    **constexprs: Any,
) -> None:
    """Launch a row kernel over a ``grid`` of programs (default ``(cdiv(N, block_r),)``; nothing for no rows or an
    empty pool).

    Every row kernel takes ``(pool_ptr, src_ptr, locs_ptr, num_rows, num_local_pages, page_stride, num_locs,
    rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, ..., BLOCK_R)``; ``constexprs`` are its own.
    ``pool`` may be a word view of the pool (its dim 0 is the pages); ``locs`` is contiguous (:func:`index_arg`).
    """
    n = src.shape[0]
    if n == 0 or pool.shape[0] == 0:
        return
    with device_ctx(pool.device):
        kernel[(cdiv(n, block_r),) if grid is None else grid](
            pool, src, locs, n, pool.shape[0], pool.stride(0), rank=rank,
            **locate_args(cp_size, num_pages, scheme_code, page_size), BLOCK_R=block_r, num_warps=num_warps,
            **constexprs,
        )  # fmt: skip


def register_row_write_rule(op, src: str) -> None:
    """DTensor rule of a row write: ``src`` and ``locs`` are the full chunk (``Replicate``) for the owner filter
    and this rank's piece (``Shard(0)``) for a direct write; the pool keeps its placement."""
    register_pool_rule(op, lambda a: dict.fromkeys((src, "locs"), "shard0" if a["direct"] else "replicate"))


# ----------------------------------------------------------------------------------------- public side
def call_row_write(
    op,
    pool: torch.Tensor,
    src: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    geometry: tuple[int, ...],
    *,
    direct: bool,
    validate: bool | None,
    backend: str,
    triton_takes: Callable[[torch.Tensor], bool] | None = None,
) -> None:
    """The public wrapper of every row write: one call of the registered ``op``.

    A DTensor ``pool`` must carry the ``ownership`` placement; ``rank`` then comes from its mesh and plain
    ``src``/``locs`` are wrapped as ``Shard(0)`` (direct) or ``Replicate`` (owner filter) DTensors on that mesh.
    ``backend="auto"`` falls back to torch when ``triton_takes(pool)`` says the kernel cannot take the geometry.
    """
    if not isinstance(direct, bool):
        raise TypeError(f"direct must be a bool, got direct={direct!r}")
    pool, (src, locs), rank = dtensor_args(pool, (src, locs), ownership, rank, "shard0" if direct else "replicate")
    chosen = resolve_backend(backend, pool.device)
    if chosen == "triton" and backend == "auto" and triton_takes is not None and not triton_takes(pool):
        chosen = "torch"
    op(pool, src, locs, *ownership_args(ownership), rank, *geometry, direct, should_validate(validate), chosen)
