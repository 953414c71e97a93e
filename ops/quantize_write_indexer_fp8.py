"""``dtkv::quantize_write_indexer_fp8``: fused fp8 quantization of indexer keys into page-packed indexer pages.

Entry point: :func:`quantize_write_indexer_fp8`; references :func:`quantize_indexer_fp8` and
:func:`dequantize_indexer_pages`. A page of :class:`dtkv.IndexerFp8Layout` (``S`` tokens, ``H = head_dim``)::

    [0, S*H)              e4m3fn   token t's key at t*H: k * (448 / amax(|k_t|)), round-to-nearest-even
    [S*H, S*H + 4*S)      fp32     token t's scale s_t = amax(|k_t|) / 448 at S*H + 4t (0 for an all-zero key)

**Round-trip bound** (finite inputs): ``|k̂ - k| <= |k| / 16 + a / 2**18`` per element, ``a`` the amax of the
token's key; the derivation is the one in the docstring of the MLA module (``ops/quantize_write_mla_fp8.py``;
one block = one token).

Legend: ``P`` local pages, ``S`` page size, ``H`` head dim, ``N`` tokens.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor
from dtkv.layouts import IndexerFp8Layout

from ._common import INTERPRET, OwnershipLike, e4m3_bits, e4m3_blocks_torch, locate, tl, triton
from ._copy import needs_int64
from ._row_write import (
    RowWriteOp,
    call_row_write,
    check_locs,
    check_rows_contiguous,
    launch_rows,
    owned_rows_torch,
    register_row_write_rule,
)
from ._tuned import launch_config

__all__ = [
    "dequantize_indexer_pages",
    "quantize_indexer_fp8",
    "quantize_write_indexer_fp8",
    "quantize_write_indexer_fp8_torch",
]

_K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------- torch reference
def quantize_indexer_fp8(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 quantization of keys ``[N, H]`` (bf16/fp16/fp32): (e4m3 bytes uint8 ``[N, H]``, fp32 ``[N]``)."""
    check_tensor("k", k, dtype=_K_DTYPES, ndim=2)
    return e4m3_blocks_torch(k.float())


def quantize_write_indexer_fp8_torch(
    pool: torch.Tensor,  # uint8 [P, S*(H+4)]
    k: torch.Tensor,  # [N, H]
    locs: torch.Tensor,  # [N] int32/int64
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    page_size: int,
) -> None:
    """Reference: quantize the kept tokens, ``index_put_`` key bytes at ``t*H`` and scale bytes at ``S*H + 4t``."""
    head_dim = k.shape[1]
    sel, local, off = owned_rows_torch(locs, page_size, cp_size, num_pages, scheme_code, rank, pool.shape[0])
    q, scale = quantize_indexer_fp8(k[sel])
    page_idx = local[:, None]
    key_cols = off[:, None] * head_dim + torch.arange(head_dim, device=pool.device)
    pool.index_put_((page_idx, key_cols), q)
    scale_cols = page_size * head_dim + 4 * off[:, None] + torch.arange(4, device=pool.device)
    pool.index_put_((page_idx, scale_cols), scale.contiguous().view(torch.uint8).view(-1, 4))


def dequantize_indexer_pages(pages: torch.Tensor, layout: IndexerFp8Layout) -> torch.Tensor:
    """Decode indexer pages ``uint8 [P, S*(H+4)]`` to float32 keys ``[P, S, H]`` (``q * s_t``)."""
    ps, hd = layout.page_size, layout.head_dim
    check_tensor("pages", pages, dtype=torch.uint8, shape=(None, ps * (hd + 4)))
    q = pages[:, : ps * hd].contiguous().view(torch.float8_e4m3fn).float().view(-1, ps, hd)
    s = pages[:, ps * hd :].contiguous().view(torch.float32).view(-1, ps, 1)
    return q * s


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _quantize_write_indexer_fp8_kernel(
    pool_ptr,  # uint8 [P, S*(H+4)]; page stride page_stride (bytes)
    k_ptr,  # [N, K_STRIDE] bf16/fp16/fp32
    locs_ptr,  # [N] int32/int64, contiguous
    num_rows,
    num_local_pages,
    page_stride,
    num_locs,
    rank,
    PAGE_SIZE: tl.constexpr,
    CP: tl.constexpr,
    PAGES_PER_RANK: tl.constexpr,
    SCHEME: tl.constexpr,
    IDX64: tl.constexpr,
    OFF64: tl.constexpr,
    K_STRIDE: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """One program quantizes ``BLOCK_R`` tokens (``[BLOCK_R, H]`` tile) and stores keys and scales.

    With ``DIRECT`` (every token normally kept) the keys are read under the row bound alone, in flight together
    with the locations; the owner filter reads only kept tokens.
    """
    if OFF64:
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    else:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    ci = tl.arange(0, HP)
    k_ptrs = k_ptr + (r * K_STRIDE)[:, None] + ci[None, :]
    if DIRECT:
        x = tl.load(k_ptrs, mask=rmask[:, None] & (ci < H)[None, :], other=0.0, eviction_policy="evict_first")
    loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
    keep, local, off = locate(loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64)
    m = keep[:, None] & (ci < H)[None, :]
    if not DIRECT:
        x = tl.load(k_ptrs, mask=m, other=0.0, eviction_policy="evict_first")
    if OFF64:
        local = local.to(tl.int64)
        off = off.to(tl.int64)
    base = local * page_stride

    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, 448.0)
    pos = amax > 0
    inv = tl.where(pos, tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.where(pos, amax, 1.0)), 1.0)
    q = e4m3_bits(x * inv[:, None], PREROUND)
    tl.store(pool_ptr + (base + off * H)[:, None] + ci[None, :], q, mask=m)
    s_ptr = (pool_ptr + base + PAGE_SIZE * H + 4 * off).to(tl.pointer_type(tl.float32))
    tl.store(s_ptr, scale, mask=keep)


def _triton_aligned(pool: torch.Tensor, page_size: int, head_dim: int) -> bool:
    """Scales are stored as fp32 through a typed pointer: their byte offsets must be multiples of 4."""
    return (page_size * head_dim) % 4 == 0 and pool.stride(0) % 4 == 0 and pool.storage_offset() % 4 == 0


def _launch(pool, k, locs, cp_size, num_pages, scheme_code, rank, page_size, *, direct) -> None:
    """Launch :func:`_quantize_write_indexer_fp8_kernel` (configured by ``ops/_tuned.py``, op
    ``"quantize_write_indexer_fp8"``; ``direct`` or cp = 1 read every token, the owner filter only kept ones)."""
    head_dim = k.shape[1]
    if not _triton_aligned(pool, page_size, head_dim):
        raise NotImplementedError(
            "backend='triton' for quantize_write_indexer_fp8 needs page_size * head_dim and the pool's page "
            f"stride and offset divisible by 4, got page_size={page_size}, head_dim={head_dim}, "
            f"pool.stride()={pool.stride()}, pool.storage_offset()={pool.storage_offset()}; use backend='torch'"
        )
    k = k.contiguous()
    cfg = launch_config("quantize_write_indexer_fp8", k.shape[0], pool.device)
    block_r = int(cfg["block_r"])
    off64 = needs_int64(pool.shape[0] * pool.stride(0) + pool.stride(0), (k.shape[0] + block_r) * k.stride(0))
    launch_rows(
        _quantize_write_indexer_fp8_kernel, pool, k, locs, cp_size, num_pages, scheme_code, rank, page_size,
        block_r=block_r, num_warps=int(cfg["num_warps"]), K_STRIDE=k.stride(0), H=head_dim,
        HP=triton.next_power_of_2(head_dim), PREROUND=INTERPRET, OFF64=off64, DIRECT=direct or cp_size == 1,
    )  # fmt: skip


def _check(pool, k, locs, page_size) -> int:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got page_size={page_size}")
    check_tensor("k", k, dtype=_K_DTYPES, ndim=2, device=pool.device)
    check_tensor("pool", pool, dtype=torch.uint8, shape=(None, page_size * (k.shape[1] + 4)))
    check_rows_contiguous(pool, 1, "pages")
    check_locs(locs, k.shape[0], pool.device)
    return page_size


_ROW_WRITE = RowWriteOp(check=_check, torch_impl=quantize_write_indexer_fp8_torch, triton_impl=_launch)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::quantize_write_indexer_fp8", mutates_args=("pool",))
def _quantize_write_indexer_fp8_op(
    pool: torch.Tensor,
    k: torch.Tensor,
    locs: torch.Tensor,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    page_size: int,
    direct: bool,
    validate: bool,
    backend: str,
) -> None:
    _ROW_WRITE.run(pool, k, locs, cp_size, num_pages, scheme_code, rank, page_size, direct=direct,
                   validate=validate, backend=backend)  # fmt: skip


@_quantize_write_indexer_fp8_op.register_fake
def _fake_quantize_write_indexer_fp8(pool, k, locs, cp_size, num_pages, scheme_code, rank, page_size, direct,
                                     validate, backend) -> None:  # fmt: skip
    _ROW_WRITE.fake(pool, k, locs, cp_size, num_pages, scheme_code, rank, page_size)


register_row_write_rule(torch.ops.dtkv.quantize_write_indexer_fp8.default, "k")


# ----------------------------------------------------------------------------------------- public wrapper
def quantize_write_indexer_fp8(
    pool: torch.Tensor,
    k: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    *,
    layout: IndexerFp8Layout,
    direct: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
) -> None:
    """Quantize indexer keys per token to fp8 and write keys and scales into their page-packed pages.

    Args:
        pool: this rank's indexer pages of one layer, uint8 ``[P, layout.page_size * (layout.head_dim + 4)]``
            (pages contiguous, any page stride); mutated. May be a DTensor with the ``ownership`` placement.
        k: keys ``[N, layout.head_dim]``, bf16/fp16/fp32.
        locs: logical token locations, int64/int32 ``[N]``, any strides; ``-1`` skipped.
        ownership, rank, direct, validate, backend: as for :func:`dtkv.ops.quantize_write_mla_fp8`
            (``"auto"`` falls back to torch when ``page_size * head_dim`` is not a multiple of 4).

    Raises:
        TypeError / ValueError: bad dtypes, shapes or (validated) locations; nothing written.
    """
    if not isinstance(layout, IndexerFp8Layout):
        raise TypeError(f"layout must be a dtkv.IndexerFp8Layout, got {type(layout).__name__}")
    if isinstance(k, torch.Tensor) and k.dim() == 2 and k.shape[1] != layout.head_dim:
        raise ValueError(f"k must have shape [*, {layout.head_dim}] (layout.head_dim), got k.shape={list(k.shape)}")
    call_row_write(
        torch.ops.dtkv.quantize_write_indexer_fp8, pool, k, locs, ownership, rank, (layout.page_size,),
        direct=direct, validate=validate, backend=backend,
        triton_takes=lambda p: _triton_aligned(p, layout.page_size, layout.head_dim),
    )  # fmt: skip
