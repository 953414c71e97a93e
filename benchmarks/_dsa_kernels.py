"""The DSA layer's read side for ``bench_prefill.py``: indexer scoring over paged fp8 keys and sparse MLA attention.

Each has a torch reference (CPU runs and tests) and a Triton kernel (GPU). Both read the KV *through* page tables and
token locations, so the same kernel serves a replicated pool (logical coordinates) and a materialized full view
(view coordinates after :func:`dtkv.ops.remap`).

- :func:`indexer_logits`: ``logits[i, j] = s_j * sum_h w[i, h] * relu(q[i, h] . k_j)`` for key positions
  ``j <= pos_i`` (else ``-inf``): fp8 e4m3 queries ``[n, H, D]`` against the fp8 keys of an indexer page
  (``D`` bytes per token, then one fp32 scale per token); ``tl.dot`` on fp8 operands.
- :func:`sparse_mla`: MQA over the top-k rows of each query: ``softmax(q . k * scale) v`` with ``k`` the dequantized
  656-byte fp8 row (latent ``[0, L)`` in e4m3 with one fp32 scale per ``quant_block`` dims, then bf16 rope) and
  ``v`` its latent part; locations ``-1`` are skipped.
- :func:`sparse_mla_standin`: the same FLOPs as :func:`sparse_mla` as two dense bf16 GEMMs per slab of queries,
  against one shared set of ``top_k`` rows gathered from the view (the rows of the first query): what the benchmark
  runs where the Triton kernel is far below FlashMLA's published throughput.

Legend: ``n`` queries, ``H`` heads, ``D`` dims, ``S`` page size, ``K`` top-k, ``L`` latent dims, ``R`` rope dims.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

FLASHMLA_SPARSE_PREFILL_TFLOPS = 640.0
"""FlashMLA's published sparse-prefill throughput on H800 (bf16 MQA over top-k rows), the reference we compare to."""

INDEXER_CONFIGS = [
    {"BQ": 64, "BK": 128, "num_warps": 4, "num_stages": 3},
    {"BQ": 128, "BK": 128, "num_warps": 8, "num_stages": 3},
]
"""Launch configurations tried on the GPU (the fastest is kept)."""
SPARSE_MLA_CONFIG = {"BH": 32, "BK": 32, "num_warps": 8, "num_stages": 2}


def indexer_flops(q_pos: torch.Tensor, heads: int, dim: int) -> float:
    """Useful FLOPs of :func:`indexer_logits`: ``2 * H * D`` per (query, visible key)."""
    return 2.0 * heads * dim * float((q_pos.double() + 1).sum())


def sparse_mla_flops(n: int, heads: int, top_k: int, kv_lora: int, rope: int) -> float:
    return 2.0 * n * heads * top_k * (2 * kv_lora + rope)


# ------------------------------------------------------------------------------------------- indexer
def indexer_logits_torch(q, w, k_pages, page_table, q_pos, kv_len: int, page_size: int) -> torch.Tensor:
    """Reference of :func:`indexer_logits` (float32; dequantizes every visible key)."""
    n, heads, dim = q.shape
    pos = torch.arange(kv_len, device=q.device)
    pages = k_pages[page_table.long()[pos // page_size]]  # [kv_len, S*(D+4)] (one page per key: fine for references)
    off = pos % page_size
    key_bytes = pages.gather(1, (off[:, None] * dim + torch.arange(dim, device=q.device)).long())
    keys = key_bytes.view(torch.float8_e4m3fn).float()  # [kv_len, D]
    scale_bytes = pages.gather(1, (page_size * dim + off[:, None] * 4 + torch.arange(4, device=q.device)).long())
    scales = scale_bytes.contiguous().view(torch.float32).squeeze(1)
    s = torch.einsum("nhd,kd->nhk", q.view(torch.float8_e4m3fn).float(), keys).clamp_min(0)
    logits = torch.einsum("nhk,nh->nk", s, w.float()) * scales[None, :]
    return logits.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))


if HAS_TRITON:

    @triton.jit
    def _indexer_logits_kernel(
        q_ptr,  # [n, H, D] uint8 (e4m3 bytes), contiguous
        w_ptr,  # [n, H] float32
        k_ptr,  # [P, S*(D+4)] uint8 indexer pages (page stride page_stride bytes)
        ks_ptr,  # the same storage as float32 (for the per-token scales)
        pt_ptr,  # [num_kv_pages] int32: page of each logical page of the request
        qpos_ptr,  # [n] int64 absolute query positions
        out_ptr,  # [n, >= kv_len] float32, row stride out_stride
        n,
        kv_len,
        page_stride,
        out_stride,
        H: tl.constexpr,
        D: tl.constexpr,
        S: tl.constexpr,
        BQ: tl.constexpr,
        BK: tl.constexpr,
    ):
        """Program ``(qb, kb)``: logits of queries ``[qb*BQ, +BQ)`` against keys ``[kb*BK, +BK)``, all heads."""
        qs = tl.program_id(0) * BQ + tl.arange(0, BQ)
        ks = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
        qmask, kmask = qs < n, ks < kv_len
        qpos = tl.load(qpos_ptr + qs, mask=qmask, other=-1)
        visible = tl.program_id(1).to(tl.int64) * BK <= tl.max(qpos, axis=0)
        page = tl.load(pt_ptr + ks // S, mask=kmask, other=0).to(tl.int64)
        off = ks % S
        dims = tl.arange(0, D)
        k_t = tl.load(k_ptr + (page * page_stride + off * D)[None, :] + dims[:, None], mask=kmask[None, :], other=0)
        k_t = k_t.to(tl.float8e4nv, bitcast=True)  # [D, BK]
        scale = tl.load(ks_ptr + (page * page_stride + S * D + off * 4) // 4, mask=kmask, other=0.0)
        acc = tl.zeros((BQ, BK), dtype=tl.float32)
        for h in range(0, H * visible.to(tl.int32)):  # no head loop for tiles past every query (causal)
            q_h = tl.load(q_ptr + (qs.to(tl.int64) * H + h)[:, None] * D + dims[None, :], mask=qmask[:, None], other=0)
            s = tl.dot(q_h.to(tl.float8e4nv, bitcast=True), k_t)
            w_h = tl.load(w_ptr + qs * H + h, mask=qmask, other=0.0)
            acc += tl.maximum(s, 0.0) * w_h[:, None]
        logits = tl.where(ks[None, :] <= qpos[:, None], acc * scale[None, :], float("-inf"))
        dst = out_ptr + qs.to(tl.int64)[:, None] * out_stride + ks[None, :]
        tl.store(dst, logits, mask=qmask[:, None] & kmask[None, :])


def indexer_logits(
    q, w, k_pages, page_table, q_pos, kv_len: int, page_size: int, *, config=None, out=None, interpret: bool = False
):
    """Indexer scores ``[n, kv_len]`` float32 (see the module docstring).

    Args:
        q: uint8 ``[n, H, D]`` e4m3 bytes. w: float32 ``[n, H]``. k_pages: uint8 ``[P, S*(D+4)]``.
        page_table: int32 ``[ceil(kv_len / S)]`` page of each logical page. q_pos: int64 ``[n]``.
    """
    if q.device.type != "cuda" and not interpret:
        return indexer_logits_torch(q, w, k_pages, page_table, q_pos, kv_len, page_size)
    cfg = config or INDEXER_CONFIGS[0]
    n, heads, dim = q.shape
    out = torch.empty((n, kv_len), dtype=torch.float32, device=q.device) if out is None else out[:, :kv_len]
    grid = (triton.cdiv(n, cfg["BQ"]), triton.cdiv(kv_len, cfg["BK"]))
    _indexer_logits_kernel[grid](
        q, w, k_pages, k_pages.view(torch.float32), page_table, q_pos, out, n, kv_len, k_pages.stride(0), out.stride(0),
        H=heads, D=dim, S=page_size, BQ=cfg["BQ"], BK=cfg["BK"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------- sparse MLA
def dequantize_rows(rows: torch.Tensor, kv_lora: int, rope: int, quant_block: int) -> torch.Tensor:
    """fp8 rows uint8 ``[..., row_bytes]`` -> float32 ``[..., L + R]``."""
    nb = kv_lora // quant_block
    lat = rows[..., :kv_lora].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., kv_lora : kv_lora + 4 * nb].contiguous().view(torch.float32)
    lat = (lat.unflatten(-1, (nb, quant_block)) * scales[..., None]).flatten(-2)
    pe = rows[..., kv_lora + 4 * nb : kv_lora + 4 * nb + 2 * rope].contiguous().view(torch.bfloat16).float()
    return torch.cat((lat, pe), dim=-1)


def sparse_mla_torch(q, kv_rows, locs, scale: float, kv_lora: int, rope: int, quant_block: int) -> torch.Tensor:
    """Reference of :func:`sparse_mla`: ``[n, H, L]`` bf16."""
    safe = locs.long().clamp_min(0)
    k = dequantize_rows(kv_rows[safe], kv_lora, rope, quant_block)  # [n, K, L+R]
    s = torch.einsum("nhd,nkd->nhk", q.float(), k) * scale
    s = s.masked_fill((locs < 0)[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("nhk,nkd->nhd", p, k[..., :kv_lora]).to(torch.bfloat16)


if HAS_TRITON:

    @triton.jit
    def _sparse_mla_kernel(
        q_ptr,  # [n, H, L + R] bf16, contiguous
        kv_ptr,  # [rows, ROW] uint8 fp8 rows (row stride ROW bytes)
        kvs_ptr,  # the same storage as float32 (scales)
        kvr_ptr,  # the same storage as bfloat16 (rope)
        idx_ptr,  # [n, K] int32 row of each selected token; -1 skipped
        out_ptr,  # [n, H, L] bf16
        sm_scale,
        H: tl.constexpr,
        L: tl.constexpr,
        R: tl.constexpr,
        QB: tl.constexpr,
        ROW: tl.constexpr,
        TOPK: tl.constexpr,
        BH: tl.constexpr,
        BK: tl.constexpr,
        DOT_F32: tl.constexpr,  # the CPU interpreter's bf16 tl.dot is wrong (Triton 3.7): upcast there
    ):
        """Program ``(i, hb)``: heads ``[hb*BH, +BH)`` of query ``i`` over its ``TOPK`` rows, online softmax."""
        i = tl.program_id(0).to(tl.int64)
        hs = tl.program_id(1) * BH + tl.arange(0, BH)
        hmask = hs < H
        lat = tl.arange(0, L)
        rp = tl.arange(0, R)
        q_base = (i * H + hs)[:, None] * (L + R)
        q_lat = tl.load(q_ptr + q_base + lat[None, :], mask=hmask[:, None], other=0.0)
        q_pe = tl.load(q_ptr + q_base + L + rp[None, :], mask=hmask[:, None], other=0.0)
        if DOT_F32:
            q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
        m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BH,), dtype=tl.float32)
        acc = tl.zeros((BH, L), dtype=tl.float32)
        for k0 in range(0, TOPK, BK):
            ks = k0 + tl.arange(0, BK)
            row = tl.load(idx_ptr + i * TOPK + ks, mask=ks < TOPK, other=-1).to(tl.int64)
            ok = row >= 0
            row = tl.where(ok, row, 0)
            raw = tl.load(kv_ptr + row[:, None] * ROW + lat[None, :], mask=ok[:, None], other=0)
            sc = tl.load(
                kvs_ptr + (row[:, None] * ROW + L + (lat[None, :] // QB) * 4) // 4, mask=ok[:, None], other=0.0
            )
            k_lat = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(tl.bfloat16)  # [BK, L]
            k_pe = tl.load(kvr_ptr + (row[:, None] * ROW + L + 4 * (L // QB)) // 2 + rp[None, :], mask=ok[:, None],
                           other=0.0)  # fmt: skip
            if DOT_F32:
                k_lat, k_pe = k_lat.to(tl.float32), k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_pe, tl.trans(k_pe))
            s = tl.where(ok[None, :], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p_dot = p.to(tl.bfloat16).to(tl.float32) if DOT_F32 else p.to(tl.bfloat16)
            acc = acc * alpha[:, None] + tl.dot(p_dot, k_lat)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (i * H + hs)[:, None] * L + lat[None, :], out.to(tl.bfloat16), mask=hmask[:, None])


def sparse_mla(
    q, kv_rows, locs, scale: float, kv_lora: int, rope: int, quant_block: int, *, config=None, interpret: bool = False
):
    """Sparse MLA over the selected rows: ``[n, H, L]`` bf16 (see the module docstring).

    Args:
        q: bf16 ``[n, H, L + R]`` (absorbed latent query, then rope). kv_rows: uint8 ``[rows, row_bytes]``.
        locs: int32 ``[n, K]`` row of each selected token, ``-1`` skipped.
    """
    if q.device.type != "cuda" and not interpret:
        return sparse_mla_torch(q, kv_rows, locs, scale, kv_lora, rope, quant_block)
    cfg = config or SPARSE_MLA_CONFIG
    n, heads, _ = q.shape
    top_k = locs.shape[1]
    out = torch.empty((n, heads, kv_lora), dtype=torch.bfloat16, device=q.device)
    grid = (n, triton.cdiv(heads, cfg["BH"]))
    _sparse_mla_kernel[grid](
        q, kv_rows, kv_rows.view(torch.float32), kv_rows.view(torch.bfloat16), locs, out, scale,
        H=heads, L=kv_lora, R=rope, QB=quant_block, ROW=kv_rows.shape[1], TOPK=top_k, BH=cfg["BH"], BK=cfg["BK"],
        DOT_F32=q.device.type != "cuda", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def sparse_mla_standin(q, kv_rows, locs, scale: float, kv_lora: int, rope: int, quant_block: int, *, slab: int = 256):
    """The FLOPs of :func:`sparse_mla` as dense bf16 GEMMs: ``(q k^T) v`` per slab of ``slab`` queries against the
    dequantized rows selected for query 0 (a dependency on the view and the remapped top-k; no softmax)."""
    n, heads, dqk = q.shape
    k = dequantize_rows(kv_rows[locs[0].long().clamp_min(0)], kv_lora, rope, quant_block).to(q.dtype)  # [K, L+R]
    v = k[:, :kv_lora].contiguous()
    out = torch.empty((n, heads, kv_lora), dtype=q.dtype, device=q.device)
    flat_q, flat_out = q.view(n * heads, dqk), out.view(n * heads, kv_lora)
    rows = slab * heads
    for lo in range(0, n * heads, rows):
        s = torch.mm(flat_q[lo : lo + rows], k.t())
        torch.mm(s, v, out=flat_out[lo : lo + rows])
    return out
