"""The extend-step indexer of the transformers adapter: its top-k over the step's key table, and which indexer
math a run takes (:mod:`dtkv.integrations.transformers.attention` calls it; the names are re-exported there).

- :func:`select_topk`: view slots ``[N, k]`` of each query's ``index_topk`` best keys, in bounded blocks of
  queries, ties to the lowest position (the fp8 kernel's float32 logits and :func:`dtkv.ops.logits_topk`, or int64
  selection keys of the exact formula's scores and ``torch.topk``).
- :func:`indexer_precision` (a switch) and :func:`uses_fp8_indexer`: DeepSeek-V3.2's fp8 indexer (the kernel
  :func:`dtkv.ops.indexer_logits` on the fast backends) or the model's exact formula.
- :func:`fp8_indexer_queries`: the fp8 rounding of the queries (the ``torch`` backend's fp8 math, sharded decode).

Shape legend: ``N`` query rows, ``I`` indexer heads, ``J`` indexer dims, ``K`` key-table entries, ``B`` queries of
a block, ``k`` keys kept per query (``index_topk``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch

from dtkv import ops
from dtkv.decode import selection_keys
from dtkv.kvio import read_rows, round_trip
from dtkv.layouts import IndexerFp8Layout
from dtkv.ops.logits_topk import group_size
from dtkv.runtime import StepContext

__all__ = [
    "FP8_BLOCK_BYTES",
    "FUSED_GROUP_MAXIMA",
    "INDEXER_PRECISIONS",
    "TORCH_BLOCK_BYTES",
    "fp8_indexer_queries",
    "indexer_precision",
    "select_topk",
    "uses_fp8_indexer",
]

INDEXER_PRECISIONS = ("auto", "fp8", "exact")
"""The modes of :func:`indexer_precision`."""

TORCH_BLOCK_BYTES = 1 << 28
"""The ``torch`` indexer's temporaries per block of queries (``[B, I, K]`` float32 products, ``[B, K]`` keys)."""

FP8_BLOCK_BYTES = 1 << 31
"""The fp8 indexer's ``[B, K]`` float32 logits per block of queries (the kernel keeps nothing else per key)."""

FUSED_GROUP_MAXIMA = False
"""Whether the extend selection has the indexer's epilogue write the grouped bound's group maxima
(``indexer_logits(..., group=G)``, then ``logits_topk(..., group_max=)``) instead of ``logits_topk``'s own pass
over the logits. Off: on one H100 the epilogue cost more than the pass it saves (8192 queries x 128K keys: 39.2
against 37.2 ms for the indexer and the selection; the runtime's 128K prefill 48.2K against 51.9K tok/s,
``benchmarks/results/runtime_fused_maxima_h100x1_2026-12-07.md``)."""

_PRECISION: list[str] = []


@contextlib.contextmanager
def indexer_precision(mode: str) -> Iterator[None]:
    """The indexer every layer runs inside the block (nests, restores; read when a layer runs or is traced).

    - ``"auto"`` (outside any block): DeepSeek-V3.2's fp8 indexer where the index pages are fp8
      (:class:`dtkv.IndexerFp8Layout`) and the attention backend is a fast one (``triton``, ``flashmla``: the
      kernel :func:`dtkv.ops.indexer_logits`); the model's exact formula elsewhere (the ``torch`` backend is the
      parity reference).
    - ``"fp8"``: the fp8 indexer wherever the pages are fp8, on the ``torch`` backend too (the model's formula on
      :func:`fp8_indexer_queries`: the kernel's math, what checks a fast run on a CPU).
    - ``"exact"``: the exact formula everywhere (the kernel never runs).

    bf16/fp32 index rows always take the exact formula. :func:`uses_fp8_indexer` says which one a run takes; the
    parity reference mirrors it with ``reference_logits(..., fp8_indexer=True)``.

    Raises:
        ValueError: ``mode`` is not one of :data:`INDEXER_PRECISIONS`.
    """
    if mode not in INDEXER_PRECISIONS:
        raise ValueError(f"mode must be one of {INDEXER_PRECISIONS}, got mode={mode!r}")
    _PRECISION.append(mode)
    try:
        yield
    finally:
        _PRECISION.pop()


def uses_fp8_indexer(attention: str, index_layout) -> bool:
    """Whether a run on the attention backend named ``attention`` with index pages of ``index_layout`` scores with
    the fp8 indexer (fp8 queries) under the current :func:`indexer_precision`."""
    if not isinstance(index_layout, IndexerFp8Layout):
        return False
    mode = _PRECISION[-1] if _PRECISION else "auto"
    return mode == "fp8" or (mode == "auto" and attention != "torch")


def fp8_indexer_queries(q: torch.Tensor) -> torch.Tensor:
    """Indexer queries ``[..., J]`` as DeepSeek-V3.2's fp8 indexer takes them: each row in e4m3 with the scale
    ``amax / 448`` (:func:`dtkv.ops.quantize_indexer_fp8`), given back as float32 ``codes * scale`` (an fp8 index
    key's :func:`dtkv.kvio.round_trip`)."""
    return round_trip(q.float(), IndexerFp8Layout(page_size=1, head_dim=q.shape[-1]))


def select_topk(indexer, ctx: StepContext, q_NIJ, w_NI, view_index) -> torch.Tensor:
    """View slots ``[N, k]`` (int64, ``-1`` = none) of each query's ``index_topk`` best keys of the step's key table,
    best first, ties to the lower position (run phase: no host sync).

    Query ``n`` sees the key-table entries ``[plan.key_start[n], plan.key_end[n])``: its request's entries up to
    its position. The fp8 indexer (:func:`uses_fp8_indexer`) on the ``triton`` and ``flashmla`` backends runs
    :func:`dtkv.ops.quantize_indexer_queries` once and :func:`dtkv.ops.indexer_logits` (float32 logits, ``-inf``
    where not visible, blocks of queries within :data:`FP8_BLOCK_BYTES`; with :data:`FUSED_GROUP_MAXIMA`, on rows
    of many keys also the group maxima of :func:`dtkv.ops.logits_topk`'s grouped bound, from its epilogue), then
    :func:`dtkv.ops.logits_topk` (the selection of the packed keys' ``torch.topk``, bit for bit, at half the
    bytes); otherwise the model's formula ``relu(q . k * softmax_scale)`` summed with the head weights in float32
    does (on :func:`fp8_indexer_queries` for the fp8 indexer on ``torch``; blocks within
    :data:`TORCH_BLOCK_BYTES`), then selection keys and :func:`dtkv.ops.indexer_topk`.

    Args:
        indexer: the layer's indexer module (``softmax_scale``, ``index_topk``).
        ctx: the extend step's context.
        q_NIJ: indexer queries ``[N, I, J]`` (model dtype), w_NI: float32 head weights ``[N, I]``.
        view_index: the layer's index view (``ctx.views``).
    """
    plan, lay = ctx.plan, ctx.layouts["index"]
    assert plan is not None, "an extend step's context holds its plan"
    if plan.key_stride:
        return _select_blocks(indexer, ctx, q_NIJ, w_NI, view_index)
    n, heads, _ = q_NIJ.shape
    num_keys, k = plan.key_slots.shape[0], indexer.index_topk
    start, end = plan.key_start, plan.key_end
    name = ctx.attention.name if ctx.attention is not None else "torch"
    fp8 = uses_fp8_indexer(name, lay)
    if fp8 and name != "torch":
        assert isinstance(lay, IndexerFp8Layout), "the fp8 indexer reads fp8 index pages"
        backend = "triton" if name == "triton" else "auto"
        q8, w8 = ops.quantize_indexer_queries(q_NIJ, w_NI, scale=indexer.softmax_scale, backend=backend)
        block = max(1, FP8_BLOCK_BYTES // max(1, 4 * num_keys))
        out = []
        for b0 in range(0, n, block):
            sl = slice(b0, min(n, b0 + block))
            # FUSED_GROUP_MAXIMA: the indexer's epilogue writes the grouped bound's maxima too
            group = group_size(num_keys, k, rows=sl.stop - b0) if FUSED_GROUP_MAXIMA else 0
            got = ops.indexer_logits(q8[sl], w8[sl], view_index, plan.key_slots, start[sl], end[sl], layout=lay,
                                     group=group, backend=backend)  # fmt: skip
            logits, gmax = cast(tuple[torch.Tensor, torch.Tensor], got) if group else (cast(torch.Tensor, got), None)
            # -inf outside each query's range already: no ranges to mask
            out.append(ops.logits_topk(logits, k, key_slots=plan.key_slots, group_max=gmax, backend=backend))
        return _joined(out, k, q_NIJ.device)
    keys_JK = read_rows(view_index, lay, q_NIJ.dtype, slots=plan.key_slots).transpose(0, 1).float()
    cols = torch.arange(num_keys, device=q_NIJ.device)
    block = max(1, TORCH_BLOCK_BYTES // max(1, (4 * heads + 48) * num_keys))
    out = []
    for b0 in range(0, n, block):
        sl = slice(b0, min(n, b0 + block))
        q = fp8_indexer_queries(q_NIJ[sl]) if fp8 else q_NIJ[sl].float()
        scores = torch.matmul(q, keys_JK).mul_(indexer.softmax_scale).relu_()  # [B, I, K]
        index_BK = torch.matmul(w_NI[sl].unsqueeze(-2), scores).squeeze(-2)
        visible = (cols[None, :] >= start[sl, None]) & (cols[None, :] < end[sl, None])
        top, valid = ops.indexer_topk(selection_keys(index_BK, cols.expand_as(index_BK), visible), k)
        out.append(torch.where(valid, plan.key_slots[top.clamp(min=0)], torch.full_like(top, -1)))
    return _joined(out, k, q_NIJ.device)


def _joined(blocks: list[torch.Tensor], k: int, device: torch.device) -> torch.Tensor:
    if not blocks:
        return torch.full((0, k), -1, dtype=torch.int64, device=device)
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _page_table(slots_NC: torch.Tensor, lay) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode bucket's key blocks ``[N, C]`` (whole pages) as :func:`dtkv.ops.indexer_scores` reads them: the
    view's page of each request's page ``l`` (its first slot over the page size) and ``l`` itself, ``-1`` where the
    request has no such page; int64 ``[N, C / S]`` each."""
    ps = lay.page_size
    first = slots_NC[:, ::ps]
    held = first >= 0
    cols = torch.arange(first.shape[1], device=first.device)
    return torch.where(held, first // ps, -1), torch.where(held, cols[None, :], -1)


def _select_blocks(indexer, ctx: StepContext, q_NIJ, w_NI, view_index) -> torch.Tensor:
    """:func:`select_topk` of a decode plan with a key stride (:attr:`dtkv.runtime.ExtendPlan.key_stride`): query
    ``n`` scores only its own request's block of ``C`` entries, visible up to its position, so the work and the
    ``[N, C]`` keys are linear in the batch (one flat table would be ``[N, N * C]``). With the fp8 indexer kernel
    the keys are :func:`dtkv.ops.indexer_scores`' over the request's pages (``C`` is whole pages: the first slot of
    each names its page of the view), as sharded decode scores them; otherwise the extend steps' formula. The
    selection in the same order (a request's columns are its positions)."""
    plan, lay = ctx.plan, ctx.layouts["index"]
    assert plan is not None, "an extend step's context holds its plan"
    n, heads, _ = q_NIJ.shape
    c, k = plan.key_stride, indexer.index_topk
    slots_NC = plan.key_slots.view(-1, c)[:n]
    end = plan.positions + 1
    name = ctx.attention.name if ctx.attention is not None else "torch"
    fp8 = uses_fp8_indexer(name, lay)
    if fp8 and name != "torch":
        assert isinstance(lay, IndexerFp8Layout), "the fp8 indexer reads fp8 index pages"
        backend = "triton" if name == "triton" else "auto"
        # one launch for the batch: the decode indexer over each request's pages of the view (sharded decode's
        # kernel, dtkv.ops.indexer_scores: 2x the extend indexer's speed at 16 x 128K keys on one H100), the same
        # packed keys: column l * S + t is position l * S + t, the first slot of a request's page l names its page
        assert c % lay.page_size == 0, "a decode plan's key stride is whole pages"
        page_ids, page_slots = ctx.once(("index_page_table", lay.page_size, c, n), lambda: _page_table(slots_NC, lay))
        keys = ops.indexer_scores(q_NIJ, w_NI * indexer.softmax_scale, view_index, page_ids, page_slots,
                                  plan.positions, layout=lay, q_fp8=True, backend=backend)  # fmt: skip
        # the top-k over many programs a row (dtkv.ops.keys_topk): torch.topk of one row keeps one SM busy
        return ops.keys_topk(keys, k, key_slots=slots_NC, backend=backend)
    else:
        q = fp8_indexer_queries(q_NIJ) if fp8 else q_NIJ.float()
        block = max(1, TORCH_BLOCK_BYTES // max(1, (4 * heads + 48) * c))
        parts = []
        for b0 in range(0, n, block):
            rows = range(b0, min(n, b0 + block))
            # the flat table's products, query by query ([I, J] @ [J, C]), then the head sum as one batched product
            keys_JC = [read_rows(view_index, lay, q_NIJ.dtype, slots=slots_NC[i]).transpose(0, 1).float() for i in rows]
            scores = torch.stack([torch.matmul(q[i], kj) for i, kj in zip(rows, keys_JC)])
            scores = scores.mul_(indexer.softmax_scale).relu_()  # [B, I, C]
            parts.append(torch.matmul(w_NI[b0 : b0 + len(rows)].unsqueeze(-2), scores).squeeze(-2))
        index_NC = torch.cat(parts) if parts else w_NI.new_zeros((0, c))
        cols = torch.arange(c, device=q_NIJ.device)
        keys = selection_keys(index_NC, cols.expand_as(index_NC), cols[None, :] < end[:, None])
    top, valid = ops.indexer_topk(keys, k)
    return torch.where(valid, slots_NC.gather(1, top.clamp(min=0)), torch.full_like(top, -1))
