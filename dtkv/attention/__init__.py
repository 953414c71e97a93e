"""Attention backends: existing sparse-MLA kernels read dtkv's views, replicated pools and shards through one seam.

A backend is index preparation plus a kernel call, no model math of its own. Three are registered:

============  ===========================================================================================  =========
name          kernel                                                                                       devices
============  ===========================================================================================  =========
``torch``     gather + float32 (float64 for float64 queries) softmax: the parity reference                 every
``triton``    ``dtkv::sparse_mla`` (:func:`dtkv.ops.sparse_mla`), about 31 TFLOP/s on an H200              CUDA
``flashmla``  FlashMLA (``sgl-flash-mla==1.0.0``, ``use_legacy=True``): sparse prefill at 484-606 TFLOP/s    SM90/100
              and fp8 sparse decode in 36-81 us per layer on an H200
============  ===========================================================================================  =========

Entry points:

- :class:`AttentionSpec` (heads per rank, KV layout, top-k) and :func:`resolve_attention` (plan):
  ``resolve_attention("auto" | "torch" | "triton" | "flashmla", spec=..., device=...)`` -> :class:`AttentionBackend`.
  A name never falls back; ``"auto"`` takes the fastest backend that is available and fits (:data:`AUTO_ORDER`),
  logs the choice and keeps it in ``backend.reason``.
- :func:`check_fit` / :func:`fit_errors`: the rules (FlashMLA: 64 or 128 heads per rank, ``kv_lora_rank`` 512 +
  ``rope_dim`` 64, fp8 pages of 64 tokens in the 656-byte row, bf16 latent pages, index width a multiple of
  :data:`B_TOPK`); :class:`AttentionFitError` names each broken rule. :func:`available_backends`.
- indices (run, on the device, no host sync): :meth:`AttentionBackend.indices` (logical token locations -> int32
  slots of the pages read, through a view's ``MaterializePlan.page_map``, a pool's page map or
  :func:`owned_page_map`; or key positions through per-query page tables, e.g. a rank-local one with ``-1`` for
  pages it does not own; ``-1`` preserved; bounded by the pages read; padded to the kernel's multiple: one
  :func:`dtkv.ops.sparse_indices` launch), :func:`positions_to_locs`, :func:`dense_page_table` (CSR -> dense).
- run: :meth:`AttentionBackend.prefill` (eager) and :meth:`AttentionBackend.decode` (CUDA-graph capturable after a
  warm-up, with a :class:`DecodeSchedule` from :meth:`AttentionBackend.plan_decode` per batch shape), one contract::

      out [N, H, R], lse [N, H] = backend.prefill(q [N, H, R + E], kv [P, S, *row], indices [N, W], softmax_scale=s)

  ``lse`` is the natural-log log-sum-exp of the scaled logits (float32; the torch backend's compute dtype). A query
  whose indices are all ``-1`` gets ``out = 0``, ``lse = -inf`` on every backend -- FlashMLA itself returns
  ``out = 0``, ``lse = +inf`` (read from its sources; the seam rewrites it), so a rank can pass its own pages with
  the rows it does not own set to ``-1`` and merge with :func:`dtkv.decode.combine_partials` /
  :func:`dtkv.decode.merge_partials` (cast ``out`` to ``lse``'s dtype first).

FlashMLA is optional: CPU machines and CI never install it. On GPU machines install it next to the existing torch
with ``pip install --no-deps sgl-flash-mla==1.0.0`` (:data:`FLASHMLA_INSTALL`; its metadata asks for torch>=2.14.1,
which without ``--no-deps`` would replace the installed torch; the wheel loads on torch 2.11 through the stable ABI).
"""

from __future__ import annotations

from dtkv.attention._base import AttentionBackend, DecodeSchedule
from dtkv.attention._fit import (
    B_TOPK,
    FLASHMLA_HEADS,
    FLASHMLA_INSTALL,
    FLASHMLA_PAGE_SIZE,
    availability,
    check_fit,
    fit_errors,
)
from dtkv.attention._indices import dense_page_table, owned_page_map, positions_to_locs
from dtkv.attention._resolve import available_backends, resolve_attention
from dtkv.attention._spec import AUTO_ORDER, BACKENDS, AttentionFitError, AttentionName, AttentionSpec

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "B_TOPK",
    "FLASHMLA_HEADS",
    "FLASHMLA_INSTALL",
    "FLASHMLA_PAGE_SIZE",
    "AttentionBackend",
    "AttentionFitError",
    "AttentionName",
    "AttentionSpec",
    "DecodeSchedule",
    "availability",
    "available_backends",
    "check_fit",
    "dense_page_table",
    "fit_errors",
    "owned_page_map",
    "positions_to_locs",
    "resolve_attention",
]
