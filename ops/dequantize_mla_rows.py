"""``dtkv::dequantize_mla_rows``: fp8 MLA rows (:class:`dtkv.MLAFp8Layout`) decoded to bf16 or float32 rows, in one
pass.

Entry point: :func:`dequantize_mla_rows`; reference :func:`dequantize_mla_rows_torch` (the format's own reference
:func:`dtkv.ops.dequantize_mla_fp8`, then one cast). Row ``n`` of the output (``L = kv_lora_rank``, ``R = rope_dim``,
``B = quant_block``)::

    out[n, j]      = float32(e4m3(code[n, j])) * scale[n, j // B]    for j < L (one float32 product, rounded once)
    out[n, L + i]  = rope[n, i]                                      (the stored bf16, exact in either dtype)

What a kernel that takes bf16 latent rows needs from an fp8 pool (the FlashMLA backend's sparse prefill over fp8
pages: :mod:`dtkv.attention._flashmla`). The kernel reads each stored row once (656 bytes at DeepSeek-V3.2's dims)
and writes its decoded row once (1152 bytes in bf16): the torch path reads and writes a float32 copy of the codes
in between (three launches, about three times the bytes). Its bits are the reference's, NaN codes included
(``tests/test_ops_dequantize_mla_rows.py``).

Launch: ``ops/_tuned.py`` op ``"dequantize_mla_rows"`` (``block_r`` rows a program, ``num_warps``).

Legend: ``A`` leading blocks (pages), ``S`` rows a block, ``M = A * S`` rows, ``L`` / ``R`` / ``B`` as above,
``NB = L / B`` scales a row.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor
from dtkv.layouts import MLAFp8Layout

from ._common import INTERPRET, bf16_rn, cdiv, device_ctx, resolve_backend, tl, triton
from ._tuned import launch_config
from .quantize_write_mla_fp8 import dequantize_mla_fp8

__all__ = ["OUT_DTYPES", "dequantize_mla_rows", "dequantize_mla_rows_torch", "triton_takes"]

OUT_DTYPES = (torch.bfloat16, torch.float32)
"""The output dtypes."""


# ----------------------------------------------------------------------------------------- torch reference
def dequantize_mla_rows_torch(rows: torch.Tensor, layout: MLAFp8Layout, dtype: torch.dtype) -> torch.Tensor:
    """Reference of :func:`dequantize_mla_rows`: ``[M, L + R]`` of ``dtype`` (rows ``uint8 [..., row_bytes]``)."""
    flat = rows.reshape(-1, layout.row_bytes)
    return dequantize_mla_fp8(flat, layout).to(dtype)


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _dequantize_mla_rows_kernel(
    out_ptr,  # [M, L + R] bf16 / float32, contiguous
    rows_ptr,  # uint8 [A, S, row_bytes]; strides (s_a, s_b, 1) in bytes, each a multiple of 4
    num_rows,  # M = A * S
    S,
    s_a,
    s_b,
    L: tl.constexpr,
    R: tl.constexpr,
    QB: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    QBP: tl.constexpr,
    RP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    OUT_BF16: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program ``p``: rows ``[p * BLOCK_R, +BLOCK_R)`` of the flattened ``[A * S]``, a ``[BLOCK_R, NB, B]`` tile of
    codes and scales, then the rope dims."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < num_rows
    a = r // S
    base = a * s_a + (r - a * S) * s_b  # [BLOCK_R] byte offset of the stored row
    nb = tl.arange(0, NBP)
    col = nb[:, None] * QB + tl.arange(0, QBP)[None, :]  # [NBP, QBP] latent dim
    cmask = (nb < NB)[:, None] & (tl.arange(0, QBP) < QB)[None, :]
    m3 = rmask[:, None, None] & cmask[None, :, :]
    raw = tl.load(rows_ptr + base[:, None, None] + col[None, :, :], mask=m3, other=0, eviction_policy="evict_first")
    # typed row pointers first, then the element index (contiguous fp32 / bf16 elements to the compiler)
    s_row = (rows_ptr + base + L).to(tl.pointer_type(tl.float32))  # [BLOCK_R]
    scale = tl.load(s_row[:, None] + nb[None, :], mask=rmask[:, None] & (nb < NB)[None, :], other=0.0)
    x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if EMULATE:  # the interpreter decodes e4m3fn's NaN codes (S.1111.111) as +-480
        x = tl.where((raw & 0x7F) == 0x7F, float("nan"), x)
    x = x * scale[:, :, None]  # [BLOCK_R, NBP, QBP]
    out_row = out_ptr + r * (L + R)  # [BLOCK_R]
    if OUT_BF16:
        y = bf16_rn(x) if EMULATE else x.to(tl.bfloat16)  # the interpreter truncates
    else:
        y = x
    tl.store(out_row[:, None, None] + col[None, :, :], y, mask=m3)
    ri = tl.arange(0, RP)
    rm = rmask[:, None] & (ri < R)[None, :]
    # the rope dims as their bits: a copy in bf16, a 16-bit shift to float32 (exact, subnormals included, which
    # the interpreter's own bf16 conversion is not)
    r_row = (rows_ptr + base + (L + 4 * NB)).to(tl.pointer_type(tl.int16))  # [BLOCK_R]
    bits = tl.load(r_row[:, None] + ri[None, :], mask=rm, other=0, eviction_policy="evict_first")
    if OUT_BF16:
        rope = bits.to(tl.bfloat16, bitcast=True)
    else:
        rope = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    tl.store(out_row[:, None] + L + ri[None, :], rope, mask=rm)


def _as_blocks(rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``rows`` ``[..., row_bytes]`` as ``[A, S, row_bytes]``: a view where the strides allow, else a contiguous
    copy (byte strides and offset must be multiples of 4: the kernel reads the scales as float32)."""
    if rows.dim() == 1:
        rows = rows[None, None]
    elif rows.dim() == 2:
        rows = rows[None]
    elif rows.dim() > 3:
        rows = rows.reshape(-1, rows.shape[-2], row_bytes)
    if rows.stride(2) != 1 or any(s % 4 for s in (rows.stride(0), rows.stride(1), rows.storage_offset())):
        rows = rows.clone(memory_format=torch.contiguous_format)  # a fresh allocation: offset 0
    return rows


def triton_takes(layout: MLAFp8Layout) -> bool:
    """Whether the kernel handles ``layout``: 4-byte scales and 2-byte rope dims at aligned offsets of a row of a
    multiple of 4 bytes (``kv_lora_rank`` divisible by 4, ``rope_dim`` even)."""
    return layout.kv_lora_rank % 4 == 0 and layout.rope_dim % 2 == 0


def _launch(rows: torch.Tensor, out: torch.Tensor, layout_args: tuple[int, int, int]) -> None:
    L, R, QB = layout_args
    blocks = _as_blocks(rows, L + 4 * (L // QB) + 2 * R)
    m = out.shape[0]
    cfg = launch_config("dequantize_mla_rows", m, out.device)
    block_r = int(cfg["block_r"])
    nb = L // QB
    with device_ctx(out.device):
        _dequantize_mla_rows_kernel[(cdiv(m, block_r),)](
            out, blocks, m, blocks.shape[1], blocks.stride(0), blocks.stride(1), L=L, R=R, QB=QB, NB=nb,
            NBP=triton.next_power_of_2(nb), QBP=triton.next_power_of_2(QB), RP=max(1, triton.next_power_of_2(R)),
            BLOCK_R=block_r, OUT_BF16=out.dtype == torch.bfloat16, EMULATE=INTERPRET,
            num_warps=int(cfg["num_warps"]),
        )  # fmt: skip


# ----------------------------------------------------------------------------------------- registered op
def _layout(kv_lora_rank: int, rope_dim: int, quant_block: int) -> MLAFp8Layout:
    return MLAFp8Layout(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, quant_block=quant_block)


def _check(rows: torch.Tensor, layout: MLAFp8Layout, dtype: torch.dtype) -> int:
    """Validate; return the row count ``M``."""
    check_tensor("rows", rows, dtype=torch.uint8)
    if rows.dim() < 1 or rows.shape[-1] != layout.row_bytes:
        raise ValueError(
            f"rows must have shape [..., {layout.row_bytes}] (layout.row_bytes), got rows.shape={list(rows.shape)}"
        )
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype must be one of {list(OUT_DTYPES)}, got dtype={dtype}")
    return rows.numel() // layout.row_bytes


@torch.library.custom_op("dtkv::dequantize_mla_rows", mutates_args=())
def _dequantize_mla_rows_op(
    rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, quant_block: int, dtype: torch.dtype, backend: str
) -> torch.Tensor:
    layout = _layout(kv_lora_rank, rope_dim, quant_block)
    m = _check(rows, layout, dtype)
    if backend != "triton":
        return dequantize_mla_rows_torch(rows, layout, dtype)
    if not triton_takes(layout):
        raise NotImplementedError(
            "backend='triton' for dequantize_mla_rows needs kv_lora_rank divisible by 4 and an even rope_dim, got "
            f"kv_lora_rank={kv_lora_rank}, rope_dim={rope_dim}; use backend='torch'"
        )
    out = torch.empty((m, layout.row_dim), dtype=dtype, device=rows.device)
    if m:
        _launch(rows, out, (kv_lora_rank, rope_dim, quant_block))
    return out


@_dequantize_mla_rows_op.register_fake
def _fake_dequantize_mla_rows(rows, kv_lora_rank, rope_dim, quant_block, dtype, backend):
    layout = _layout(kv_lora_rank, rope_dim, quant_block)
    m = _check(rows, layout, dtype)
    return rows.new_empty((m, layout.row_dim), dtype=dtype)


# ----------------------------------------------------------------------------------------- public wrapper
def dequantize_mla_rows(
    rows: torch.Tensor, layout: MLAFp8Layout, *, dtype: torch.dtype = torch.bfloat16, backend: str = "auto"
) -> torch.Tensor:
    """Decode fp8 MLA rows to ``dtype`` rows (see the module docstring).

    Run phase: one launch, no host synchronization.

    Args:
        rows: stored rows, uint8 ``[..., layout.row_bytes]`` (e.g. a layer's pages ``[P, S, row_bytes]``, any
            page stride: a page-major pool's layer view is read in place; byte strides or an offset that are not
            multiples of 4 are copied first).
        layout: their :class:`dtkv.MLAFp8Layout`.
        dtype: ``torch.bfloat16`` (the latent products rounded once) or ``torch.float32`` (exact).
        backend: ``"auto"`` (Triton on CUDA, else torch; torch for a layout the kernel does not take,
            :func:`triton_takes`) | ``"torch"`` | ``"triton"``.

    Returns:
        ``[M, layout.kv_lora_rank + layout.rope_dim]`` of ``dtype``, contiguous (``M`` rows in ``rows``' order).

    Raises:
        TypeError / ValueError: ``layout`` not an ``MLAFp8Layout``, ``rows`` not uint8 or not of ``row_bytes``
            columns, another ``dtype`` (each naming the value).
        NotImplementedError: ``backend="triton"`` with a layout the kernel does not take.
    """
    if not isinstance(layout, MLAFp8Layout):
        raise TypeError(f"layout must be a dtkv.MLAFp8Layout, got {type(layout).__name__}")
    _check(rows, layout, dtype)
    resolved = resolve_backend(backend, rows.device)
    if resolved == "triton" and backend == "auto" and not triton_takes(layout):
        resolved = "torch"
    return torch.ops.dtkv.dequantize_mla_rows(
        rows, layout.kv_lora_rank, layout.rope_dim, layout.quant_block, dtype, resolved
    )
