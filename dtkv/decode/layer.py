"""Run phase of one DSA layer of a sharded decode step: score own index pages, agree on top-k, attend, merge.

Legend: ``N`` queries (one per request), ``L`` this rank's owned pages per request (padded), ``S = L * page_size``
keys scored here, ``K`` top-k, ``I``/``J`` indexer heads/dims, ``H`` heads, ``R`` latent dims, ``E`` rope dims.

:func:`decode_layer` reads only this rank's pages (``pool.local(...)``), in any stored format (read through the
layout codec :func:`dtkv.kvio.read_rows`), and makes two collectives:

1. indexer (unless the layer reuses a selection, ``positions=``): read the request's owned index pages ``[N, S, J]``
   (fp8 :class:`dtkv.IndexerFp8Layout` pages or bf16/fp32 rows), score them, keep the local top-k as packed int64
   keys, all-gather them and take the global top-k (:mod:`dtkv.decode.topk`): the same ``[N, K]`` positions on
   every rank;
2. attention: gather the selected rows this rank owns (the others are masked), dequantize (bf16 or the 656-byte
   fp8 row), attend, and all-gather the partials for the LSE merge (:mod:`dtkv.decode.attention`).

No rank ever reads another rank's pages and nothing of the full view is built: per rank the layer's scratch is
``[N, S, J]`` index keys, ``[N, K, R + E]`` selected rows and ``cp * N * K`` candidates, and the traffic is
:func:`dtkv.decode.sharded_decode_comm_bytes` whatever the context length. The layer's new KV row is written
before this, by its page's owner (owner-filtered write: :func:`dtkv.kvio.write_rows`).

This is the float64 path of the reference model and the runtime's sharded decode of layers whose index pages are
rows (or that reuse a selection); :class:`dtkv.decode.DecodeStep` is the production step (fp8 index pages, the
indexer kernel, a CUDA graph per bucket), whose parity reference it is.

Tensor work only: no host synchronization (all shapes come from the :class:`DecodePlan`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from dtkv.decode.attention import merge_partials, partial_attention
from dtkv.decode.plan import DecodePlan
from dtkv.decode.topk import global_topk, index_scores, local_topk, selection_keys, unpack_keys
from dtkv.kvio import read_rows
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout

__all__ = ["DecodeLayerOutput", "DecodeQueries", "decode_layer"]


class DecodeQueries(NamedTuple):
    """One layer's queries for a decode step, all of one floating dtype (the compute dtype)."""

    iq: torch.Tensor
    """Indexer queries ``[N, I, J]``."""
    iw: torch.Tensor
    """Indexer head weights ``[N, I]``."""
    q_nope: torch.Tensor
    """Absorbed attention queries ``[N, H, R]``."""
    q_rope: torch.Tensor
    """Roped attention queries ``[N, H, E]``."""
    iq_fp8: bool = False
    """``iq`` holds DeepSeek-V3.2's fp8 indexer queries (each row e4m3 codes times its scale, given as floats): the
    runtime's decode step may then score them with fp8 dots (Triton's indexer on a GPU)."""
    iq_unrounded: bool = False
    """With ``iq_fp8``: ``iq`` is the model's query before that rounding, which the runtime's decode step does
    where it scores (in the fp8 indexer kernel on a GPU, which rounds each row alike; else first, in torch):
    no separate rounding pass over the queries. :func:`dtkv.decode.decode_layer` takes rounded queries only."""


class DecodeLayerOutput(NamedTuple):
    """The merged result of one layer, identical on every rank."""

    out: torch.Tensor
    """Attention output ``[N, H, R]`` (compute dtype)."""
    lse: torch.Tensor
    """Log-sum-exp of each query's selected logits ``[N, H]``."""
    positions: torch.Tensor | None
    """int64 ``[N, K]`` the selected positions in selection order (score desc, position asc); ``-1`` padding
    (``None`` from a runtime step asked for no positions: :meth:`dtkv.runtime.StepContext.decode_attention`)."""


def _check(kv_local, index_local, kv_layout: KVLayout, index_layout: KVLayout, plan: DecodePlan, q) -> None:
    if not isinstance(kv_layout, (MLALatentLayout, MLAFp8Layout)):
        raise TypeError(f"kv_layout must be MLALatentLayout or MLAFp8Layout, got {type(kv_layout).__name__}")
    if not isinstance(index_layout, (IndexerFp8Layout, MLALatentLayout)):
        raise TypeError(
            f"index_layout must be IndexerFp8Layout or MLALatentLayout (rows), got {type(index_layout).__name__}"
        )
    ps = plan.page_size
    if kv_layout.page_size != ps or index_layout.page_size != ps:
        raise ValueError(
            f"plan.page_size must equal the layouts' page_size, got plan.page_size={ps}, "
            f"kv_layout.page_size={kv_layout.page_size}, index_layout.page_size={index_layout.page_size}"
        )
    for name, local, lay in (("kv_local", kv_local, kv_layout), ("index_local", index_local, index_layout)):
        if tuple(local.shape[1:]) != tuple(lay.page_shape):
            want = ", ".join(map(str, lay.page_shape))
            raise ValueError(f"{name} must be [pages, {want}], got {list(local.shape)}")
    if q.iq.shape[0] != plan.num_queries:
        raise ValueError(f"q must hold plan.num_queries={plan.num_queries} queries, got q.iq.shape={list(q.iq.shape)}")


def _select(index_local: torch.Tensor, layout: KVLayout, plan: DecodePlan, q: DecodeQueries, group) -> torch.Tensor:
    """The global top-k positions ``[N, K]`` (``-1`` padding) over every rank's own index pages (collective)."""
    ps, n, dtype = plan.page_size, plan.num_queries, q.iq.dtype
    width = plan.owned_local_pages.shape[1]
    if index_local.shape[0] == 0:  # this rank stores no page of the pool: every slot is padding
        keys_NSJ = torch.zeros((n, width * ps, q.iq.shape[2]), dtype=dtype, device=index_local.device)
    else:
        pages = index_local[plan.owned_local_pages.clamp(min=0).flatten()]
        keys_NSJ = read_rows(pages, layout, dtype).reshape(n, width * ps, -1)
    offsets = torch.arange(ps, device=plan.owned_slots.device)
    pos_NS = (plan.owned_slots[:, :, None] * ps + offsets).reshape(n, -1)
    valid_NS = (plan.owned_slots[:, :, None] >= 0).expand(-1, -1, ps).reshape(n, -1)
    valid_NS = valid_NS & (pos_NS <= plan.query_pos[:, None])
    keys = selection_keys(index_scores(q.iq, q.iw, keys_NSJ), pos_NS, valid_NS)
    return unpack_keys(global_topk(local_topk(keys, plan.topk), plan.topk, group))[1]


def _attend(kv_local, layout: KVLayout, plan: DecodePlan, q: DecodeQueries, positions, scale: float, group):
    """Attention over the selected ``positions`` ``[N, K]`` each rank owns, merged by LSE (collective)."""
    ps = plan.page_size
    valid = positions >= 0
    slot = torch.where(valid, positions // ps, torch.zeros_like(positions))
    local_page = plan.slot_local_page.gather(1, slot)
    mine = valid & (local_page >= 0)
    rows_NK = torch.where(mine, local_page * ps + positions % ps, torch.zeros_like(positions))
    if kv_local.shape[0] == 0:  # this rank stores no page of the pool: every row is masked
        kv_local = kv_local.new_zeros((1, *kv_local.shape[1:]))
    sel = read_rows(kv_local, layout, q.q_nope.dtype, slots=rows_NK)  # [N, K, R + E]
    assert isinstance(layout, (MLALatentLayout, MLAFp8Layout)), f"_check admits MLA layouts only, got {layout}"
    r = layout.kv_lora_rank
    out, lse = partial_attention(q.q_nope, q.q_rope, sel[..., :r], sel[..., r:], mine, softmax_scale=scale)
    out, lse = merge_partials(out, lse, group)
    return DecodeLayerOutput(out=out, lse=lse, positions=positions)


def decode_layer(
    kv_local: torch.Tensor,
    index_local: torch.Tensor,
    kv_layout: KVLayout,
    index_layout: KVLayout,
    plan: DecodePlan,
    q: DecodeQueries,
    *,
    softmax_scale: float,
    group: dist.ProcessGroup | None,
    positions: torch.Tensor | None = None,
) -> DecodeLayerOutput:
    """Sharded sparse attention of one layer for a decode step (collective over ``group``; run phase).

    Args:
        kv_local: this rank's MLA pages of the layer ``[num_local_pages, *kv_layout.page_shape]``
            (``MLALatentLayout`` or ``MLAFp8Layout``), already holding this step's new rows.
        index_local: this rank's index pages ``[num_local_pages, *index_layout.page_shape]``, likewise: fp8
            indexer pages (:class:`dtkv.IndexerFp8Layout`, uint8 ``[P, page_size * (J + 4)]``) or rows
            (``MLALatentLayout`` of ``J`` dims, ``rope_dim=0``).
        kv_layout, index_layout: their layouts.
        plan: from :func:`dtkv.decode.plan_decode` for this rank.
        q: the layer's queries; their dtype is the compute dtype (float64 for the reference model, float32 on
            GPUs).
        softmax_scale: attention logit scale.
        group: the CP group (``None``: one process, where this is plain local decode).
        positions: int64 ``[N, K]`` a selection to reuse (a layer without its own indexer reuses the previous
            layer's ``positions``; the index pages are then not read); ``None`` runs the layer's indexer.

    Returns:
        :class:`DecodeLayerOutput`, the same on every rank.
    """
    _check(kv_local, index_local, kv_layout, index_layout, plan, q)
    if positions is None:
        positions = _select(index_local, index_layout, plan, q, group)
    return _attend(kv_local, kv_layout, plan, q, positions, softmax_scale, group)
