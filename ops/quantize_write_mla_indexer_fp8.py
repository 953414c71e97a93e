"""``dtkv::quantize_write_mla_indexer_fp8``: a decode step's new rows into both fp8 caches of a layer, one launch.

Entry point: :func:`quantize_write_mla_indexer_fp8`. For every token location ``locs[i]`` whose page ``rank``
owns (the owner filter; ``-1`` and foreign rows skipped), the MLA row ``kv[i]`` is quantized into the fp8 row format
of ``kv_pool`` (:func:`dtkv.ops.quantize_write_mla_fp8`) and the indexer key ``k[i]`` into the page-packed fp8
pages of ``index_pool`` (:func:`dtkv.ops.quantize_write_indexer_fp8`): the two ops' bytes, bit for bit, from one
kernel. Its grid is ``(tiles, 2)``: program ``(b, 0)`` runs the MLA kernel's row tile ``b``, program ``(b, 1)``
the indexer kernel's (each op's tile from ``ops/_tuned.py``; the smaller tile count's extra programs find no row).
The reference is the two ops' torch references. Plain tensors only (a decode step's local pages of one layer).

Legend: ``N`` tokens, ``P`` local pages, ``S`` page size, ``R`` / ``E`` latent / rope dims, ``H`` indexer dims.
"""

from __future__ import annotations

import torch

from dtkv.layouts import IndexerFp8Layout, MLAFp8Layout

from ._common import (
    INTERPRET,
    OwnershipLike,
    cdiv,
    check_ownership_ints,
    device_ctx,
    index_arg,
    locate_args,
    ownership_args,
    resolve_backend,
    should_validate,
    tl,
    triton,
)
from ._copy import needs_int64
from ._row_write import validate_locs
from ._tuned import launch_config
from .quantize_write_indexer_fp8 import _check as _ix_check
from .quantize_write_indexer_fp8 import _quantize_write_indexer_fp8_kernel, quantize_write_indexer_fp8_torch
from .quantize_write_indexer_fp8 import _triton_aligned as _ix_aligned
from .quantize_write_mla_fp8 import _check as _mla_check
from .quantize_write_mla_fp8 import _quantize_write_mla_fp8_kernel, quantize_write_mla_fp8_torch
from .quantize_write_mla_fp8 import _triton_aligned as _mla_aligned

__all__ = ["quantize_write_mla_indexer_fp8", "quantize_write_mla_indexer_fp8_torch"]


# ----------------------------------------------------------------------------------------- torch reference
def quantize_write_mla_indexer_fp8_torch(
    kv_pool, index_pool, kv, k, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim, quant_block,
    page_size,
) -> None:  # fmt: skip
    """Reference: the MLA op's reference into ``kv_pool``, then the indexer op's into ``index_pool``."""
    quantize_write_mla_fp8_torch(kv_pool, kv, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank,
                                      rope_dim, quant_block)  # fmt: skip
    quantize_write_indexer_fp8_torch(index_pool, k, locs, cp_size, num_pages, scheme_code, rank, page_size)


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _quantize_write_mla_indexer_fp8_kernel(
    kv_pool_ptr,  # uint8 [P, S, ROW_STRIDE...]; page stride kv_page_stride (bytes)
    kv_ptr,  # [N, KV_STRIDE] bf16/fp16/fp32
    index_pool_ptr,  # uint8 [P, S*(H+4)]; page stride index_page_stride (bytes)
    k_ptr,  # [N, K_STRIDE] bf16/fp16/fp32
    locs_ptr,  # [N] int32/int64, contiguous
    num_rows,
    kv_local_pages,
    kv_page_stride,
    index_local_pages,
    index_page_stride,
    num_locs,
    rank,
    PAGE_SIZE: tl.constexpr,
    CP: tl.constexpr,
    PAGES_PER_RANK: tl.constexpr,
    SCHEME: tl.constexpr,
    IDX64: tl.constexpr,
    KV_OFF64: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    KV_STRIDE: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    QB: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    QBP: tl.constexpr,
    RP: tl.constexpr,
    KV_BLOCK_R: tl.constexpr,
    K_OFF64: tl.constexpr,
    K_STRIDE: tl.constexpr,
    H: tl.constexpr,
    HP: tl.constexpr,
    K_BLOCK_R: tl.constexpr,
    DIRECT: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """Program ``(b, 0)``: the MLA kernel's tile ``b``; program ``(b, 1)``: the indexer kernel's tile ``b``."""
    if tl.program_id(1) == 0:
        _quantize_write_mla_fp8_kernel(
            kv_pool_ptr, kv_ptr, locs_ptr, num_rows, kv_local_pages, kv_page_stride, num_locs, rank, PAGE_SIZE, CP,
            PAGES_PER_RANK, SCHEME, IDX64, KV_OFF64, ROW_STRIDE, KV_STRIDE, L, R, QB, NB, NBP, QBP, RP, DIRECT,
            KV_BLOCK_R, PREROUND,
        )  # fmt: skip
    else:
        _quantize_write_indexer_fp8_kernel(
            index_pool_ptr, k_ptr, locs_ptr, num_rows, index_local_pages, index_page_stride, num_locs, rank,
            PAGE_SIZE, CP, PAGES_PER_RANK, SCHEME, IDX64, K_OFF64, K_STRIDE, H, HP, DIRECT, K_BLOCK_R, PREROUND,
        )  # fmt: skip


def _triton_takes(kv_pool, index_pool, kv_lora_rank: int, page_size: int, head_dim: int) -> bool:
    return _mla_aligned(kv_pool, kv_lora_rank) and _ix_aligned(index_pool, page_size, head_dim)


def _launch(kv_pool, index_pool, kv, k, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim,
            quant_block, page_size) -> None:  # fmt: skip
    n, head_dim = k.shape
    if not _triton_takes(kv_pool, index_pool, kv_lora_rank, page_size, head_dim):
        raise NotImplementedError(
            "backend='triton' for quantize_write_mla_indexer_fp8 needs what both single writes need (kv_lora_rank, "
            "page_size * head_dim and the pools' strides and offsets divisible by 4); use backend='torch'"
        )
    if n == 0 or kv_pool.shape[0] == 0:
        return
    kv, k = kv.contiguous(), k.contiguous()
    nb = kv_lora_rank // quant_block
    hp = triton.next_power_of_2(head_dim)
    kv_cfg = launch_config("quantize_write_mla_fp8", n, kv_pool.device)
    k_cfg = launch_config("quantize_write_indexer_fp8", n, index_pool.device)
    kv_block, k_block = int(kv_cfg["block_r"]), int(k_cfg["block_r"])
    warps = max(int(kv_cfg["num_warps"]), int(k_cfg["num_warps"]))
    kv_off64 = needs_int64(
        kv_pool.shape[0] * kv_pool.stride(0) + kv_pool.shape[1] * kv_pool.stride(1), (n + kv_block) * kv.stride(0)
    )
    k_off64 = needs_int64(
        index_pool.shape[0] * index_pool.stride(0) + index_pool.stride(0), (n + k_block) * k.stride(0)
    )
    with device_ctx(kv_pool.device):
        _quantize_write_mla_indexer_fp8_kernel[(max(cdiv(n, kv_block), cdiv(n, k_block)), 2)](
            kv_pool, kv, index_pool, k, locs, n, kv_pool.shape[0], kv_pool.stride(0), index_pool.shape[0],
            index_pool.stride(0), rank=rank, **locate_args(cp_size, num_pages, scheme_code, page_size),
            ROW_STRIDE=kv_pool.stride(1), KV_STRIDE=kv.stride(0), L=kv_lora_rank, R=rope_dim, QB=quant_block, NB=nb,
            NBP=triton.next_power_of_2(nb), QBP=triton.next_power_of_2(quant_block),
            RP=max(1, triton.next_power_of_2(rope_dim)), KV_BLOCK_R=kv_block, K_STRIDE=k.stride(0), H=head_dim,
            HP=hp, K_BLOCK_R=k_block, PREROUND=INTERPRET, num_warps=warps, KV_OFF64=kv_off64, K_OFF64=k_off64,
            DIRECT=cp_size == 1,
        )  # fmt: skip


def _check(kv_pool, index_pool, kv, k, locs, kv_lora_rank, rope_dim, quant_block, page_size) -> None:
    if isinstance(kv, torch.Tensor) and isinstance(k, torch.Tensor) and kv.dim() and k.dim() and len(kv) != len(k):
        raise ValueError(f"kv and k must have one row per location, got kv.shape={list(kv.shape)}, "
                         f"k.shape={list(k.shape)}")  # fmt: skip
    _mla_check(kv_pool, kv, locs, kv_lora_rank, rope_dim, quant_block)
    _ix_check(index_pool, k, locs, page_size)
    if kv_pool.shape[:2] != (index_pool.shape[0], page_size):
        raise ValueError(
            f"kv_pool and index_pool must hold the same pages of page_size={page_size} tokens, got "
            f"kv_pool.shape={list(kv_pool.shape)}, index_pool.shape={list(index_pool.shape)}"
        )


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::quantize_write_mla_indexer_fp8", mutates_args=("kv_pool", "index_pool"))
def _quantize_write_mla_indexer_fp8_op(
    kv_pool: torch.Tensor,
    index_pool: torch.Tensor,
    kv: torch.Tensor,
    k: torch.Tensor,
    locs: torch.Tensor,
    cp_size: int,
    num_pages: int,
    scheme_code: int,
    rank: int,
    kv_lora_rank: int,
    rope_dim: int,
    quant_block: int,
    page_size: int,
    validate: bool,
    backend: str,
) -> None:
    _check(kv_pool, index_pool, kv, k, locs, kv_lora_rank, rope_dim, quant_block, page_size)
    check_ownership_ints(cp_size, num_pages, scheme_code, rank)
    locs = index_arg(locs)
    if validate:
        validate_locs(locs, page_size=page_size, cp_size=cp_size, num_pages=num_pages, scheme_code=scheme_code,
                      rank=rank, num_local_pages=kv_pool.shape[0], direct=False)  # fmt: skip
    args = (kv_pool, index_pool, kv, k, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim,
            quant_block, page_size)  # fmt: skip
    (_launch if backend == "triton" else quantize_write_mla_indexer_fp8_torch)(*args)


@_quantize_write_mla_indexer_fp8_op.register_fake
def _fake_quantize_write_mla_indexer_fp8(
    kv_pool, index_pool, kv, k, locs, cp_size, num_pages, scheme_code, rank, kv_lora_rank, rope_dim, quant_block,
    page_size, validate, backend,
) -> None:  # fmt: skip
    _check(kv_pool, index_pool, kv, k, locs, kv_lora_rank, rope_dim, quant_block, page_size)
    check_ownership_ints(cp_size, num_pages, scheme_code, rank)


# ----------------------------------------------------------------------------------------- public wrapper
def quantize_write_mla_indexer_fp8(
    kv_pool: torch.Tensor,
    index_pool: torch.Tensor,
    kv: torch.Tensor,
    k: torch.Tensor,
    locs: torch.Tensor,
    ownership: OwnershipLike,
    rank: int,
    *,
    kv_layout: MLAFp8Layout,
    index_layout: IndexerFp8Layout,
    validate: bool | None = None,
    backend: str = "auto",
) -> None:
    """Quantize each token's MLA row and indexer key and write both into this rank's pages, in one launch.

    Writes what ``quantize_write_mla_fp8(kv_pool, kv, locs, ...)`` followed by
    ``quantize_write_indexer_fp8(index_pool, k, locs, ...)`` (owner filter) write.

    Args:
        kv_pool: this rank's fp8 MLA pages of one layer, uint8 ``[P, S, kv_layout.row_bytes]``; mutated.
        index_pool: its indexer pages of the same layer, uint8 ``[P, S * (index_layout.head_dim + 4)]``; mutated.
        kv: MLA rows ``[N, kv_layout.kv_lora_rank + kv_layout.rope_dim]``, bf16/fp16/fp32.
        k: indexer keys ``[N, index_layout.head_dim]``, bf16/fp16/fp32.
        locs: logical token locations, int64/int32 ``[N]``; ``-1`` and rows of foreign pages skipped.
        ownership, rank: the page map and this rank.
        kv_layout, index_layout: the two pools' layouts (same page size).
        validate: host check of ``locs`` before writing; ``None`` = eager yes, compiled only with ``DTKV_DEBUG``.
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` (``"auto"``: torch where either single write's kernel
            would not take the geometry).

    Raises:
        TypeError / ValueError: bad layouts, dtypes, shapes or (validated) locations; nothing written.
    """
    if not isinstance(kv_layout, MLAFp8Layout):
        raise TypeError(f"kv_layout must be a dtkv.MLAFp8Layout, got {type(kv_layout).__name__}")
    if not isinstance(index_layout, IndexerFp8Layout):
        raise TypeError(f"index_layout must be a dtkv.IndexerFp8Layout, got {type(index_layout).__name__}")
    if kv_layout.page_size != index_layout.page_size:
        raise ValueError(f"kv_layout and index_layout must share the page size, got {kv_layout.page_size} and "
                         f"{index_layout.page_size}")  # fmt: skip
    if isinstance(k, torch.Tensor) and k.dim() == 2 and k.shape[1] != index_layout.head_dim:
        raise ValueError(f"k must have shape [*, {index_layout.head_dim}] (index_layout.head_dim), got "
                         f"k.shape={list(k.shape)}")  # fmt: skip
    geom = (kv_layout.kv_lora_rank, kv_layout.rope_dim, kv_layout.quant_block, index_layout.page_size)
    chosen = resolve_backend(backend, kv_pool.device)
    if chosen == "triton" and backend == "auto" and not _triton_takes(kv_pool, index_pool, geom[0], geom[3],
                                                                      index_layout.head_dim):  # fmt: skip
        chosen = "torch"
    torch.ops.dtkv.quantize_write_mla_indexer_fp8(kv_pool, index_pool, kv, k, locs, *ownership_args(ownership), rank,
                                                  *geom, should_validate(validate), chosen)  # fmt: skip
