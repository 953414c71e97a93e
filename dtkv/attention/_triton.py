"""The Triton backend: the registered op ``dtkv::sparse_mla`` (:func:`dtkv.ops.sparse_mla`), fp8 or latent rows."""

from __future__ import annotations

import torch

from dtkv import ops
from dtkv.attention._base import AttentionBackend
from dtkv.attention._rows import page_rows
from dtkv.layouts import MLAFp8Layout

__all__ = ["TritonAttention"]


class TritonAttention(AttentionBackend):
    """One ``dtkv::sparse_mla`` launch per call: bf16/fp16/fp32 queries (float64 queries are computed in float32),
    ``out`` in the query dtype (float32 for float64 queries), ``lse`` float32. Capture-safe; about 31 TFLOP/s on an
    H200, the portable path where FlashMLA does not fit."""

    name = "triton"

    def cast_queries(self, q: torch.Tensor) -> torch.Tensor:
        return q.float() if q.dtype == torch.float64 else q

    def _run(self, q, kv, indices, softmax_scale, schedule, *, decode):
        lay = self.spec.layout
        if q.dtype == torch.float64:
            q = q.float()
        if q.shape[0] == 0 or kv.shape[0] == 0:
            return self._empty(q, q.dtype, torch.float32)
        qb = lay.quant_block if isinstance(lay, MLAFp8Layout) else 0
        rows, indices = page_rows(kv, indices)
        return ops.sparse_mla(
            q, rows, indices, softmax_scale, kv_lora_rank=lay.kv_lora_rank, rope_dim=lay.rope_dim, quant_block=qb,
            backend="triton",
        )  # fmt: skip
