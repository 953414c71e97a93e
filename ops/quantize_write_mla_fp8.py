"""``dtkv::quantize_write_mla_fp8``: fused fp8 quantization of MLA latent rows and their scatter into the pool.

Entry point: :func:`quantize_write_mla_fp8`; references :func:`quantize_mla_fp8` and :func:`dequantize_mla_fp8`.
A row of :class:`dtkv.MLAFp8Layout` (``L = kv_lora_rank``, ``R = rope_dim``, ``B = quant_block``)::

    [0, L)            e4m3fn   x * (448 / a_b), a_b = amax(|x| over block b), round-to-nearest-even, saturating
    [L, L + 4L/B)     fp32     s_b = a_b / 448, one per block of B latent dims (0 for an all-zero block: zeros)
    [.., row_bytes)   bf16     the R rope dims, rounded to nearest even

**Round-trip bound** (finite inputs): with ``x̂ = dequantize_mla_fp8(quantize_mla_fp8(x))`` and ``a`` the amax of
``x``'s block, ``|x̂ - x| <= |x| / 16 + a / 2**18`` on latent dims. Why: ``y = x * 448 / a`` lies in
``[-448, 448]`` where e4m3 rounding errs by at most half an ulp, ``2**-4`` relative for normals and ``2**-10``
absolute for subnormals (below ``2**-6``); scaled back by ``s = a / 448`` that is ``|x|/16 + 2**-10 * a / 448``,
and ``2**-18 > 2**-10 / 448`` leaves room for the four fp32 roundings (``448 / a``, ``x * inv``, ``a / 448``, the
dequant multiply; ``~4 * 2**-24`` relative). The multiply by one reciprocal per block (instead of a division per
element) keeps the kernel memory-bound; every backend and the reference use the same IEEE operations.
Rope dims are exact for bf16 input and within ``|x| / 2**8`` (half a bf16 ulp) for fp32 input.

Legend: ``P`` local pages, ``S`` page size, ``N`` rows, ``L``/``R``/``B`` as above, ``NB = L / B``.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor
from dtkv.layouts import MLAFp8Layout

from ._common import INTERPRET, OwnershipLike, bf16_rn, e4m3_bits, e4m3_blocks_torch, locate, tl, triton
from ._copy import needs_int64, row_dst
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

__all__ = ["dequantize_mla_fp8", "quantize_mla_fp8", "quantize_write_mla_fp8", "quantize_write_mla_fp8_torch"]

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------- torch reference
def quantize_mla_fp8_torch(kv: torch.Tensor, kv_lora_rank: int, rope_dim: int, quant_block: int) -> torch.Tensor:
    """Quantize rows ``[N, L + R]`` to fp8 rows, uint8 ``[N, row_bytes]`` (the format in the module docstring)."""
    n, L = kv.shape[0], kv_lora_rank
    q, scale = e4m3_blocks_torch(kv[:, :L].float().reshape(n, L // quant_block, quant_block))  # scale: [N, NB]
    rope = kv[:, L : L + rope_dim].to(torch.bfloat16).contiguous()
    return torch.cat([q.reshape(n, L), scale.view(torch.uint8), rope.view(torch.uint8)], dim=1)


def quantize_write_mla_fp8_torch(
    pool: torch.Tensor,  # uint8 [P, S, row_bytes]
    kv: torch.Tensor,  # [N, L + R] bf16/fp16/fp32
    locs: torch.Tensor,  # [N] int32/int64
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    kv_lora_rank: int,
    rope_dim: int,
    quant_block: int,
) -> None:
    """Reference: quantize the kept rows, then ``index_put_`` them (rows of foreign/``-1`` pages skipped)."""
    sel, local, off = owned_rows_torch(locs, pool.shape[1], cp_size, num_pages, scheme_code, rank, pool.shape[0])
    pool.index_put_((local, off), quantize_mla_fp8_torch(kv[sel], kv_lora_rank, rope_dim, quant_block))


def quantize_mla_fp8(kv: torch.Tensor, layout: MLAFp8Layout) -> torch.Tensor:
    """fp8 rows of ``kv`` (``[N, kv_lora_rank + rope_dim]``, bf16/fp16/fp32): uint8 ``[N, layout.row_bytes]``."""
    check_tensor("kv", kv, dtype=_KV_DTYPES, shape=(None, layout.row_dim))
    return quantize_mla_fp8_torch(kv, layout.kv_lora_rank, layout.rope_dim, layout.quant_block)


def dequantize_mla_fp8(rows: torch.Tensor, layout: MLAFp8Layout) -> torch.Tensor:
    """Decode fp8 rows ``uint8 [..., row_bytes]`` to float32 ``[..., kv_lora_rank + rope_dim]`` (``q * s``, rope)."""
    check_tensor("rows", rows, dtype=torch.uint8)
    if rows.dim() < 1 or rows.shape[-1] != layout.row_bytes:
        raise ValueError(f"rows must have shape [..., {layout.row_bytes}], got rows.shape={list(rows.shape)}")
    lead, L, nb = rows.shape[:-1], layout.kv_lora_rank, layout.num_scales
    r = rows.reshape(-1, layout.row_bytes)
    q = r[:, :L].contiguous().view(torch.float8_e4m3fn).float().view(-1, nb, layout.quant_block)
    s = r[:, L : L + 4 * nb].contiguous().view(torch.float32)
    rope = r[:, layout.rope_offset :].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * s[..., None]).reshape(-1, L), rope], dim=1).reshape(*lead, layout.row_dim)


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _quantize_write_mla_fp8_kernel(
    pool_ptr,  # uint8 [P, S, ROW_STRIDE...]; page stride page_stride (bytes)
    kv_ptr,  # [N, KV_STRIDE] bf16/fp16/fp32
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
    ROW_STRIDE: tl.constexpr,
    KV_STRIDE: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    QB: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    QBP: tl.constexpr,
    RP: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """One program quantizes ``BLOCK_R`` rows as a ``[BLOCK_R, NB, B]`` tile and stores the three fields.

    Both input loads (latent and rope dims) are issued before any store; with ``DIRECT`` (every row normally
    kept) they are masked by the row bound alone, so they are in flight together with the locations' load.
    """
    if OFF64:
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    else:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    src = r * KV_STRIDE
    nb = tl.arange(0, NBP)
    qi = tl.arange(0, QBP)
    ri = tl.arange(0, RP)
    col = nb[:, None] * QB + qi[None, :]  # [NBP, QBP]
    cmask = (nb < NB)[:, None] & (qi < QB)[None, :]
    if DIRECT:
        x = tl.load(kv_ptr + src[:, None, None] + col[None, :, :], mask=rmask[:, None, None] & cmask[None, :, :],
                    other=0.0, eviction_policy="evict_first")  # fmt: skip
        rope = tl.load(kv_ptr + src[:, None] + L + ri[None, :], mask=rmask[:, None] & (ri < R)[None, :], other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
    loc = tl.load(locs_ptr + r, mask=rmask, other=-1)
    keep, local, off = locate(loc, rmask, num_locs, num_local_pages, rank, PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64)
    if not DIRECT:
        x = tl.load(kv_ptr + src[:, None, None] + col[None, :, :], mask=keep[:, None, None] & cmask[None, :, :],
                    other=0.0, eviction_policy="evict_first")  # fmt: skip
        rope = tl.load(kv_ptr + src[:, None] + L + ri[None, :], mask=keep[:, None] & (ri < R)[None, :], other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
    base = row_dst(local, off, page_stride, ROW_STRIDE, OFF64)  # [BLOCK_R] byte offset of the destination row

    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_R, NBP]
    scale = tl.math.div_rn(amax, 448.0)
    pos = amax > 0
    inv = tl.where(pos, tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.where(pos, amax, 1.0)), 1.0)
    q = e4m3_bits(x * inv[:, :, None], PREROUND)
    tl.store(pool_ptr + base[:, None, None] + col[None, :, :], q, mask=keep[:, None, None] & cmask[None, :, :])
    # typed row pointers first, then the element index: the scales and rope dims are then contiguous fp32 / bf16
    # elements to the compiler, stored as 16-byte vectors (a byte offset 4 * nb cast afterwards is stored 4 bytes
    # at a time, the rope 2 bytes at a time)
    s_row = (pool_ptr + base + L).to(tl.pointer_type(tl.float32))  # [BLOCK_R]
    tl.store(s_row[:, None] + nb[None, :], scale, mask=keep[:, None] & (nb < NB)[None, :])
    if kv_ptr.dtype.element_ty != tl.bfloat16:
        rope = bf16_rn(rope.to(tl.float32))
    r_row = (pool_ptr + base + (L + 4 * NB)).to(tl.pointer_type(tl.bfloat16))  # [BLOCK_R]
    tl.store(r_row[:, None] + ri[None, :], rope, mask=keep[:, None] & (ri < R)[None, :])


def _triton_aligned(pool: torch.Tensor, kv_lora_rank: int) -> bool:
    """The kernel stores fp32 scales and bf16 rope through typed pointers: they must be 4-byte aligned."""
    return (
        kv_lora_rank % 4 == 0
        and all(s % 4 == 0 for s in (pool.stride(0), pool.stride(1), pool.storage_offset()))
    )  # fmt: skip


def _launch(pool, kv, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim, quant_block, *, direct):
    """Launch :func:`_quantize_write_mla_fp8_kernel` (configured by ``ops/_tuned.py``, op
    ``"quantize_write_mla_fp8"``; ``direct`` or cp = 1 read every row, the owner filter only kept rows)."""
    if not _triton_aligned(pool, kv_lora_rank):
        raise NotImplementedError(
            "backend='triton' for quantize_write_mla_fp8 needs kv_lora_rank and the pool's strides and offset "
            f"divisible by 4, got kv_lora_rank={kv_lora_rank}, pool.stride()={pool.stride()}, "
            f"pool.storage_offset()={pool.storage_offset()}; use backend='torch'"
        )
    nb = kv_lora_rank // quant_block
    kv = kv.contiguous()
    cfg = launch_config("quantize_write_mla_fp8", kv.shape[0], pool.device)
    block_r = int(cfg["block_r"])
    off64 = needs_int64(
        pool.shape[0] * pool.stride(0) + pool.shape[1] * pool.stride(1), (kv.shape[0] + block_r) * kv.stride(0)
    )
    launch_rows(
        _quantize_write_mla_fp8_kernel, pool, kv, locs, cp_size, num_pages, scheme_code, rank, pool.shape[1],
        block_r=block_r, num_warps=int(cfg["num_warps"]), ROW_STRIDE=pool.stride(1), KV_STRIDE=kv.stride(0),
        L=kv_lora_rank, R=rope_dim, QB=quant_block, NB=nb, NBP=triton.next_power_of_2(nb),
        QBP=triton.next_power_of_2(quant_block), RP=max(1, triton.next_power_of_2(rope_dim)), PREROUND=INTERPRET,
        OFF64=off64, DIRECT=direct or cp_size == 1,
    )  # fmt: skip


def _check(pool, kv, locs, kv_lora_rank, rope_dim, quant_block) -> int:
    MLAFp8Layout(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, quant_block=quant_block)  # validates the dims
    row_bytes = kv_lora_rank + 4 * (kv_lora_rank // quant_block) + 2 * rope_dim
    check_tensor("pool", pool, dtype=torch.uint8, shape=(None, None, row_bytes))
    check_rows_contiguous(pool, 2, "rows")
    check_tensor("kv", kv, dtype=_KV_DTYPES, shape=(None, kv_lora_rank + rope_dim), device=pool.device)
    check_locs(locs, kv.shape[0], pool.device)
    return pool.shape[1]


_ROW_WRITE = RowWriteOp(check=_check, torch_impl=quantize_write_mla_fp8_torch, triton_impl=_launch)


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::quantize_write_mla_fp8", mutates_args=("pool",))
def _quantize_write_mla_fp8_op(
    pool: torch.Tensor,
    kv: torch.Tensor,
    locs: torch.Tensor,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    kv_lora_rank: int,
    rope_dim: int,
    quant_block: int,
    direct: bool,
    validate: bool,
    backend: str,
) -> None:
    _ROW_WRITE.run(pool, kv, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim, quant_block,
                   direct=direct, validate=validate, backend=backend)  # fmt: skip


@_quantize_write_mla_fp8_op.register_fake
def _fake_quantize_write_mla_fp8(pool, kv, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim,
                                 quant_block, direct, validate, backend) -> None:  # fmt: skip
    _ROW_WRITE.fake(pool, kv, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim, quant_block)


register_row_write_rule(torch.ops.dtkv.quantize_write_mla_fp8.default, "kv")


# ----------------------------------------------------------------------------------------- public wrapper
def quantize_write_mla_fp8(
    pool: torch.Tensor,
    kv: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    *,
    layout: MLAFp8Layout,
    direct: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
) -> None:
    """Quantize MLA rows to the fp8 row format and write the owned ones into the pool, in one pass.

    Args:
        pool: this rank's fp8 pages of one layer, uint8 ``[P, layout.page_size, layout.row_bytes]`` (rows
            contiguous, any page stride); mutated. May be a DTensor with the ``ownership`` placement.
        kv: rows ``[N, layout.kv_lora_rank + layout.rope_dim]``, bf16/fp16/fp32.
        locs: logical token locations, int64/int32 ``[N]``, any strides; ``-1`` skipped.
        ownership, rank: the page map (``PageOwnership`` or ``OwnershipSpec``) and this rank.
        layout: the fp8 row geometry.
        direct: ``False``: owner filter (``kv`` is the full chunk; foreign rows are skipped, as
            :func:`dtkv.ops.write_owned`). ``True``: a direct write (``kv`` holds this rank's own rows of a
            page-aligned split; a validated foreign page raises, as ``write_owned(..., direct=True)``).
        validate: host check of ``locs`` before writing; ``None`` = eager yes, compiled only with ``DTKV_DEBUG``.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``. ``"auto"`` falls back to torch for geometries the
            kernel does not handle (``kv_lora_rank`` or pool strides not divisible by 4).

    Raises:
        TypeError / ValueError: bad dtypes, shapes, layout mismatch or (validated) locations; nothing written.
    """
    if not isinstance(layout, MLAFp8Layout):
        raise TypeError(f"layout must be a dtkv.MLAFp8Layout, got {type(layout).__name__}")
    if isinstance(pool, torch.Tensor) and pool.dim() == 3 and pool.shape[1] != layout.page_size:
        raise ValueError(
            f"pool must have page_size={layout.page_size} rows per page, got pool.shape={list(pool.shape)}"
        )
    call_row_write(
        torch.ops.dtkv.quantize_write_mla_fp8, pool, kv, locs, ownership, rank,
        (layout.kv_lora_rank, layout.rope_dim, layout.quant_block), direct=direct, validate=validate,
        backend=backend, triton_takes=lambda p: _triton_aligned(p, layout.kv_lora_rank),
    )  # fmt: skip
