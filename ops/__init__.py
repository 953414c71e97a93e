"""dtkv.ops: registered ``torch.library`` custom ops (namespace ``dtkv``) with torch and Triton kernels.

One registered op per module, beside its torch reference, Triton kernel, fake and DTensor sharding rule; the row
writes share one prologue (checks, ``locs`` normalization, validation, dispatch: ``_row_write.py``), and
``direct_write.py`` holds only a convenience entry point over ``dtkv::write_owned`` (no op or kernel of its own).
Kernels take their launch configuration per size from a tuned table (``_tuned.py``) and share copy helpers
(``_copy.py``).
Entry points (each takes ``backend="auto" | "torch" | "triton"``):

- :func:`write_owned` -- owner-filtered write of a full chunk's rows (``dtkv::write_owned``); ``direct=True``
  writes this rank's own rows of a page-aligned split into its own pages instead.
- :func:`direct_write` -- ``write_owned(..., direct=True)`` for plain rows.
- :func:`quantize_write_mla_fp8`, :func:`quantize_write_indexer_fp8` -- fused fp8 quantize-and-write, owner
  filter or ``direct=True`` likewise; references :func:`quantize_mla_fp8`, :func:`dequantize_mla_fp8`,
  :func:`quantize_indexer_fp8`, :func:`dequantize_indexer_pages`.
- :func:`dequantize_mla_rows` -- fp8 MLA rows decoded to bf16 or float32 rows in one pass
  (``dtkv::dequantize_mla_rows``: what a bf16 attention kernel reads of an fp8 pool).
- :func:`quantize_write_mla_indexer_fp8` -- both of a decode step's new-row writes of a layer (fp8 MLA row, fp8
  indexer key; owner filter) in one launch (``dtkv::quantize_write_mla_indexer_fp8``).
- :func:`plan_pack` (plan) + :func:`pack_owned_pages` (run) -- owner-major all-gather send buffers
  (``dtkv::pack_owned_pages``), with :func:`gathered_page_table`.
- :func:`pack_layer_pages` (registered op ``dtkv::pack_layer_pages``) and :func:`pack_layer_pages_into` (eager,
  preallocated outputs) -- one send list packed out of every layout of a layer in one launch.
- :func:`indexer_scores` -- DSA indexer scores of decode queries over their fp8 indexer pages, packed as
  selection keys (``dtkv::indexer_scores``).
- :func:`indexer_logits` -- DSA indexer logits ``[N, K]`` of an extend step's fp8 queries over the fp8 keys of its
  key table, request and causal visibility as per-query column ranges (``dtkv::indexer_logits``; float32 or packed
  selection keys), with :func:`quantize_indexer_queries` (its fp8 queries and weights in one launch:
  ``dtkv::quantize_indexer_queries``) and :func:`indexer_topk` (the stable lowest-position top-k of packed keys).
- :func:`keys_topk` -- :func:`indexer_topk` over many programs a row (a radix select, no sort: the decode step's
  few rows), the slots of the kept columns (``dtkv::keys_topk``).
- :func:`logits_topk` -- that top-k straight from the float32 logits and their column ranges, bit for bit, in one
  kernel (``dtkv::logits_topk``; the slots of the kept columns).
- :func:`rope_interleave_into` -- the MLA query's interleaved rope written into an attention query buffer
  (``dtkv::rope_interleave_into``).
- :func:`remap` -- logical indices to gathered-buffer coordinates (``dtkv::remap``).
- :func:`sparse_indices` -- logical token locations to a sparse-attention kernel's int32 token slots (remap,
  bound, pad: ``dtkv::sparse_indices``); :func:`sparse_mla` -- MLA attention over selected rows (``dtkv::sparse_mla``).

Ownership is a :class:`dtkv.PageOwnership` or its :class:`OwnershipSpec` (:func:`ownership_spec`), a plain tuple that
compiles on every torch version (torch < 2.13 cannot guard on ``Placement`` subclasses inside compiled code).
Index arguments (``locs``, ``send_idx``, ``indices``, ``page_map``) may have any strides; locations outside the
logical pool are skipped unvalidated and raise validated, whatever their width.

``backend="auto"`` runs Triton on CUDA tensors when Triton imports and torch otherwise (``DTKV_BACKEND`` and
:func:`dtkv.default_backend` override it); ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` at import.
"""

from __future__ import annotations

from dtkv.ops._common import HAS_TRITON, OwnershipSpec, ownership_spec
from dtkv.ops.dequantize_mla_rows import dequantize_mla_rows
from dtkv.ops.direct_write import direct_write
from dtkv.ops.indexer_logits import indexer_logits, indexer_topk
from dtkv.ops.indexer_scores import indexer_scores
from dtkv.ops.keys_topk import keys_topk
from dtkv.ops.logits_topk import logits_topk
from dtkv.ops.pack_layer_pages import pack_layer_pages, pack_layer_pages_into
from dtkv.ops.pack_owned_pages import PackPlan, gathered_page_table, pack_owned_pages, plan_pack
from dtkv.ops.quantize_indexer_queries import quantize_indexer_queries
from dtkv.ops.quantize_write_indexer_fp8 import (
    dequantize_indexer_pages,
    quantize_indexer_fp8,
    quantize_write_indexer_fp8,
)
from dtkv.ops.quantize_write_mla_fp8 import dequantize_mla_fp8, quantize_mla_fp8, quantize_write_mla_fp8
from dtkv.ops.quantize_write_mla_indexer_fp8 import quantize_write_mla_indexer_fp8
from dtkv.ops.remap import remap
from dtkv.ops.rope_interleave_into import rope_interleave_into
from dtkv.ops.sparse_indices import sparse_indices
from dtkv.ops.sparse_mla import sparse_mla
from dtkv.ops.write_owned import write_owned

__all__ = [
    "HAS_TRITON",
    "OwnershipSpec",
    "PackPlan",
    "dequantize_indexer_pages",
    "dequantize_mla_fp8",
    "dequantize_mla_rows",
    "direct_write",
    "gathered_page_table",
    "indexer_logits",
    "indexer_scores",
    "indexer_topk",
    "keys_topk",
    "logits_topk",
    "ownership_spec",
    "pack_layer_pages",
    "pack_layer_pages_into",
    "pack_owned_pages",
    "plan_pack",
    "quantize_indexer_fp8",
    "quantize_indexer_queries",
    "quantize_mla_fp8",
    "quantize_write_indexer_fp8",
    "quantize_write_mla_fp8",
    "quantize_write_mla_indexer_fp8",
    "remap",
    "rope_interleave_into",
    "sparse_indices",
    "sparse_mla",
    "write_owned",
]
