"""A CPU stand-in of the ``flash_mla`` module (``sgl-flash-mla`` 1.0.0, ``use_legacy=True``) for the seam's plumbing.

It implements the three calls :mod:`dtkv.attention`'s FlashMLA backend makes, with the documented semantics and the
checks the wheel makes (from its interface, its compiled checks and deepseek-ai/FlashMLA's ``tests/ref.py``), in
float32 torch: shapes and dtypes (bf16 queries, int32 indices, 64 or 128 heads, ``d_qk`` 576, ``d_v`` 512, fp8 pages
of 64 tokens of 656 bytes with contiguous pages, a top-k that is a multiple of 64, contiguous index rows), the
tile-scheduler metadata filled by the first call and checked against the shapes on every reuse, and
``out = 0``, ``lse = +inf`` for a query with no valid index. Where the real decode kernel would fault (an index past
the cache: it checks no upper bound), this one raises, so a seam that leaks such an index fails its tests.

Not a numerical model of the kernels (no bf16 rounding of keys or probabilities): the GPU tests compare the real
one. Used by ``tests/test_attention_flashmla_fake.py``.
"""

from __future__ import annotations

import dataclasses

import torch

__version__ = "fake-1.0.0"


def has_legacy() -> bool:
    return True


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False
    config: tuple | None = None
    calls: int = 0


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def _attend(q, rows, idx, scale, d_v, invalid):
    """``q [S, H, D]`` float32, ``rows [T, D]`` float32, ``idx [S, K]`` (``invalid`` mask) -> out, lse (+inf empty)."""
    safe = torch.where(invalid, torch.zeros_like(idx), idx).long()
    k = rows[safe]  # [S, K, D]
    s = torch.einsum("shd,skd->shk", q, k) * scale
    s = s.masked_fill(invalid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("shk,skd->shd", p, k[..., :d_v])
    return out, torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)


def _dequant_v32(rows_u8):
    lat = rows_u8[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    sc = rows_u8[:, 512:528].contiguous().view(torch.float32)
    rope = rows_u8[:, 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat(((lat * sc[..., None]).view(-1, 512), rope), dim=1).to(torch.bfloat16).float()


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                           use_legacy=False, **kwargs):  # fmt: skip
    assert use_legacy and is_fp8_kvcache and indices is not None and not causal and num_splits is None
    assert q.dtype == torch.bfloat16, "q must have dtype BFloat16"
    b, s_q, h_q, d = q.shape
    assert h_q in (64, 128) and d == 576 and head_dim_v == 512
    assert k_cache.dtype == torch.uint8 and k_cache.dim() == 4 and k_cache.shape[1:] == (64, 1, 656)
    assert k_cache.stride(1) == 656 and k_cache.stride(-1) == 1, "The whole block must be contiguous"
    assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.stride(-1) == 1
    topk = indices.shape[-1]
    assert topk % 64 == 0, f"topk ({topk}) mod B_TOPK (64) must be 0"
    assert (indices.stride(0) * 4) % 32 == 0 or b == 1, "indices.stride(0) must be 32-byte aligned"
    meta = tile_scheduler_metadata
    config = (b, s_q, h_q, k_cache.shape[1], topk)
    if meta.have_initialized:
        assert meta.config == config, "Your input arguments are inconsistent with sched_meta"
    meta.have_initialized, meta.config = True, config
    meta.calls += 1
    num_slots = k_cache.shape[0] * 64
    if bool(((indices < -1) | (indices >= num_slots)).any()):
        raise RuntimeError("illegal memory access: an index past the KV cache (the decode kernel checks no bound)")
    rows = _dequant_v32(k_cache.reshape(num_slots, 656)) if num_slots else torch.zeros(1, 576)
    flat = indices.reshape(b * s_q, topk)
    out, lse = _attend(q.float().reshape(b * s_q, h_q, d), rows, flat, softmax_scale, 512, flat == -1)
    return out.to(torch.bfloat16).view(b, s_q, h_q, 512), lse.view(b, s_q, h_q).transpose(1, 2).contiguous()


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False,
                         return_log2_lse=None):  # fmt: skip
    assert use_legacy and attn_sink is None and topk_length is None
    assert q.dtype == kv.dtype == torch.bfloat16, "q and kv must have dtype BFloat16"
    s_q, h_q, d = q.shape
    assert h_q in (64, 128) and d == 576 and d_v == 512 and q.stride(1) == d
    assert kv.dim() == 3 and kv.shape[1:] == (1, 576) and kv.stride(-1) == 1
    assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1) and indices.stride(-1) == 1
    topk = indices.shape[-1]
    # the real kernel (csrc/sm90/prefill/sparse/phase1.cuh) asserts this, measured on an H200 with top-k 64
    assert topk % 128 == 0, f"Assertion `params.topk % (2*B_TOPK) == 0` failed (topk={topk})"
    flat = indices.reshape(s_q, topk)
    invalid = (flat < 0) | (flat >= kv.shape[0])  # the prefill kernel skips -1 and entries >= s_kv
    out, lse = _attend(q.float(), kv.float().reshape(-1, 576), flat, sm_scale, d_v, invalid)
    max_logits = torch.zeros_like(lse)
    return out.to(torch.bfloat16), max_logits, lse
