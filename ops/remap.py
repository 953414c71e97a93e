"""``dtkv::remap``: translate logical page ids, token locations or top-k indices into gathered-buffer coordinates.

Entry point: :func:`remap`. With ``page_map`` from :func:`dtkv.ops.plan_pack` (logical page -> row of the
owner-major all-gathered buffer), an index ``x`` becomes ``page_map[x // S] * S + x % S`` (``S = page_size``;
``S = 1`` maps page ids). ``-1`` stays ``-1``, and so does an index whose page is not in the buffer
(``page_map`` entry ``-1``) or lies outside ``page_map``: readers treat it as padding. Any shape, int32 or int64.

Legend: ``S`` page size.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor

from ._common import cdiv, device_ctx, index_arg, resolve_backend, tl, triton
from ._sharding import register_rule

__all__ = ["remap", "remap_torch"]


# ----------------------------------------------------------------------------------------- torch reference
def remap_torch(indices: torch.Tensor, page_map: torch.Tensor, page_size: int) -> torch.Tensor:
    """Reference of :func:`remap` (gather + ``where``; no synchronization)."""
    x = indices.to(torch.int64)
    page = torch.div(x, page_size, rounding_mode="floor")
    ok = (x >= 0) & (page < page_map.shape[0])
    mapped = page_map.to(torch.int64)[torch.where(ok, page, torch.zeros_like(page))]
    out = torch.where(ok & (mapped >= 0), mapped * page_size + (x - page * page_size), torch.full_like(x, -1))
    return out.to(indices.dtype)


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _remap_kernel(
    out_ptr,  # [numel], indices' dtype
    idx_ptr,  # [numel] int32/int64, contiguous
    map_ptr,  # [num_map] int32/int64, contiguous
    numel,
    num_map,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program remaps ``BLOCK`` consecutive indices."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    x = tl.load(idx_ptr + o, mask=m, other=-1).to(tl.int64)
    page = x // PAGE_SIZE
    ok = (x >= 0) & (page < num_map)
    mapped = tl.load(map_ptr + page, mask=m & ok, other=-1).to(tl.int64)
    res = tl.where(ok & (mapped >= 0), mapped * PAGE_SIZE + (x - page * PAGE_SIZE), -1)
    tl.store(out_ptr + o, res.to(out_ptr.dtype.element_ty), mask=m)


KERNEL_CONFIG: dict[str, int] = {"block": 1024, "num_warps": 4}
"""Launch parameters (indices per program, warps), swept on an H200 by ``benchmarks/bench_ops.py``."""


def _check(indices: torch.Tensor, page_map: torch.Tensor, page_size: int) -> None:
    check_tensor("indices", indices, dtype=(torch.int64, torch.int32))
    check_tensor("page_map", page_map, dtype=(torch.int32, torch.int64), ndim=1, device=indices.device)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::remap", mutates_args=())
def _remap_op(indices: torch.Tensor, page_map: torch.Tensor, page_size: int, backend: str) -> torch.Tensor:
    _check(indices, page_map, page_size)
    src, page_map = index_arg(indices), index_arg(page_map)
    if backend != "triton":
        return remap_torch(src, page_map, page_size)
    out = torch.empty(indices.shape, dtype=indices.dtype, device=indices.device)
    n = src.numel()
    if n:
        block = KERNEL_CONFIG["block"]
        with device_ctx(indices.device):
            _remap_kernel[(cdiv(n, block),)](
                out,
                src,
                page_map,
                n,
                page_map.shape[0],
                PAGE_SIZE=page_size,
                BLOCK=block,
                num_warps=KERNEL_CONFIG["num_warps"],
            )
    return out


@_remap_op.register_fake
def _fake_remap(indices, page_map, page_size, backend):
    _check(indices, page_map, page_size)
    return torch.empty(indices.shape, dtype=indices.dtype, device=indices.device)


def _remap_sharding(indices, page_map, page_size, backend):
    """Elementwise in ``indices``: any Shard(dim) or Replicate of it passes through; ``page_map`` replicated."""
    from torch.distributed.tensor import Replicate, Shard

    rules = [([Replicate()], [Replicate(), Replicate(), None, None])]
    rules += [([Shard(d)], [Shard(d), Replicate(), None, None]) for d in range(len(indices.shape))]
    return rules


register_rule(torch.ops.dtkv.remap.default, _remap_sharding)


# ----------------------------------------------------------------------------------------- public wrapper
def remap(indices: torch.Tensor, page_map: torch.Tensor, *, page_size: int = 1, backend: str = "auto") -> torch.Tensor:
    """Translate logical indices into rows of the owner-major gathered buffer (see the module docstring).

    Args:
        indices: int32/int64, any shape and strides: page ids (``page_size=1``), token locations, or top-k indices;
            ``-1`` is padding. A DTensor (``Replicate`` or ``Shard``) is accepted with a DTensor ``page_map``.
        page_map: int32/int64 ``[num_pages]`` from :func:`dtkv.ops.plan_pack` / :func:`dtkv.ops.gathered_page_table`
            (any stride).
        page_size: tokens per page of ``indices``' coordinates (1 for page ids).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``.

    Returns:
        Same shape and dtype as ``indices`` (contiguous); ``-1`` for padding and for pages not in the buffer.
    """
    return torch.ops.dtkv.remap(indices, page_map, page_size, resolve_backend(backend, indices.device))
