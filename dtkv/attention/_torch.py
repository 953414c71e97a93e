"""The torch reference backend: every device, float32 (float64 for float64 queries) math; the parity reference."""

from __future__ import annotations

import torch

from dtkv.attention._base import AttentionBackend
from dtkv.attention._rows import page_rows
from dtkv.layouts import MLAFp8Layout
from dtkv.ops.sparse_mla import sparse_mla_torch

__all__ = ["TorchAttention"]


class TorchAttention(AttentionBackend):
    """Gathers the selected rows, dequantizes them and runs the softmax in the compute dtype (float64 for float64
    queries, else float32): :func:`dtkv.ops.sparse_mla.sparse_mla_torch`. ``out`` and ``lse`` come back in that
    dtype. Reads only the selected rows (never the whole view); tensor work only, no host sync."""

    name = "torch"

    def _run(self, q, kv, indices, softmax_scale, schedule, *, decode):
        lay = self.spec.layout
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        if q.shape[0] == 0 or kv.shape[0] == 0:
            return self._empty(q, dt, dt)
        qb = lay.quant_block if isinstance(lay, MLAFp8Layout) else 0
        rows, indices = page_rows(kv, indices)
        return sparse_mla_torch(q, rows, indices, softmax_scale, lay.kv_lora_rank, lay.rope_dim, qb, compute_dtype=dt)
