"""The FlashMLA backend: ``sgl-flash-mla`` 1.0.0's SM90/SM100 kernels (``use_legacy=True``, DeepSeek-V3.2 format).

========================  ==========================================================================================
pages                     kernel
========================  ==========================================================================================
bf16 latent (576 dims)    ``flash_mla_sparse_fwd(q [N, H, 576], kv [P*S, 1, 576], indices [N, 1, W])`` (prefill and
                          decode; no metadata)
fp8, 656-byte rows        ``flash_mla_with_kvcache(q, kv [P, 64, 1, 656], ..., indices, is_fp8_kvcache=True)``:
                          decode as ``N`` sequences of one query (``[N, 1, H, 576]``), prefill as one sequence of ``N``
                          queries (``[1, N, H, 576]``); the tile-scheduler metadata is built on the device by the
                          first call and reused while the shapes stay (:class:`dtkv.attention.DecodeSchedule`);
                          a prefill call that reads each row many times over (:data:`DEQUANT_PREFILL_READS`):
                          the pages dequantized to bf16 once, then ``flash_mla_sparse_fwd`` as above
========================  ==========================================================================================

The pages are read in place (no copy of the KV, but for that dequantized prefill): a view, a replicated pool or a
rank's own pages, addressed by token slot ``page * 64 + offset``. FlashMLA skips an index of exactly ``-1`` and
checks no upper bound in the decode kernel, so the indices must come from :func:`dtkv.ops.sparse_indices` (bounded
by the pages read) or obey the same rule.

**Empty queries.** For a query whose indices are all ``-1``, FlashMLA returns ``out = 0`` and ``lse = +inf``
(deepseek-ai/FlashMLA ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``: ``o_scale = 0`` and
``lse = cur_L == 0 ? INFINITY : ...``; the split-KV combine and ``csrc/sm90/prefill/sparse/phase1.cuh`` likewise;
``tests/ref.py`` states the same). The seam turns that ``+inf`` into ``-inf`` in place (one elementwise launch), so an
empty partial weighs nothing in :func:`dtkv.decode.combine_partials` (``+inf`` would turn the merge into NaN); a
decode schedule planned with ``merge_lse=False`` skips it.
``tests/test_attention_cuda.py`` and ``benchmarks/bench_flashmla.py`` measure both on the GPU.
"""

from __future__ import annotations

import torch

from dtkv.attention._base import AttentionBackend, DecodeSchedule
from dtkv.attention._fit import B_TOPK, availability, check_fit, flashmla_module
from dtkv.attention._rows import page_rows
from dtkv.ops import dequantize_mla_rows
from dtkv.ops._common import device_ctx

__all__ = ["DEQUANT_PREFILL_READS", "FlashMLAAttention"]

DEQUANT_PREFILL_READS = 16
"""An fp8 prefill call whose index reads (queries x index width) are at least this many times the pages' rows
dequantizes the pages to bf16 once and runs FlashMLA's sparse prefill kernel; other calls run the fp8 kernel on the
pages as they are. At DeepSeek-V3.2's dims a chunk of 8192 queries reads 2048 rows each (256-512 times a 32K-64K
view); a few queries over a long view read less than the dequantization writes."""


def _bf16_rows(kv: torch.Tensor, layout) -> torch.Tensor:
    """fp8 pages ``uint8 [P, S, row_bytes]`` (:class:`dtkv.MLAFp8Layout`, any page stride) as bf16 rows
    ``[P * S, 1, R + E]``: each 128-value block's e4m3 codes times its float32 scale (computed in float32, rounded
    once to bf16), then the bf16 rope part as stored, in one pass (:func:`dtkv.ops.dequantize_mla_rows`)."""
    return dequantize_mla_rows(kv, layout, dtype=torch.bfloat16).unsqueeze(1)


class FlashMLAAttention(AttentionBackend):
    """FlashMLA behind the seam: bf16 queries, int32 indices of a width that is a multiple of 64; ``out`` bf16,
    ``lse`` float32 (natural log, ``-inf`` for empty queries). Capture-safe once a schedule is warmed up.

    Raises:
        NotImplementedError: FlashMLA is not installed or the device is not CUDA (naming how to install it).
        AttentionFitError: ``spec`` or the device breaks a FlashMLA rule (each rule named).
    """

    name = "flashmla"
    index_multiple = B_TOPK

    def __init__(self, spec, device, *, reason: str = "") -> None:
        super().__init__(spec, device, reason=reason)
        # bf16 latent pages go through the sparse prefill kernel, which takes top-k blocks of 2 * B_TOPK
        # (``params.topk % (2*B_TOPK) == 0`` in csrc/sm90/prefill/sparse/phase1.cuh); the fp8 kernel takes B_TOPK
        self.index_multiple = B_TOPK if spec.fp8 else 2 * B_TOPK
        why = availability("flashmla", self.device)
        if why:
            raise NotImplementedError(f"attention='flashmla' is unavailable: {why}")
        check_fit("flashmla", spec, device=self.device)
        self._fm = flashmla_module()[0]

    def _q_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16,)

    def cast_queries(self, q: torch.Tensor) -> torch.Tensor:
        return q.to(torch.bfloat16)

    def plan_decode(self, num_queries: int, width: int, *, merge_lse: bool = True) -> DecodeSchedule:
        schedule = super().plan_decode(num_queries, width, merge_lse=merge_lse)
        if self.spec.fp8:
            schedule.state.update(meta=self._fm.get_mla_metadata()[0], ready=False)
        else:
            schedule.state["ready"] = True
        return schedule

    def _run(self, q, kv, indices, softmax_scale, schedule, *, decode):
        if indices.dtype != torch.int32:
            raise TypeError(f"flashmla needs int32 indices, got indices.dtype={indices.dtype}")
        n, h, c = q.shape
        r = self.spec.kv_lora_rank
        if n == 0 or kv.shape[0] == 0:
            return self._empty(q, torch.bfloat16, torch.float32)
        w = indices.shape[1]
        idx = indices.contiguous()  # FlashMLA: contiguous last dim, stride(0) 32-byte aligned (W % 64 == 0)
        fm = self._fm
        with device_ctx(q.device):
            if not self.spec.fp8:
                rows, sel = page_rows(kv, idx)  # a page-major layer: its rows without a copy
                out, _, lse = fm.flash_mla_sparse_fwd(
                    q.contiguous(), rows.view(-1, 1, c), sel.view(n, 1, w), softmax_scale, d_v=r, use_legacy=True
                )
            elif not decode and w % (2 * B_TOPK) == 0 and n * w >= DEQUANT_PREFILL_READS * kv.shape[0] * kv.shape[1]:
                # a prefill chunk reads each row many times over: dequantize the pages once to bf16 and take the
                # sparse prefill kernel (its tensor-core loop outruns the fp8 kernel's in-loop dequantization)
                rows = _bf16_rows(kv, self.spec.layout)
                out, _, lse = fm.flash_mla_sparse_fwd(
                    q.contiguous(), rows, idx.view(n, 1, w), softmax_scale, d_v=r, use_legacy=True
                )
            else:
                b, s_q = (n, 1) if decode else (1, n)
                meta = schedule.state["meta"] if schedule is not None else fm.get_mla_metadata()[0]
                out, lse = fm.flash_mla_with_kvcache(
                    q.reshape(b, s_q, h, c), kv.unsqueeze(2), None, None, r, meta, softmax_scale=softmax_scale,
                    is_fp8_kvcache=True, indices=idx.view(b, s_q, w), use_legacy=True,
                )  # fmt: skip
                if schedule is not None:
                    schedule.state["ready"] = True
                out = out.view(n, h, r)
                lse = lse.view(n, h) if decode else lse.view(h, n).t()  # FlashMLA's lse is [b, h, s_q]
            if schedule is None or schedule.merge_lse:  # an empty query: FlashMLA's +inf -> -inf (weighs nothing)
                lse.nan_to_num_(nan=float("nan"), posinf=float("-inf"), neginf=float("-inf"))
        return out, lse
