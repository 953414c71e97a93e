"""``dtkv::sparse_mla``: MLA attention (MQA over one shared latent row per key) over each query's selected rows.

Entry point: :func:`sparse_mla`; reference :func:`sparse_mla_torch`. For query ``n``, head ``h`` and its selected
rows ``k = kv_rows[indices[n, j]]`` (entries ``-1``, or past the rows, are skipped)::

    s_j = (q[n, h, :L] . k_j[:L] + q[n, h, L:] . k_j[L:]) * sm_scale
    lse[n, h] = log(sum_j exp(s_j))                       natural log; -inf when no row is selected
    out[n, h] = sum_j exp(s_j - lse) * k_j[:L]            the latent part is the value; 0 when no row is selected

``kv_rows`` are stored rows of either format: :class:`dtkv.MLAFp8Layout` rows (uint8 ``[T, row_bytes]``:
``L`` e4m3 with one fp32 scale per ``quant_block`` dims, then ``R`` bf16 rope) dequantized on the fly, or
:class:`dtkv.MLALatentLayout` rows (bf16/fp16/fp32 ``[T, L + R]``) read as they are. So the kernel reads a replicated
pool, a materialized view or a rank's own pages alike, addressed by token slot (``page * page_size + offset``).

The Triton kernel keeps an online softmax in float32 per (query, block of heads). With bf16 queries it rounds the
dequantized keys and the probabilities to bf16 before the tensor-core products, as FlashMLA does; with float32
queries every product is float32 (IEEE). It runs at about 31 TFLOP/s on an H200 (FlashMLA: 440-610, see
:mod:`dtkv.attention`): it is the portable path, not the fast one.

Legend: ``N`` queries, ``H`` heads, ``K`` selected rows per query, ``T`` rows of ``kv_rows``, ``L`` latent dims
(``kv_lora_rank``), ``R`` rope dims, ``QB`` ``quant_block``.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor

from ._common import cdiv, device_ctx, index_arg, resolve_backend, tl, triton

__all__ = ["sparse_mla", "sparse_mla_torch"]

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LATENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------- torch reference
def dequantize_rows(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, quant_block: int) -> torch.Tensor:
    """Stored rows ``[..., row]`` -> ``[..., L + R]`` (latent then rope): fp8 uint8 rows dequantized to float32, float
    latent rows as they are."""
    if rows.dtype != torch.uint8:
        return rows[..., : kv_lora_rank + rope_dim]
    nb = kv_lora_rank // quant_block
    lat = rows[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., kv_lora_rank : kv_lora_rank + 4 * nb].contiguous().view(torch.float32)
    lat = (lat.unflatten(-1, (nb, quant_block)) * scales[..., None]).flatten(-2)
    off = kv_lora_rank + 4 * nb
    pe = rows[..., off : off + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat((lat, pe), dim=-1)


def sparse_mla_torch(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    rope_dim: int,
    quant_block: int,
    *,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`sparse_mla`: ``(out [N, H, L], lse [N, H])`` in ``compute_dtype``.

    ``compute_dtype`` defaults to float64 for float64 queries, else float32. The latent and rope products are two
    separate contractions summed, then scaled, as the reference model writes them (:mod:`dtkv.model.model`).
    """
    dt = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    n, h, _ = q.shape
    L = kv_lora_rank
    idx = indices.to(torch.int64)
    ok = (idx >= 0) & (idx < kv_rows.shape[0])
    if kv_rows.shape[0] == 0:
        sel = torch.zeros((*idx.shape, L + rope_dim), dtype=dt, device=q.device)
    else:
        sel = dequantize_rows(kv_rows[torch.where(ok, idx, 0)], L, rope_dim, quant_block).to(dt)  # [N, K, L + R]
    qd = q.to(dt)
    logits = torch.einsum("nhr,nkr->nhk", qd[..., :L], sel[..., :L])
    if rope_dim:
        logits = logits + torch.einsum("nhe,nke->nhk", qd[..., L:], sel[..., L:])
    logits = (logits * sm_scale).masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    p = torch.where(ok[:, None, :], p, torch.zeros_like(p))  # a query with no row: softmax is NaN, weights 0
    out = torch.einsum("nhk,nkr->nhr", p, sel[..., :L])
    return out.reshape(n, h, L), lse


# ----------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _sparse_mla_kernel(
    q_ptr,  # [N, H, L + R] bf16/fp16/fp32, contiguous
    kv_ptr,  # [T, ROW] uint8 fp8 rows, or [T, ROW] latent rows (row stride ROW elements)
    kvs_ptr,  # fp8: the same storage as float32 (scales); latent: unused
    kvr_ptr,  # fp8: the same storage as bfloat16 (rope); latent: unused
    idx_ptr,  # [N, K] int32/int64, contiguous: token slot of each selected row; -1 skipped
    out_ptr,  # [N, H, L] q's dtype
    lse_ptr,  # [N, H] float32
    sm_scale,
    num_rows,  # T
    num_sel,  # K
    H: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    QB: tl.constexpr,
    ROW: tl.constexpr,
    FP8: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    LOWP: tl.constexpr,  # bf16/fp16 queries
    DOT_F32: tl.constexpr,  # float32 products: float32 queries, and the interpreter (its bf16 tl.dot is wrong)
):
    """Program ``(n, hb)``: heads ``[hb*BH, +BH)`` of query ``n`` over its ``K`` rows, online softmax."""
    n = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = hs < H
    lat = tl.arange(0, L)
    rp = tl.arange(0, R)
    q_base = (n * H + hs)[:, None] * (L + R)
    q_lat = tl.load(q_ptr + q_base + lat[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_ptr + q_base + L + rp[None, :], mask=hmask[:, None], other=0.0)
    if DOT_F32:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, L), dtype=tl.float32)
    for k0 in range(0, num_sel, BK):
        ks = k0 + tl.arange(0, BK)
        row = tl.load(idx_ptr + n * num_sel + ks, mask=ks < num_sel, other=-1).to(tl.int64)
        ok = (row >= 0) & (row < num_rows)
        row = tl.where(ok, row, 0)
        if FP8:
            raw = tl.load(kv_ptr + row[:, None] * ROW + lat[None, :], mask=ok[:, None], other=0)
            sc = tl.load(kvs_ptr + (row[:, None] * ROW + L + (lat[None, :] // QB) * 4) // 4, mask=ok[:, None],
                         other=0.0)  # fmt: skip
            k_lat = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc  # [BK, L]
            k_pe = tl.load(kvr_ptr + (row[:, None] * ROW + L + 4 * (L // QB)) // 2 + rp[None, :], mask=ok[:, None],
                           other=0.0)  # fmt: skip
        else:
            k_lat = tl.load(kv_ptr + row[:, None] * ROW + lat[None, :], mask=ok[:, None], other=0.0)
            k_pe = tl.load(kv_ptr + row[:, None] * ROW + L + rp[None, :], mask=ok[:, None], other=0.0)
        if LOWP:  # half-precision queries: keys rounded to the query dtype before the products (as FlashMLA)
            k_lat, k_pe = k_lat.to(q_ptr.dtype.element_ty), k_pe.to(q_ptr.dtype.element_ty)
        if DOT_F32:
            k_lat, k_pe = k_lat.to(tl.float32), k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if LOWP:  # probabilities rounded likewise before the value product
            p = p.to(q_ptr.dtype.element_ty)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), k_lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, k_lat)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (n * H + hs)[:, None] * L + lat[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + n * H + hs, lse, mask=hmask)


KERNEL_CONFIG: dict[str, int] = {"BH": 32, "BK": 32, "num_warps": 8, "num_stages": 2}
"""Heads and rows per program step, warps, stages on an H200 (the configuration the retired prefill benchmark
harness ran with; ``benchmarks/bench_runtime.py --attention triton`` times it inside the runtime)."""
KERNEL_CONFIG_F32: dict[str, int] = {"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1}
"""float32 queries on the GPU: float32 tiles take twice the registers and shared memory of bf16 ones."""
_INTERPRET_CONFIG: dict[str, int] = {"BH": 16, "BK": 16, "num_warps": 4, "num_stages": 1}


def _check(q, kv_rows, indices, kv_lora_rank: int, rope_dim: int, quant_block: int) -> None:
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3)
    check_tensor("kv_rows", kv_rows, dtype=(torch.uint8, *_LATENT_DTYPES), ndim=2, device=q.device)
    check_tensor("indices", indices, dtype=(torch.int32, torch.int64), ndim=2, device=q.device)
    if kv_lora_rank < 1 or rope_dim < 0:
        raise ValueError(f"kv_lora_rank must be >= 1 and rope_dim >= 0, got {kv_lora_rank} and {rope_dim}")
    if q.shape[2] != kv_lora_rank + rope_dim:
        raise ValueError(
            f"q must have shape [N, H, kv_lora_rank + rope_dim = {kv_lora_rank + rope_dim}], got {list(q.shape)}"
        )
    if indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must have shape [N={q.shape[0]}, K], got indices.shape={list(indices.shape)}")
    if kv_rows.dtype == torch.uint8:
        if quant_block < 1 or kv_lora_rank % quant_block:
            raise ValueError(
                f"quant_block must divide kv_lora_rank for fp8 rows, got quant_block={quant_block}, "
                f"kv_lora_rank={kv_lora_rank}"
            )
        row_bytes = kv_lora_rank + 4 * (kv_lora_rank // quant_block) + 2 * rope_dim
        if kv_rows.shape[1] != row_bytes:
            raise ValueError(f"kv_rows (fp8) must have shape [T, {row_bytes}], got {list(kv_rows.shape)}")
    elif kv_rows.shape[1] != kv_lora_rank + rope_dim:
        raise ValueError(f"kv_rows (latent) must have shape [T, {kv_lora_rank + rope_dim}], got {list(kv_rows.shape)}")


def _pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def check_triton_dims(kv_lora_rank: int, rope_dim: int) -> None:
    """The Triton kernel's dims: ``tl.arange`` and ``tl.dot`` need powers of two >= 16."""
    if not (_pow2(kv_lora_rank) and _pow2(rope_dim)):
        raise ValueError(
            "the Triton sparse_mla kernel needs kv_lora_rank and rope_dim to be powers of two >= 16, "
            f"got kv_lora_rank={kv_lora_rank}, rope_dim={rope_dim}"
        )


# ----------------------------------------------------------------------------------------- registered op
@torch.library.custom_op("dtkv::sparse_mla", mutates_args=())
def _sparse_mla_op(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    rope_dim: int,
    quant_block: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, kv_rows, indices, kv_lora_rank, rope_dim, quant_block)
    if backend != "triton":
        out, lse = sparse_mla_torch(q, kv_rows, indices, sm_scale, kv_lora_rank, rope_dim, quant_block)
        return out.to(q.dtype), lse.to(torch.float32)
    check_triton_dims(kv_lora_rank, rope_dim)
    n, heads, _ = q.shape
    out = torch.empty((n, heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    lse = torch.empty((n, heads), dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    q, idx = q.contiguous(), index_arg(indices)
    rows = kv_rows if kv_rows.stride(1) == 1 and kv_rows.stride(0) == kv_rows.shape[1] else kv_rows.contiguous()
    if rows.shape[0] == 0:
        rows = rows.new_zeros((1, rows.shape[1]))  # every row is skipped (num_rows stays 0): a valid pointer
        num_rows = 0
    else:
        num_rows = rows.shape[0]
    fp8 = rows.dtype == torch.uint8
    if q.device.type != "cuda":
        cfg = _INTERPRET_CONFIG
    else:
        cfg = KERNEL_CONFIG_F32 if q.dtype == torch.float32 else KERNEL_CONFIG
    with device_ctx(q.device):
        _sparse_mla_kernel[(n, cdiv(heads, cfg["BH"]))](
            q, rows, rows.view(torch.float32) if fp8 else rows, rows.view(torch.bfloat16) if fp8 else rows,
            idx, out, lse, sm_scale, num_rows, idx.shape[1],
            H=heads, L=kv_lora_rank, R=rope_dim, QB=max(quant_block, 1), ROW=rows.shape[1], FP8=fp8,
            BH=cfg["BH"], BK=cfg["BK"], LOWP=q.dtype != torch.float32,
            DOT_F32=q.dtype == torch.float32 or q.device.type != "cuda",
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    return out, lse


@_sparse_mla_op.register_fake
def _fake_sparse_mla(q, kv_rows, indices, sm_scale, kv_lora_rank, rope_dim, quant_block, backend):
    _check(q, kv_rows, indices, kv_lora_rank, rope_dim, quant_block)
    n, heads, _ = q.shape
    return q.new_empty((n, heads, kv_lora_rank)), q.new_empty((n, heads), dtype=torch.float32)


# ----------------------------------------------------------------------------------------- public wrapper
def sparse_mla(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    kv_lora_rank: int,
    rope_dim: int,
    quant_block: int = 0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over each query's selected rows (formula in the module docstring). Run phase: no host sync.

    Args:
        q: ``[N, H, L + R]`` bf16/fp16/fp32: the absorbed latent query, then the rope query.
        kv_rows: the stored rows, uint8 ``[T, row_bytes]`` (:class:`dtkv.MLAFp8Layout`) or bf16/fp16/fp32
            ``[T, L + R]`` (:class:`dtkv.MLALatentLayout`), e.g. ``pages.view(-1, row)`` of a pool or a view.
        indices: int32/int64 ``[N, K]`` token slot (row of ``kv_rows``) of each selected key; ``-1`` (and any entry
            outside ``[0, T)``) is skipped.
        sm_scale: multiplies the logits.
        kv_lora_rank, rope_dim: ``L`` and ``R``; Triton needs powers of two >= 16.
        quant_block: latent dims per fp32 scale of fp8 rows (ignored for latent rows).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"``.

    Returns:
        ``(out, lse)``: ``out`` ``[N, H, L]`` in ``q``'s dtype, ``lse`` float32 ``[N, H]`` (natural log); a query with
        no row gets zeros and ``-inf``.
    """
    return torch.ops.dtkv.sparse_mla(
        q, kv_rows, indices, float(sm_scale), kv_lora_rank, rope_dim, quant_block, resolve_backend(backend, q.device)
    )
