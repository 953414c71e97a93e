"""One CP runtime for every model: requests, pages, chunked CP prefill, the prefix cache, decode and PD, written once.

Entry points:

- :class:`Runtime` -- the SPMD serving loop over one CP group: ``add_request`` / ``finish_request``, chunked CP
  prefill (``prefill``, ``step``), greedy decode in ``decode_mode="full"`` or ``"sharded"`` (``decode``,
  ``decode_step``), ``kv_bytes``; every rank of the group builds it with the same arguments and makes the same
  calls.
- :class:`ModelAdapter` and :class:`ModelSpec` -- what a model must provide (below); the two adapters are
  :class:`dtkv.model.ReferenceAdapter` (the tiny DSA reference model) and
  :class:`dtkv.integrations.transformers.TransformersAdapter` (transformers' DeepSeek-V3.2 and GLM-5).
- :class:`StepContext` -- what a model's attention calls during a step: ``write``, ``views``,
  ``decode_attention``.
- :mod:`dtkv.runtime.pd` -- PD: a prefill group of N ranks sends, a decode group of M ranks (or one process)
  receives into its own pages and decodes; N != M allowed.
- :func:`batch_invariant` -- run a model so that a row's results do not depend on the rows sharing its step (what
  bitwise prefix-cache parity needs from a float32 model).

**Who owns what.** The runtime owns everything that is the same for every model: requests and their pages, the CP
split (zigzag, page-aligned where possible, or round-robin), owner-aware allocation, the prefix cache, KV writes
(owner-filtered, compute-owner direct, replicated), materialized views with a layer-ahead prefetch, sharded decode
(a :class:`dtkv.decode.DecodeStep` layer per model layer: the exact global top-k and the LSE merge), PD send
and receive, and the input rules of every call (:mod:`dtkv.runtime._batch`: checked before anything changes, on every
rank together, with where each request stands). A model adapter owns only what differs between models: how a layer
projects its rows and how its attention reads KV.

**A step stands on every rank or on none** (:mod:`dtkv.runtime._outcome`): after its run the ranks vote (one
48-byte all-gather on the CPU channel); a step that failed on any rank -- an out-of-memory error in one GPU's LM
head, after the step's last collective -- raises the same error on every rank, and every rank undoes it: pages,
reference counts, ``num_computed``, the allocator's cursor, the prefix cache's evictions (with the bytes of the
evicted pages the step overwrote) and insertions, ``stats``. The serving loop goes on from there.

**Decode as CUDA graphs** (``cuda_graphs=``, :mod:`dtkv.runtime._graphs`; on by default on CUDA): decode steps run
in batch buckets captured at their first use and replayed after, their host plans copied into static buffers, in
both decode modes and for every adapter; what a graph cannot hold runs eager, saying why. In :meth:`Runtime.decode`
a step's vote travels while the step runs and stands for the next step's input agreement (no agreement collective
on the critical path after a call's first step); the rule above holds unchanged.

**Prefill queues requests that do not fit together**: each ``prefill()`` step runs the requests whose remaining
prompt pages fit beside each other (those under way first, then in request order); the others wait, holding no
page, until pages free up -- in a later step of the same call, or a later call after ``finish_request``. A call
raises :class:`dtkv.AllocationError` only when no waiting request can finish its prompt.

**The model-adapter interface** (:class:`ModelAdapter`)::

    spec: ModelSpec                  # stored layouts ("kv": MLA latent, "index": indexer keys), layers, vocab, top-k
    device: torch.device
    forward(ctx) -> hidden [n, D]    # run the model over ctx.ids / ctx.positions (this rank's rows)
    logits(hidden [m, D]) -> [m, V]
    bind() / close()                 # attach to / detach from the model (e.g. bind attention modules)

Inside ``forward``, every layer's attention calls the runtime through the :class:`StepContext` it was given:

1. ``ctx.write(name, layer, rows)`` stores the layer's new rows (``"kv"``: the MLA latent row ``[n, R + E]``,
   ``"index"``: the indexer key ``[n, J]``) -- the runtime picks owner-filtered, direct or replicated writes;
2. an extend step (prefill, or a full-view decode step) reads ``ctx.views(layer, names)``: full views of the pages
   the step reads, and the step's key table (``ctx.plan.key_slots`` / ``key_req`` / ``key_pos`` / ``key_indptr``:
   every position each request's queries may read, as a row of the view; ``key_start`` / ``key_end``: the entries
   each row may read), through which the model's own top-k and attention read KV;
3. a sharded decode step calls ``ctx.decode_attention(layer, queries)`` with the absorbed-MLA queries of every
   request (:class:`dtkv.decode.DecodeQueries`): the runtime scores each rank's own index pages, agrees on the
   global top-k, attends over the selected rows each rank owns and merges the partials; the model turns the merged
   latent output into its layer output. No full view, no page movement. With fp8 index pages this is a layer of
   :class:`dtkv.decode.DecodeStep` (the runtime's backend by name; the layer's two rows, held since ``ctx.write``,
   written by its one launch); a layer that reuses the previous layer's selection passes ``positions=``.

The attention backend (``attention=``) is a runtime argument the adapter reads from ``ctx.attention``, never a
model's concern.

**Plan and run** (as flashinfer's ``plan()`` / ``run()``): :meth:`Runtime.plan_step` is the host phase -- input
rules, split, prefix-cache eviction, allocation, token locations, the key table, the materialization plan and the
remapped page tables (:class:`ExtendPlan`, identical on every rank up to the rank's own rows); :meth:`Runtime.forward`
is the run phase: tensor work only, no host sync (it compiles with ``torch.compile(fullgraph=True)`` for the
reference model). Sharded decode has the same split (:func:`dtkv.decode.plan_decode` and
:meth:`dtkv.decode.DecodeStep.set_plan`, then the layers).

**KV modes** (``mode=``; the default follows the group and the split):

==================  ===========================================================================================
mode                what each CP rank stores and how rows get there
==================  ===========================================================================================
``single``          one process, no CP: the whole pool
``replicated``      CP, what engines do today: every rank all-gathers each layer's rows and stores the whole pool
``sharded``         page-ownership-sharded pools: rows are all-gathered and every rank keeps the pages it owns
``sharded_direct``  sharded pools with compute-owner direct writes (zigzag, page-aligned): pages are allocated on the
                    rank that computes them and written with no KV all-gather; only rows of pages a rank does not own
                    (a partly filled first page, fallback requests) go through a small all-gather
==================  ===========================================================================================

Every mode runs in one process too (no group, or a group of one rank): nothing is exchanged, and each stores and
computes what ``single`` does, bitwise. The page-table format is defined in :mod:`dtkv.page_table`.
"""

from __future__ import annotations

from dtkv.runtime._invariant import batch_invariant
from dtkv.runtime._plan import ExtendPlan
from dtkv.runtime._request import Request
from dtkv.runtime.adapter import ModelAdapter, ModelSpec
from dtkv.runtime.context import StepContext
from dtkv.runtime.runtime import DECODE_MODES, KV_MODES, DecodeMode, KVMode, Runtime, num_pages_for

__all__ = [
    "DECODE_MODES",
    "KV_MODES",
    "DecodeMode",
    "KVMode",
    "ModelAdapter",
    "ModelSpec",
    "Request",
    "Runtime",
    "StepContext",
    "ExtendPlan",
    "batch_invariant",
    "num_pages_for",
]
