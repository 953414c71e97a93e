"""Run phase of one DSA layer of a sharded decode step: score own index pages, agree on top-k, attend, merge.

Legend: ``N`` queries (one per request), ``L`` this rank's owned pages per request (padded), ``S = L * page_size``
keys scored here, ``K`` top-k, ``I``/``J`` indexer heads/dims, ``H`` heads, ``R`` latent dims, ``E`` rope dims.

:func:`decode_layer` reads only this rank's pages (``pool.local(...)``) and makes two collectives:

1. indexer: dequantize the request's owned index pages ``[N, S, J]``, score them, keep the local top-k as packed
   int64 keys, all-gather them and take the global top-k (:mod:`dtkv.decode.topk`): the same ``[N, K]``
   positions on every rank;
2. attention: gather the selected rows this rank owns (the others are masked), dequantize (bf16 or the 656-byte
   fp8 row), attend, and all-gather the partials for the LSE merge (:mod:`dtkv.decode.attention`).

No rank ever reads another rank's pages and nothing of the full view is built: per rank the layer's scratch is
``[N, S, J]`` index keys, ``[N, K, R + E]`` selected rows and ``cp * N * K`` candidates, and the traffic is
:func:`dtkv.decode.sharded_decode_comm_bytes` whatever the context length. The layer's new KV row is written
before this, by its page's owner (owner-filtered write; see :func:`dtkv.model.kvio.write_rows`).

Tensor work only: no host synchronization (all shapes come from the :class:`DecodePlan`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from dtkv import ops
from dtkv.decode.attention import merge_partials, partial_attention
from dtkv.decode.plan import DecodePlan
from dtkv.decode.topk import global_topk, index_scores, local_topk, selection_keys, unpack_keys
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


class DecodeLayerOutput(NamedTuple):
    """The merged result of one layer, identical on every rank."""

    out: torch.Tensor
    """Attention output ``[N, H, R]`` (compute dtype)."""
    lse: torch.Tensor
    """Log-sum-exp of each query's selected logits ``[N, H]``."""
    positions: torch.Tensor
    """int64 ``[N, K]`` the selected positions in selection order (score desc, position asc); ``-1`` padding."""


def _index_keys(index_local: torch.Tensor, plan: DecodePlan, layout: IndexerFp8Layout, dtype) -> torch.Tensor:
    n, width = plan.owned_local_pages.shape
    if index_local.shape[0] == 0:  # this rank stores no page of the pool: every slot is padding
        return torch.zeros((n, width * layout.page_size, layout.head_dim), dtype=dtype, device=index_local.device)
    pages = index_local[plan.owned_local_pages.clamp(min=0)].reshape(n * width, -1)
    return ops.dequantize_indexer_pages(pages, layout).reshape(n, width * layout.page_size, -1).to(dtype)


def _kv_rows(kv_local: torch.Tensor, rows_NK: torch.Tensor, layout: KVLayout, dtype) -> torch.Tensor:
    flat = kv_local.reshape(-1, kv_local.shape[-1])
    if flat.shape[0] == 0:  # this rank stores no page of the pool: every row is masked
        flat = flat.new_zeros((1, flat.shape[1]))
    picked = flat[rows_NK]  # [N, K, row]
    if isinstance(layout, MLAFp8Layout):
        return ops.dequantize_mla_fp8(picked, layout).to(dtype)
    return picked.to(dtype)


def decode_layer(
    kv_local: torch.Tensor,
    index_local: torch.Tensor,
    kv_layout: KVLayout,
    index_layout: IndexerFp8Layout,
    plan: DecodePlan,
    q: DecodeQueries,
    *,
    softmax_scale: float,
    group: dist.ProcessGroup | None,
) -> DecodeLayerOutput:
    """Sharded sparse attention of one layer for a decode step (collective over ``group``; run phase).

    Args:
        kv_local: this rank's MLA pages of the layer ``[num_local_pages, page_size, row]`` (``MLALatentLayout``
            or ``MLAFp8Layout``), already holding this step's new rows.
        index_local: this rank's indexer pages ``[num_local_pages, page_size * (J + 4)]`` uint8, likewise.
        kv_layout, index_layout: their layouts.
        plan: from :func:`dtkv.decode.plan_decode` for this rank.
        q: the layer's queries; their dtype is the compute dtype (float64 for the reference model, float32 on
            GPUs).
        softmax_scale: attention logit scale.
        group: the CP group (``None``: one process, where this is plain local decode).

    Returns:
        :class:`DecodeLayerOutput`, the same on every rank.
    """
    if not isinstance(kv_layout, (MLALatentLayout, MLAFp8Layout)):
        raise TypeError(f"kv_layout must be MLALatentLayout or MLAFp8Layout, got {type(kv_layout).__name__}")
    if not isinstance(index_layout, IndexerFp8Layout):
        raise TypeError(f"index_layout must be IndexerFp8Layout, got {type(index_layout).__name__}")
    ps, k, dtype = plan.page_size, plan.topk, q.iq.dtype
    if kv_layout.page_size != ps or index_layout.page_size != ps:
        raise ValueError(
            f"plan.page_size must equal the layouts' page_size, got plan.page_size={ps}, "
            f"kv_layout.page_size={kv_layout.page_size}, index_layout.page_size={index_layout.page_size}"
        )
    if kv_local.dim() != 3 or kv_local.shape[1:] != kv_layout.page_shape:
        raise ValueError(
            f"kv_local must be [pages, {', '.join(map(str, kv_layout.page_shape))}], got {list(kv_local.shape)}"
        )
    if index_local.dim() != 2 or index_local.shape[1:] != index_layout.page_shape:
        raise ValueError(f"index_local must be [pages, {index_layout.page_shape[0]}], got {list(index_local.shape)}")
    if q.iq.shape[0] != plan.num_queries:
        raise ValueError(f"q must hold plan.num_queries={plan.num_queries} queries, got q.iq.shape={list(q.iq.shape)}")
    # 1. indexer over this rank's own pages -> local top-k -> global top-k
    keys_NSJ = _index_keys(index_local, plan, index_layout, dtype)
    offsets = torch.arange(ps, device=plan.owned_slots.device)
    pos_NS = (plan.owned_slots[:, :, None] * ps + offsets).reshape(plan.num_queries, -1)
    valid_NS = (plan.owned_slots[:, :, None] >= 0).expand(-1, -1, ps).reshape(plan.num_queries, -1)
    valid_NS = valid_NS & (pos_NS <= plan.query_pos[:, None])
    keys = selection_keys(index_scores(q.iq, q.iw, keys_NSJ), pos_NS, valid_NS)
    chosen = global_topk(local_topk(keys, k), k, group)
    _, sel_pos, sel_valid = unpack_keys(chosen)
    # 2. attention over the selected rows this rank owns -> LSE merge
    slot = torch.where(sel_valid, sel_pos // ps, torch.zeros_like(sel_pos))
    local_page = plan.slot_local_page.gather(1, slot)
    mine = sel_valid & (local_page >= 0)
    rows_NK = torch.where(mine, local_page * ps + sel_pos % ps, torch.zeros_like(sel_pos))
    sel = _kv_rows(kv_local, rows_NK, kv_layout, dtype)
    r = kv_layout.kv_lora_rank
    out, lse = partial_attention(q.q_nope, q.q_rope, sel[..., :r], sel[..., r:], mine, softmax_scale=softmax_scale)
    out, lse = merge_partials(out, lse, group)
    return DecodeLayerOutput(out=out, lse=lse, positions=sel_pos)
