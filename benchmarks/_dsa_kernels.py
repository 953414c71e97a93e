"""The DSA layer's read side for ``bench_prefill.py``: indexer scoring over paged fp8 keys and sparse MLA attention.

Each has a torch reference (CPU runs and tests) and a Triton kernel (GPU). Both read the KV *through* page tables and
token locations, so the same kernel serves a replicated pool (logical coordinates) and a materialized full view
(view coordinates after :func:`dtkv.ops.remap`). The sparse MLA itself lives in the library as ``dtkv::sparse_mla``
(:func:`dtkv.ops.sparse_mla`, one of the :mod:`dtkv.attention` backends); :func:`sparse_mla` here calls it.

- :func:`indexer_logits`: ``logits[i, j] = s_j * sum_h w[i, h] * relu(q[i, h] . k_j)`` for key positions
  ``j <= pos_i`` (else ``-inf``): fp8 e4m3 queries ``[n, H, D]`` against the fp8 keys of an indexer page
  (``D`` bytes per token, then one fp32 scale per token); ``tl.dot`` on fp8 operands.
- :func:`sparse_mla`: MQA over the top-k rows of each query: ``softmax(q . k * scale) v`` with ``k`` the dequantized
  656-byte fp8 row (latent ``[0, L)`` in e4m3 with one fp32 scale per ``quant_block`` dims, then bf16 rope) and
  ``v`` its latent part; locations ``-1`` are skipped (:func:`dtkv.ops.sparse_mla`).
- :func:`sparse_mla_standin`: the same FLOPs as :func:`sparse_mla` as two dense bf16 GEMMs per slab of queries,
  against one shared set of ``top_k`` rows gathered from the view (the rows of the first query): what the benchmark
  runs as ``--attention standin`` (a labelled option: FlashMLA is the kernel the benchmark runs by default).

Legend: ``n`` queries, ``H`` heads, ``D`` dims, ``S`` page size, ``K`` top-k, ``L`` latent dims, ``R`` rope dims.
"""

from __future__ import annotations

import torch

from dtkv import ops
from dtkv.ops.sparse_mla import dequantize_rows
from dtkv.ops.sparse_mla import sparse_mla_torch as _sparse_mla_torch

__all__ = [
    "FLASHMLA_SPARSE_PREFILL_TFLOPS",
    "INDEXER_CONFIGS",
    "dequantize_rows",
    "indexer_flops",
    "indexer_logits",
    "indexer_logits_torch",
    "sparse_mla",
    "sparse_mla_flops",
    "sparse_mla_standin",
    "sparse_mla_torch",
]

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
# The Triton sparse MLA is the registered op ``dtkv::sparse_mla`` (``ops/sparse_mla.py``); these wrappers keep this
# module's call signature (output only, bf16) for the benchmarks and probes.
def sparse_mla_torch(q, kv_rows, locs, scale: float, kv_lora: int, rope: int, quant_block: int) -> torch.Tensor:
    """Reference of :func:`sparse_mla`: ``[n, H, L]`` bf16 (:func:`dtkv.ops.sparse_mla.sparse_mla_torch`)."""
    return _sparse_mla_torch(q, kv_rows, locs, scale, kv_lora, rope, quant_block)[0].to(torch.bfloat16)


def sparse_mla(q, kv_rows, locs, scale: float, kv_lora: int, rope: int, quant_block: int, *, backend: str = "auto"):
    """Sparse MLA over the selected rows: ``[n, H, L]`` in ``q``'s dtype (:func:`dtkv.ops.sparse_mla`).

    Args:
        q: bf16 ``[n, H, L + R]`` (absorbed latent query, then rope). kv_rows: uint8 ``[rows, row_bytes]``.
        locs: int32 ``[n, K]`` row of each selected token, ``-1`` skipped.
    """
    return ops.sparse_mla(q, kv_rows, locs, scale, kv_lora_rank=kv_lora, rope_dim=rope, quant_block=quant_block,
                          backend=backend)[0]  # fmt: skip


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
