"""Sharded decode: decode steps straight on page-sharded KV, with no full view and no resharding.

The page ownership prefill used stays valid at decode: each rank keeps its pages, and every decode step
attends where the pages are. Per layer and step, each rank scores the step's queries against its own indexer
pages, the ranks agree on one global top-k by all-gathering their local top-k candidates, each rank attends over
the selected rows it owns, and the partial outputs are merged by their log-sum-exp. Traffic is the candidates plus
the partials, independent of context length (:mod:`dtkv.decode.cost`).

Entry points:

- :func:`plan_decode` -> :class:`DecodePlan` (plan phase, host): the rank's owned pages of each request and the
  new rows' locations; :func:`alloc_decode_pages` places a request's next page on the rank holding fewest of its
  pages.
- :class:`DecodeStep` (+ :class:`DecodeStepConfig`): a whole decode step's attention, every layer, in one of the
  modes ``sharded``, ``full_view``, ``replicated``, built from production kernels (:func:`dtkv.ops.indexer_scores`,
  the :mod:`dtkv.attention` seam: FlashMLA on an H200) and capturable as one CUDA graph (:mod:`dtkv.decode.step`).
- :func:`decode_layer` (run phase): one layer's sharded indexer + attention -> :class:`DecodeLayerOutput` (the
  float64 torch path of the first implementation; the parity reference of the step).
- the pieces: :func:`index_scores`, :func:`selection_keys`, :func:`local_topk`, :func:`global_topk`,
  :func:`unpack_keys` (exact top-k, deterministic tie-break by position); :func:`partial_attention`,
  :func:`merge_partials`, :func:`combine_partials` (LSE merge).
- :func:`sharded_decode_comm_bytes` / :func:`full_view_comm_bytes` -> :class:`DecodeCommBytes`.
- :func:`check_selection` (``DTKV_DEBUG``): the sharded top-k against the full view's, raising
  :class:`SelectionMismatchError` on every rank.

Every model runs it as ``Runtime(adapter, decode_mode="sharded")`` (:mod:`dtkv.runtime`). The page-table format is
defined in :mod:`dtkv.page_table`.
"""

from __future__ import annotations

from dtkv.decode._exchange import COMMS
from dtkv.decode.attention import combine_partials, merge_partials, partial_attention
from dtkv.decode.cost import DecodeCommBytes, full_view_comm_bytes, sharded_decode_comm_bytes
from dtkv.decode.layer import DecodeLayerOutput, DecodeQueries, decode_layer
from dtkv.decode.plan import DecodePlan, alloc_decode_pages, plan_decode
from dtkv.decode.step import MODES, DecodeStep, DecodeStepConfig, LayerResult, StepInputs
from dtkv.decode.topk import (
    INVALID_KEY,
    MAX_POSITION,
    SelectionMismatchError,
    check_selection,
    global_topk,
    index_scores,
    local_topk,
    selection_keys,
    unpack_keys,
)

__all__ = [
    "COMMS",
    "INVALID_KEY",
    "MAX_POSITION",
    "MODES",
    "DecodeCommBytes",
    "DecodeLayerOutput",
    "DecodePlan",
    "DecodeQueries",
    "DecodeStep",
    "DecodeStepConfig",
    "LayerResult",
    "SelectionMismatchError",
    "StepInputs",
    "alloc_decode_pages",
    "check_selection",
    "combine_partials",
    "decode_layer",
    "full_view_comm_bytes",
    "global_topk",
    "index_scores",
    "local_topk",
    "merge_partials",
    "partial_attention",
    "plan_decode",
    "selection_keys",
    "sharded_decode_comm_bytes",
    "unpack_keys",
]
