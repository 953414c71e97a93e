"""``dtkv::quantize_indexer_queries``: DeepSeek-V3.2's fp8 indexer queries, in one kernel: each (query, head) row
in e4m3 with its own scale, the scale folded into the head weight.

Entry point: :func:`quantize_indexer_queries`; reference :func:`quantize_indexer_queries_torch`. For each query
``n`` and head ``i`` (``x = q[n, i, :]`` in float32)::

    amax = max |x|,   scale = amax / 448,   codes = e4m3(x * (448 / amax))   (RNE, saturating; amax 0: zeros)
    w_out[n, i] = w[n, i] * scale * softmax_scale

(:func:`dtkv.ops.quantize_indexer_fp8`'s rule, with the same IEEE operations: the kernel's divisions are
correctly rounded, its conversion the hardware's saturating one), so that ``sum_i w_out_i * relu(codes_i . k)`` is
the indexer's ``sum_i w_i * relu(softmax_scale * x_i . k)`` up to the queries' rounding (``relu`` is positively
homogeneous). The kernel reads ``q`` in its own dtype and strides (no float32 copy of it) and writes the codes and
the weights: one launch instead of the reference's eight passes over a float32 ``[N, I, J]``. Its bits are the
reference's (``tests/test_ops_quantize_indexer_queries.py``).

Launch: :data:`KERNEL_CONFIG` (``block_r`` (query, head) rows a program, ``num_warps``).

Legend: ``N`` queries, ``I`` indexer heads, ``J`` dims (padded ``JP``).
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor

from ._common import INTERPRET, cdiv, device_ctx, e4m3_bits, e4m3_blocks_torch, resolve_backend, tl, triton

__all__ = ["KERNEL_CONFIG", "quantize_indexer_queries", "quantize_indexer_queries_torch"]

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

KERNEL_CONFIG: dict[str, int] = {"block_r": 16, "num_warps": 4}
"""(query, head) rows per program and warps (128 dims: a ``[16, 128]`` tile, 16 values a thread)."""


# ----------------------------------------------------------------------------------------- torch reference
def quantize_indexer_queries_torch(q: torch.Tensor, w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`quantize_indexer_queries`: ``(codes uint8 [N, I, J], weights float32 [N, I])``."""
    if q.shape[-1] == 0:  # rows of no dims: all-zero rows (scale 0)
        return q.new_empty(q.shape, dtype=torch.uint8), torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    codes, q_scale = e4m3_blocks_torch(q.float())
    return codes, w.float() * q_scale * scale


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _quantize_indexer_queries_kernel(
    codes_ptr,  # [N, I, J] uint8, contiguous
    w_out_ptr,  # [N, I] float32, contiguous
    q_ptr,  # [N, I, J] bf16/fp16/fp32/fp64; strides (q_sn, q_si, 1)
    w_ptr,  # [N, I] floating; strides (w_sn, w_si)
    num_rows,  # N * I
    q_sn,
    q_si,
    w_sn,
    w_si,
    scale,  # float32: folded into the weights
    NH: tl.constexpr,
    J: tl.constexpr,
    JP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """Program ``b``: (query, head) rows ``[b * BLOCK_R, +BLOCK_R)``, row ``r`` = query ``r // NH``, head
    ``r % NH``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    n = r // NH
    i = r - n * NH
    cj = tl.arange(0, JP)
    m = r_ok[:, None] & (cj < J)[None, :]
    x = tl.load(q_ptr + (n * q_sn + i * q_si)[:, None] + cj[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    pos = amax > 0
    q_scale = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)
    inv = tl.where(pos, tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.where(pos, amax, 1.0)), 1.0)
    tl.store(codes_ptr + r[:, None] * J + cj[None, :], e4m3_bits(x * inv[:, None], PREROUND), mask=m)
    w = tl.load(w_ptr + n * w_sn + i * w_si, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(w_out_ptr + r, w * q_scale * scale, mask=r_ok)


# ----------------------------------------------------------------------------------------- registered op
def _check(q, w, scale) -> None:
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3)
    check_tensor("w", w, dtype=_Q_DTYPES, shape=tuple(q.shape[:2]), device=q.device)
    if not scale > 0:
        raise ValueError(f"scale must be > 0 (relu commutes only with a positive scale), got scale={scale}")


@torch.library.custom_op("dtkv::quantize_indexer_queries", mutates_args=())
def _quantize_indexer_queries_op(
    q: torch.Tensor, w: torch.Tensor, scale: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, w, scale)
    if backend != "triton":
        return quantize_indexer_queries_torch(q, w, scale)
    n, heads, hd = q.shape
    codes = torch.empty((n, heads, hd), dtype=torch.uint8, device=q.device)
    w_out = torch.empty((n, heads), dtype=torch.float32, device=q.device)
    if codes.numel():
        src = q if q.stride(2) == 1 else q.contiguous()
        block_r = int(KERNEL_CONFIG["block_r"])
        with device_ctx(q.device):
            _quantize_indexer_queries_kernel[(cdiv(n * heads, block_r),)](
                codes, w_out, src, w, n * heads, src.stride(0), src.stride(1), w.stride(0), w.stride(1), float(scale),
                NH=heads, J=hd, JP=1 << max(0, hd - 1).bit_length(), BLOCK_R=block_r, PREROUND=INTERPRET,
                num_warps=int(KERNEL_CONFIG["num_warps"]),
            )  # fmt: skip
    elif w_out.numel():
        w_out.zero_()  # J == 0: every row is all-zero (scale 0)
    return codes, w_out


@_quantize_indexer_queries_op.register_fake
def _fake_quantize_indexer_queries(q, w, scale, backend):
    _check(q, w, scale)
    return q.new_empty(q.shape, dtype=torch.uint8), q.new_empty(q.shape[:2], dtype=torch.float32)


# ----------------------------------------------------------------------------------------- public wrapper
def quantize_indexer_queries(
    q: torch.Tensor, w: torch.Tensor, *, scale: float = 1.0, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's fp8 indexer queries and their weights (see the module docstring).

    Run phase: one launch, no host synchronization.

    Args:
        q: indexer queries ``[N, I, J]`` (bf16, fp16, float32 or float64, rounded to float32 first; any strides: a
            last dim that is not contiguous is copied first).
        w: head weights ``[N, I]`` (likewise).
        scale: ``> 0``, folded into the weights (e.g. the indexer's ``softmax_scale``:
            ``sum_i w_i * relu(scale * q_i . k) = sum_i (w_i * scale) * relu(q_i . k)``).
        backend: ``"auto"`` (Triton on CUDA, else torch) | ``"torch"`` | ``"triton"``.

    Returns:
        ``(codes float8_e4m3fn [N, I, J], w * q_scale * scale float32 [N, I])``.

    Raises:
        TypeError / ValueError: bad dtypes or shapes (naming the argument), a non-positive ``scale``.
    """
    _check(q, w, scale)
    codes, w_out = torch.ops.dtkv.quantize_indexer_queries(q, w, float(scale), resolve_backend(backend, q.device))
    return codes.view(torch.float8_e4m3fn), w_out
