"""Hugging Face transformers DSA models on dtkv's sharded KV (optional extra ``hf``: ``pip install dtkv[hf]``).

Entry points:

- :class:`TransformersAdapter` -- a loaded ``DeepseekV32ForCausalLM`` or ``GlmMoeDsaForCausalLM`` as a
  :class:`dtkv.runtime.ModelAdapter`: :class:`dtkv.runtime.Runtime` runs it with chunked CP prefill (zigzag
  page-aligned or round-robin split, several requests a step), the prefix cache, greedy decode over full views or
  straight on the shards (``decode_mode="sharded"``) and PD (:mod:`dtkv.runtime.pd`), over a process group. The
  model's own modules and weights compute everything; the MLA latent and the indexer K of every layer live in
  dtkv's :class:`dtkv.ShardedKVPool` (:func:`kv_layouts`: bf16, fp32 or fp8 rows)::

      runtime = Runtime(TransformersAdapter(model, kv_dtype="fp8", page_size=64), group=cp_group,
                        num_pages=num_pages_for(lens, page_size=64, cp_size=cp))

- :func:`dsa_attention` -- the replacement attention bound to each attention module (:mod:`.attention`).
- :func:`indexer_precision`, :func:`uses_fp8_indexer` -- which indexer the extend steps run (fp8 or exact).
- :func:`reference_logits`, :func:`stable_topk` -- the model's own forward as the parity reference.
- :func:`load_model` -- a DeepSeek-V3.2 / GLM-5 checkpoint directory (safetensors) for the adapter.
- :func:`tiny_config`, :func:`tiny_model` -- small random DSA models (no download).

Tested with transformers 5.17.0 (the ``hf`` extra takes ``>=5.17,<6``; CI pins 5.17.0).

**Why the attention module, not an attention interface.** transformers' ``AttentionInterface`` receives keys
and values already expanded by ``kv_b_proj`` from the model's dense ``DynamicCache``, and a top-k mask the
indexer already computed against that cache. DSA's KV storage and its sparse selection both happen inside the
attention module's forward, so that forward is what the adapter binds (per instance, reversibly).

**transformers 5.17's DSA forward is not length-invariant, and why.** With ``index_topk=16`` the logits of
a 200-token forward differ from the first 200 rows of a 300-token forward, and a chunked forward with a cache
differs from the full forward (measured on :func:`tiny_model`: up to 0.53 / 0.95 for DeepSeek-V3.2, 0.62 / 0.91
for GLM-5). The cause is *ties in the indexer's top-k*: scores are ``sum_h w_h * relu(q_h . k)``, so a key for
which every indexer head's dot product is negative scores exactly ``0.0``; with 4 indexer heads about one key
in 16 does. When the ``index_topk``-th best score is such a zero, ``torch.topk`` picks among the tied keys in
an order that depends on the row length. Minimal repro (a query at position 81 seeing 14 positive scores and
68 exact zeros)::

    import torch
    def rows(T):  # [T, T] causal index scores, as the indexer masks them
        sc = torch.zeros(T, T); sc[:, :14] = torch.arange(1., 15.)
        pos = torch.arange(T)
        return sc.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    for T in (100, 200):
        print(sorted(rows(T)[None].topk(16, dim=-1).indices[0, 81].tolist())[-2:])
    # torch 2.13 CPU: [59, 60] for T=100, [58, 59] for T=200

In the tiny DeepSeek-V3.2 model, layer 0's index scores of a 200- and a 300-token forward are bitwise equal on
causal keys, yet at position 80 one keeps key 76 and the other the tied key 78; later layers then differ. The
selection of masked future keys for queries whose causal window is shorter than ``index_topk`` (also true) is
harmless: the top-k mask is combined with the causal mask, so those keys never get attention weight.

**The comparison.** The reference is the model's own forward with that one call made deterministic
(:func:`stable_topk`: highest score first, ties to the lowest position). With it both quirks vanish (tiny
models: 200 vs 300 tokens and chunked vs full agree to 8.4e-7). The adapter's indexer implements the same rule, so
parity tests compare dtkv with a well-defined forward of the unmodified model, not with an accident of tie
order. It does so without a sort: each score (rounded to float32; ``-0.0`` as ``+0.0``) and its position travel
as one int64 key, ``ord32(score) * 2**32 + (2**32 - 1 - position)`` (:func:`dtkv.decode.selection_keys`), so every
key is distinct and ``torch.topk`` of the keys is the stable sort's selection, in its order, in blocks of queries
of bounded memory (:func:`dtkv.integrations.transformers.attention.select_topk`; on the ``torch`` backend). The fp8
kernels select the same keys without them: :func:`dtkv.ops.logits_topk` of :func:`dtkv.ops.indexer_logits`'
float32 logits, whose "position" is the key-table column (within a request the columns are in position order),
bit for bit the packed keys' ``torch.topk``. The reference model (:meth:`dtkv.model.TinyDSA.select`) and sharded
decode (:mod:`dtkv.decode`) keep the same rule with the same keys.

**Indexer precision.** With fp8 index pages (``kv_dtype="fp8"``) on the ``triton`` and ``flashmla`` backends the
indexer is DeepSeek-V3.2's fp8 one: queries rounded per (token, head) to e4m3, scored against the stored fp8 keys in
one kernel. Everywhere else (the ``torch`` backend, the parity reference; bf16/fp32 index rows) it is the model's
own float32 formula. :func:`indexer_precision` switches this, :func:`uses_fp8_indexer` says which one a run takes,
and the reference mirrors the fp8 one with ``reference_logits(..., fp8_indexer=True)``: fp8 rounding of the queries
changes 5-7% of a top-16's entries (random keys, 4 or 64 heads), which moves the tiny models' logits by 0.3 on
average and up to 1.3 against the exact reference (the demo's DeepSeek-V3.2 run, CPU), so a fast run with fp8 KV
is compared with the mirrored reference (within the fp8 tolerance: ``tests/test_integration_transformers_indexer.py``).

**Stored formats.** For bf16 and fp8 KV the reference also reads its keys as the pools store them (``layouts``),
so the format's rounding is common to both sides and the comparison measures dtkv's split, writes, views and remap;
``tests/test_integration_transformers.py`` states the tolerances and why isolated positions may exceed them
(noise flipping a near-tie of the MoE router or of the index top-k).
"""

from __future__ import annotations

from dtkv.integrations.transformers._family import KV_DTYPES, DSAGeometry, family_of, geometry_of, kv_layouts
from dtkv.integrations.transformers.adapter import TransformersAdapter
from dtkv.integrations.transformers.attention import dsa_attention, indexer_precision, uses_fp8_indexer
from dtkv.integrations.transformers.loader import load_model
from dtkv.integrations.transformers.reference import (
    MODEL_TYPES,
    reference_logits,
    stable_topk,
    tiny_config,
    tiny_model,
)

__all__ = [
    "KV_DTYPES",
    "MODEL_TYPES",
    "DSAGeometry",
    "TransformersAdapter",
    "dsa_attention",
    "family_of",
    "geometry_of",
    "indexer_precision",
    "kv_layouts",
    "load_model",
    "reference_logits",
    "stable_topk",
    "tiny_config",
    "tiny_model",
    "uses_fp8_indexer",
]
