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
from ._copy import needs_int64
from ._sharding import register_rule
from ._tuned import launch_config

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


# ----------------------------------------------------------------------------------------- Triton kernels
_MAP16_BIG = 0xFFFE
"""Entry of the 2-byte map meaning "read the full entry" (a value past 0xFFFD); 0xFFFF means negative."""

_MAP16_LARGE_BYTES = 128 << 10
"""``map16="large"``: the 2-byte map is built when the int32 map exceeds this (it then no longer stays in L1)."""


@triton.jit
def _map16_kernel(
    map16_ptr,  # [num_map] int16: the entry's low 16 bits, 0xFFFF if negative, 0xFFFE if past 0xFFFD
    map_ptr,  # [num_map] int32/int64, contiguous
    num_map,
    BLOCK: tl.constexpr,
):
    """The 2-byte copy of ``page_map`` that :func:`_remap_kernel` reads with ``MAP16``."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < num_map
    v = tl.load(map_ptr + o, mask=m, other=-1)
    c = tl.where(v < 0, 0xFFFF, tl.where(v >= 0xFFFE, 0xFFFE, v)).to(tl.int32)
    tl.store(map16_ptr + o, c.to(tl.int16), mask=m)


@triton.jit
def _remap_kernel(
    out_ptr,  # [numel], indices' dtype
    idx_ptr,  # [numel] int32/int64, contiguous
    map_ptr,  # [num_map] int32/int64, contiguous
    map16_ptr,  # [num_map] int16 (MAP16; else any pointer, not read)
    numel,
    num_map,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    OFF64: tl.constexpr,
    MAP16: tl.constexpr,
    IDX_CG: tl.constexpr,
):
    """One program remaps ``BLOCK`` consecutive indices.

    The arithmetic is done in the indices' width (int32 indices: int32; the low 32 bits of ``mapped * S + off``
    are the same in either width, and the sign test of ``mapped`` is made in the map's own width). ``page_map`` is
    gathered at random, so it must stay in L1: with ``MAP16`` the kernel reads the 2-byte copy of
    :func:`_map16_kernel` (half the bytes) and the full entry only where that copy says 0xFFFE. ``IDX_CG`` loads
    the streamed indices past L1, leaving it to the map.
    """
    if OFF64:
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    if IDX_CG:
        x = tl.load(idx_ptr + o, mask=m, other=-1, cache_modifier=".cg")
    else:
        x = tl.load(idx_ptr + o, mask=m, other=-1, eviction_policy="evict_first")
    page = x // PAGE_SIZE
    ok = m & (x >= 0) & (page < num_map)
    if MAP16:
        c = tl.load(map16_ptr + page, mask=ok, other=-1).to(tl.int32) & 0xFFFF
        big = c == 0xFFFE
        full = tl.load(map_ptr + page, mask=ok & big, other=-1)
        valid = ok & (c != 0xFFFF) & (~big | (full >= 0))
        mapped = tl.where(big, full, c.to(full.dtype))
    else:
        mapped = tl.load(map_ptr + page, mask=ok, other=-1)
        valid = ok & (mapped >= 0)
    res = mapped.to(x.dtype) * PAGE_SIZE + (x - page * PAGE_SIZE)
    tl.store(out_ptr + o, tl.where(valid, res, -1).to(out_ptr.dtype.element_ty), mask=m)


def _launch(out: torch.Tensor, src: torch.Tensor, page_map: torch.Tensor, page_size: int) -> None:
    """Launch :func:`_remap_kernel` (and :func:`_map16_kernel` first when configured), per ``ops/_tuned.py``."""
    n, num_map = src.numel(), page_map.shape[0]
    cfg = launch_config("remap", n, src.device)
    block, use16 = int(cfg["block"]), cfg["map16"]
    if use16 not in ("never", "always", "large"):
        raise ValueError(f"remap map16 must be 'never', 'always' or 'large', got map16={use16!r}")
    use16 = num_map > 0 and (use16 == "always" or (use16 == "large" and 4 * num_map > _MAP16_LARGE_BYTES))
    with device_ctx(src.device):
        map16 = page_map
        if use16:
            map16 = torch.empty(num_map, dtype=torch.int16, device=src.device)
            _map16_kernel[(cdiv(num_map, 1024),)](map16, page_map, num_map, BLOCK=1024, num_warps=4)
        _remap_kernel[(cdiv(n, block),)](
            out, src, page_map, map16, n, num_map, PAGE_SIZE=page_size, BLOCK=block,
            OFF64=needs_int64(n + block), MAP16=use16, IDX_CG=bool(cfg["idx_cg"]), num_warps=int(cfg["num_warps"]),
        )  # fmt: skip


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
    if src.numel():
        _launch(out, src, page_map, page_size)
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
