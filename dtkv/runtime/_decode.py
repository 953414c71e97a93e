"""Sharded decode in the runtime: plan a step on the shards, then one layer's attention where the pages are.

Every rank runs the dense part of the step for every request (so every rank holds every query); per layer the
model writes the token's rows (each rank keeps the rows of pages it owns) and calls
:meth:`dtkv.runtime.StepContext.decode_attention`, which runs

- a layer of :class:`dtkv.decode.DecodeStep` (the production decode step, eager: the indexer op
  :func:`dtkv.ops.indexer_scores`, the exact global top-k, attention through the runtime's backend of
  :mod:`dtkv.attention` on the rank's own pages, the LSE merge) when the layer scores its own indexer over fp8
  index pages (:class:`dtkv.IndexerFp8Layout`: the reference model, and transformers models with
  ``kv_dtype="fp8"``). The step writes the layer's two rows itself, in one launch: the model's
  :meth:`~dtkv.runtime.StepContext.write` calls of such a step are held until the layer's attention takes them
  (:class:`ShardedDecodeStep`), so every row is written once;
- otherwise the same two stages from :mod:`dtkv.decode`'s public pieces: the exact global top-k over index pages
  stored as rows (bf16/fp32 ``MLALatentLayout`` of ``index_head_dim``), and the attention over a given selection
  (GLM-5's layers that reuse the previous layer's top-k).

A request that crosses a page boundary gets its next page on the rank holding the fewest of its pages
(:func:`dtkv.decode.alloc_decode_pages`). Under ``DTKV_DEBUG`` each selection is checked against the top-k of the
gathered full view (:func:`dtkv.decode.check_selection`, on every rank together).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv import _env, ops
from dtkv._util import cdiv
from dtkv.decode import (
    DecodeLayerOutput,
    DecodePlan,
    DecodeQueries,
    DecodeStep,
    DecodeStepConfig,
    StepInputs,
    alloc_decode_pages,
    check_selection,
    global_topk,
    index_scores,
    local_topk,
    merge_partials,
    partial_attention,
    plan_decode,
    selection_keys,
    sharded_decode_comm_bytes,
    unpack_keys,
)
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.runtime._invariant import suspended
from dtkv.runtime.kvio import read_rows, write_rows

__all__ = ["ShardedDecodeStep", "plan_sharded_step"]


def plan_sharded_step(runtime, reqs: Sequence) -> DecodePlan:
    """Allocate each request's next page if its new token needs one, then plan the step (host; SPMD).

    All or nothing: :class:`dtkv.AllocationError` leaves every request's pages as they were.
    """
    ps = runtime.page_size
    seq_lens = [r.num_computed + 1 for r in reqs]
    needs = [max(0, cdiv(n, ps) - len(r.pages)) for r, n in zip(reqs, seq_lens)]
    for r, new in zip(reqs, alloc_decode_pages(runtime.allocator, [r.pages for r in reqs], needs)):
        r.pages.extend(new)
    return plan_decode(
        [r.pages for r in reqs],
        seq_lens,
        runtime.ownership,
        runtime.pool.rank,
        page_size=ps,
        topk=runtime.model_spec.index_topk,
        device=runtime.device,
    )


def _index_keys(index_local: torch.Tensor, plan: DecodePlan, layout: KVLayout, dtype) -> torch.Tensor:
    """Each query's owned index keys ``[N, L * page_size, J]`` (padding slots hold anything finite)."""
    if not isinstance(layout, MLALatentLayout):
        raise TypeError(f"index layout must be MLALatentLayout rows here (fp8 pages go to DecodeStep), got {layout}")
    n, width = plan.owned_local_pages.shape
    ps = layout.page_size
    if index_local.shape[0] == 0:  # this rank stores no page of the pool: every slot is padding
        return torch.zeros((n, width * ps, layout.row_dim), dtype=dtype, device=index_local.device)
    pages = index_local[plan.owned_local_pages.clamp(min=0).flatten()]
    return read_rows(pages, layout, dtype).reshape(n, width * ps, -1)


def _select(index_local, layout: KVLayout, plan: DecodePlan, q: DecodeQueries, group) -> torch.Tensor:
    """The global top-k positions ``[N, K]`` (``-1`` padding) over every rank's own index pages (collective)."""
    ps, k = plan.page_size, plan.topk
    keys_NSJ = _index_keys(index_local, plan, layout, q.iq.dtype)
    offsets = torch.arange(ps, device=plan.owned_slots.device)
    pos_NS = (plan.owned_slots[:, :, None] * ps + offsets).reshape(plan.num_queries, -1)
    valid_NS = (plan.owned_slots[:, :, None] >= 0).expand(-1, -1, ps).reshape(plan.num_queries, -1)
    valid_NS = valid_NS & (pos_NS <= plan.query_pos[:, None])
    keys = selection_keys(index_scores(q.iq, q.iw, keys_NSJ), pos_NS, valid_NS)
    return unpack_keys(global_topk(local_topk(keys, k), k, group))[1]


def _attend(kv_local, layout: KVLayout, plan: DecodePlan, q: DecodeQueries, positions, scale: float, group):
    """Attention over the selected ``positions`` ``[N, K]`` each rank owns, merged by LSE (collective)."""
    if not isinstance(layout, (MLALatentLayout, MLAFp8Layout)):
        raise TypeError(f"kv layout must be MLALatentLayout or MLAFp8Layout, got {type(layout).__name__}")
    ps, dtype = plan.page_size, q.q_nope.dtype
    valid = positions >= 0
    slot = torch.where(valid, positions // ps, torch.zeros_like(positions))
    local_page = plan.slot_local_page.gather(1, slot)
    mine = valid & (local_page >= 0)
    rows_NK = torch.where(mine, local_page * ps + positions % ps, torch.zeros_like(positions))
    flat = kv_local.reshape(-1, kv_local.shape[-1])
    if flat.shape[0] == 0:  # this rank stores no page of the pool: every row is masked
        flat = flat.new_zeros((1, flat.shape[1]))
    picked = flat[rows_NK]  # [N, K, row]
    sel = ops.dequantize_mla_fp8(picked, layout).to(dtype) if isinstance(layout, MLAFp8Layout) else picked.to(dtype)
    r = layout.kv_lora_rank
    out, lse = partial_attention(q.q_nope, q.q_rope, sel[..., :r], sel[..., r:], mine, softmax_scale=scale)
    out, lse = merge_partials(out, lse, group)
    return DecodeLayerOutput(out=out, lse=lse, positions=positions)


class ShardedDecodeStep:
    """One sharded decode step's attention state on one rank (run phase; see the module docstring).

    Args:
        runtime: the runtime stepping.
        plan: the step's :class:`dtkv.decode.DecodePlan` (:func:`plan_sharded_step`).
        page_tables: every request's pages, in the plan's order (after the step's allocation).
    """

    def __init__(self, runtime, plan: DecodePlan, page_tables: Sequence[Sequence[int]]) -> None:
        self.runtime, self.plan, self.page_tables = runtime, plan, [list(p) for p in page_tables]
        lays = runtime.pool.layouts
        self.kv_layout, self.index_layout = lays["kv"], lays["index"]
        # the production step takes fp8 indexer pages (its indexer op and its one-launch row write)
        self.fused = isinstance(self.index_layout, IndexerFp8Layout) and isinstance(
            self.kv_layout, (MLAFp8Layout, MLALatentLayout)
        )
        self._step: DecodeStep | None = None
        self._held: dict[tuple[str, int], torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------ writes
    def write(self, name: str, layer: int, rows: torch.Tensor) -> None:
        """The layer's rows ``[N, C]`` of pool ``name``: held for the decode step's one-launch write of the layer
        (``fused``), else written now (owner-filtered, no collective)."""
        if self.fused and name in ("kv", "index"):
            self._held[(name, layer)] = rows
            return
        self._write_now(name, layer, rows)

    def _write_now(self, name: str, layer: int, rows: torch.Tensor) -> None:
        rt = self.runtime
        write_rows(rt.pool.local(name, layer), rt.pool.layouts[name], rows, self.plan.new_locs, rt.ownership_spec,
                   rt.pool.rank)  # fmt: skip

    def flush(self, layer: int | None = None) -> None:
        """Write the held rows (of ``layer``, or all) the way :meth:`write` writes rows that are not held."""
        for key in [k for k in self._held if layer is None or k[1] == layer]:
            self._write_now(key[0], key[1], self._held.pop(key))

    # ------------------------------------------------------------------------------------------ attention
    def _decode_step(self, num_heads: int, softmax_scale: float) -> DecodeStep:
        """The step's :class:`dtkv.decode.DecodeStep` (built at the first layer: eager, sized for this batch, the
        runtime's attention backend, the torch indexer), its plan set (host)."""
        if (
            self._step is None
            or self._step.config.num_heads != num_heads
            or (self._step.softmax_scale != float(softmax_scale))
        ):
            rt, plan = self.runtime, self.plan
            width = max(len(p) for p in self.page_tables)
            config = DecodeStepConfig(
                mode="sharded", num_heads=num_heads, topk=plan.topk, softmax_scale=softmax_scale,
                max_batch=plan.num_queries, max_pages=width, scored_pages=width, attention=rt.attention.name,
                indexer="torch",
            )  # fmt: skip
            step = DecodeStep(rt.pool, config)
            step.set_plan(self.page_tables, (plan.query_pos + 1).tolist())
            step.exchange.begin_step()
            self._step = step
        return self._step

    def attention(
        self, layer: int, q: DecodeQueries, *, softmax_scale: float, positions: torch.Tensor | None = None
    ) -> DecodeLayerOutput:
        """One layer of the step (collective; :meth:`dtkv.runtime.StepContext.decode_attention`)."""
        rt, plan = self.runtime, self.plan
        kv_lay = self.kv_layout
        select = positions is None
        heads = q.q_nope.shape[1]
        with suspended():  # not batch-invariant by design: the merge sums in page-placement order
            if select and self.fused:
                kv_row, index_k = self._held.pop(("kv", layer), None), self._held.pop(("index", layer), None)
                if kv_row is None or index_k is None:
                    raise RuntimeError(
                        f"layer {layer}: a sharded decode step's attention reads the layer's 'kv' and 'index' rows; "
                        "write both (ctx.write) before ctx.decode_attention"
                    )
                step = self._decode_step(heads, softmax_scale)
                qs = step.attn.cast_queries(torch.cat((q.q_nope, q.q_rope), dim=-1))
                x = StepInputs(iq=q.iq, iw=q.iw, q=qs, kv_row=kv_row, index_k=index_k)
                got = step.layer(layer, x)  # writes the rows (owner filter), selects, attends, merges
                res = DecodeLayerOutput(out=got.out, lse=got.lse, positions=DecodeStep.positions(got))
                out_isz, lse_isz = _partial_itemsizes(step.attn.name, qs.dtype)
            else:
                self.flush(layer)
                pool, group = rt.pool, rt.pool.group
                kv_local, index_local = pool.local("kv", layer), pool.local("index", layer)
                if select:
                    positions = _select(index_local, self.index_layout, plan, q, group)
                res = _attend(kv_local, kv_lay, plan, q, positions, softmax_scale, group)
                out_isz = lse_isz = q.q_nope.element_size()
        comm = sharded_decode_comm_bytes(
            num_queries=plan.num_queries, topk=plan.topk if select else 0, num_heads=heads,
            kv_lora_rank=kv_lay.kv_lora_rank, cp_size=plan.cp_size, partial_itemsize=out_isz, lse_itemsize=lse_isz,
        )  # fmt: skip
        rt.stats["decode_comm_bytes"] += comm.sent
        if select and _env.debug_enabled():
            with suspended():
                _check_against_full_view(rt, layer, plan, q, res.positions, self.page_tables)
        return res


def _partial_itemsizes(backend: str, q_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes per element of a partial's ``out`` and ``lse`` as the backend returns them (what the merge sends)."""
    if backend == "flashmla":
        return 2, 4
    if q_dtype == torch.float64:
        return (8, 8) if backend == "torch" else (4, 4)
    if backend == "torch":
        return 4, 4
    return torch.empty((), dtype=q_dtype).element_size(), 4


def _check_against_full_view(runtime, layer: int, plan: DecodePlan, q: DecodeQueries, positions, page_tables) -> None:
    """``DTKV_DEBUG``: the layer's sharded top-k against a stable sort over the full view's keys (collective)."""
    ps, dtype = runtime.page_size, q.iq.dtype
    index_keys = read_rows(runtime.pool.gather_full(layer, "index"), runtime.pool.layouts["index"], dtype)
    reference = torch.full_like(positions, -1)
    for b, pages in enumerate(page_tables):
        kv_len = int(plan.query_pos[b]) + 1
        pos = torch.arange(kv_len, device=index_keys.device)
        rows = torch.tensor(list(pages), dtype=torch.int64, device=index_keys.device)[pos // ps] * ps + pos % ps
        scores = index_scores(q.iq[b : b + 1], q.iw[b : b + 1], index_keys[rows][None])[0].to(torch.float32)
        k = min(plan.topk, kv_len)
        order = torch.sort(scores, descending=True, stable=True).indices[:k]  # ties: the lower position first
        reference[b, :k] = order
    check_selection(positions, reference, runtime.pool.group, what=f"layer {layer}")
    runtime.stats["topk_checks"] += 1
