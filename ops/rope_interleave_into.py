"""``dtkv::rope_interleave_into``: the MLA query's interleaved rope, written straight into the attention's query
buffer.

Entry point: :func:`rope_interleave_into`; reference :func:`rope_interleave_torch`. For query rows ``x [H, N, E]``
(head ``h``, token ``n``) and the model's ``cos`` / ``sin`` ``[N, E]`` (``cat(freqs, freqs)``: the first half
holds each pair's angle), ``j < E / 2``::

    out[n, h, j]         = x[h, n, 2j] * c - x[h, n, 2j + 1] * s        c = cos[n, j], s = sin[n, j]
    out[n, h, E / 2 + j] = x[h, n, 2j + 1] * c + x[h, n, 2j] * s

each product, difference and sum rounded to ``x``'s dtype as an eager bf16 / float32 computation of the same
expression rounds it (transformers' ``apply_rotary_pos_emb_interleave``, the MLA rope of DeepSeek-V3.2 and GLM-5),
then converted to ``out``'s dtype: the reference's bits. What the transformers adapter's absorbed attention needs
of a prefill step's rope queries: the eager path reads the rope part of ``q_b_proj``'s output once for each of its
six elementwise ops, writes a concatenated ``[1, H, N, E]`` copy, then copies that into the ``[N, H, R + E]`` query
buffer; the kernel reads ``x`` and the angles once and writes the buffer's rope columns once.

Launch: ``ops/_tuned.py`` op ``"rope_interleave_into"`` (``block_r`` (token, head) rows a program, ``num_warps``).

Legend: ``H`` heads, ``N`` tokens, ``E`` rope dims (even).
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor

from ._common import INTERPRET, bf16_rn, cdiv, device_ctx, resolve_backend, tl, triton
from ._tuned import launch_config

__all__ = ["IN_DTYPES", "OUT_DTYPES", "rope_interleave_into", "rope_interleave_torch"]

IN_DTYPES = (torch.bfloat16, torch.float32)
"""Dtypes of ``x`` (``cos`` and ``sin`` share it)."""
OUT_DTYPES = (torch.bfloat16, torch.float32)
"""Dtypes of ``out``."""


# ----------------------------------------------------------------------------------------- torch reference
def rope_interleave_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`rope_interleave_into`: the rotated rows ``[N, H, E]`` in ``x``'s dtype (the eager
    expression, op by op)."""
    half = x.shape[-1] // 2
    c, s = cos[None, :, :half], sin[None, :, :half]  # [1, N, E/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).transpose(0, 1)


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _rn(v, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """``v`` (float32) rounded to the input dtype's precision (bf16: to nearest even; float32: as is)."""
    if BF16:
        if EMULATE:  # the interpreter truncates
            v = bf16_rn(v).to(tl.float32)
        else:
            v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _rope_interleave_kernel(
    out_ptr,  # [N, H, E]; strides (o_sn, o_sh, 1)
    x_ptr,  # [H, N, E]; strides (x_sh, x_sn, 1)
    cos_ptr,  # [N, E]; strides (c_sn, 1)
    sin_ptr,  # [N, E]; strides (s_sn, 1)
    num_rows,  # N * H
    o_sn,
    o_sh,
    x_sh,
    x_sn,
    c_sn,
    s_sn,
    NH: tl.constexpr,
    HALF: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BF16: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program ``p``: (token, head) rows ``[p * BLOCK_R, +BLOCK_R)``, row ``r`` = token ``r // NH``, head
    ``r % NH``; the ``E / 2`` pairs of each."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = r // NH
    h = r - n * NH
    j = tl.arange(0, HP)
    m = (r < num_rows)[:, None] & (j < HALF)[None, :]
    # the row's dims in one contiguous load, then split into the pairs' even and odd members
    d = tl.arange(0, 2 * HP)
    xm = (r < num_rows)[:, None] & (d < 2 * HALF)[None, :]
    xv = tl.load(x_ptr + (h * x_sh + n * x_sn)[:, None] + d[None, :], mask=xm, other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(xv, [BLOCK_R, HP, 2]))
    c = tl.load(cos_ptr + (n * c_sn)[:, None] + j[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + (n * s_sn)[:, None] + j[None, :], mask=m, other=0.0).to(tl.float32)
    # the eager expression's roundings, op by op (a bf16 x bf16 product is exact in float32 before its rounding)
    lo = _rn(_rn(x1 * c, BF16, EMULATE) - _rn(x2 * s, BF16, EMULATE), BF16, EMULATE)
    hi = _rn(_rn(x2 * c, BF16, EMULATE) + _rn(x1 * s, BF16, EMULATE), BF16, EMULATE)
    orow = out_ptr + (n * o_sn + h * o_sh)[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        if EMULATE:
            lo, hi = bf16_rn(lo), bf16_rn(hi)
        else:
            lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    tl.store(orow + j[None, :], lo, mask=m)
    tl.store(orow + HALF + j[None, :], hi, mask=m)


# ----------------------------------------------------------------------------------------- registered op
def _check(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_tensor("x", x, dtype=IN_DTYPES, ndim=3)
    h, n, e = x.shape
    if e % 2:
        raise ValueError(f"x must have an even number of rope dims (pairs), got x.shape={list(x.shape)}")
    check_tensor("cos", cos, dtype=x.dtype, shape=(n, e), device=x.device)
    check_tensor("sin", sin, dtype=x.dtype, shape=(n, e), device=x.device)
    check_tensor("out", out, dtype=OUT_DTYPES, shape=(n, h, e), device=x.device)
    for name, t in (("x", x), ("cos", cos), ("sin", sin), ("out", out)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got {name}.stride()={t.stride()}")


@torch.library.custom_op("dtkv::rope_interleave_into", mutates_args=("out",))
def _rope_interleave_into_op(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str
) -> None:
    _check(out, x, cos, sin)
    if backend != "triton":
        out.copy_(rope_interleave_torch(x, cos, sin))
        return
    h, n, e = x.shape
    if not out.numel():
        return
    cfg = launch_config("rope_interleave_into", n * h, x.device)
    block_r = int(cfg["block_r"])
    with device_ctx(x.device):
        _rope_interleave_kernel[(cdiv(n * h, block_r),)](
            out, x, cos, sin, n * h, out.stride(0), out.stride(1), x.stride(0), x.stride(1), cos.stride(0),
            sin.stride(0), NH=h, HALF=e // 2, HP=max(1, triton.next_power_of_2(e // 2)), BLOCK_R=block_r,
            BF16=x.dtype == torch.bfloat16, EMULATE=INTERPRET, num_warps=int(cfg["num_warps"]),
            enable_fp_fusion=False,  # no fused multiply-adds: each product rounded on its own, as eager
        )  # fmt: skip


@_rope_interleave_into_op.register_fake
def _fake_rope_interleave_into(out, x, cos, sin, backend) -> None:
    _check(out, x, cos, sin)


# ----------------------------------------------------------------------------------------- public wrapper
def rope_interleave_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Write the interleaved rope of ``x`` into ``out`` (see the module docstring).

    Run phase: one launch, no host synchronization; ``out`` is the only tensor written.

    Args:
        out: ``[N, H, E]`` bf16 or float32, last dim contiguous (e.g. the rope columns ``q[..., R:]`` of an
            ``[N, H, R + E]`` query buffer); mutated.
        x: ``[H, N, E]`` bf16 or float32 (e.g. a head-major view of ``q_b_proj``'s output), last dim contiguous.
        cos, sin: ``[N, E]`` in ``x``'s dtype (the model's rotary embedding of the tokens' positions), last dim
            contiguous; only the first ``E / 2`` columns are read.
        backend: ``"auto"`` (Triton on CUDA, else torch) | ``"torch"`` | ``"triton"``.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, strides, an odd ``E`` (each naming the argument); nothing
            written.
    """
    _check(out, x, cos, sin)
    torch.ops.dtkv.rope_interleave_into(out, x, cos, sin, resolve_backend(backend, x.device))
