"""Sharded decode in the runtime: the step's plan (host) and its run's attention state (which writes it holds).

Plan phase: :func:`plan_sharded_step` allocates each request's next page where its new token needs one and builds
the step's :class:`dtkv.decode.DecodePlan`. Run phase: every rank runs the dense part of the step for every request
(so every rank holds every query); per layer the model writes the token's rows and calls
:meth:`dtkv.runtime.StepContext.decode_attention`, which :class:`ShardedDecodeAttention` answers with

- a layer of :class:`dtkv.decode.DecodeStep` (the production decode step, eager: the indexer op
  :func:`dtkv.ops.indexer_scores`, the exact global top-k, attention through the runtime's backend of
  :mod:`dtkv.attention` on the rank's own pages, the LSE merge) when the layer scores its own indexer over fp8
  index pages (:class:`dtkv.IndexerFp8Layout`: the reference model, and transformers models with
  ``kv_dtype="fp8"``). The step writes the layer's two rows itself, in one launch: the model's
  :meth:`~dtkv.runtime.StepContext.write` calls of such a step are held until the layer's attention takes them, so
  every row is written once;
- otherwise :func:`dtkv.decode.decode_layer` (index pages stored as bf16/fp32 rows, or a layer that reuses the
  previous layer's selection: GLM-5's shared indexers), after the layer's rows are written (owner-filtered).

The indexer of the production step is Triton's (:func:`dtkv.ops.indexer_scores`, fp8 x fp8 dots) on a GPU where the
model's indexer queries are DeepSeek-V3.2's fp8 ones (:attr:`dtkv.decode.DecodeQueries.iq_fp8`), the torch
reference otherwise (CPUs, exact queries, the float64 reference model).

**CUDA graphs** (:mod:`dtkv.runtime._graphs`): a captured step's attention is a :class:`ShardedDecodeAttention`
over a graph bucket instead of a plan: the bucket's persistent :class:`dtkv.decode.DecodeStep` (its plan copied in
by the host before each replay), its static positions. Only the production step captures; the float64 path raises
:class:`GraphUnsupported` (its shapes come from a plan of the step), and the step runs eager.

A request that crosses a page boundary gets its next page on the rank holding the fewest of its pages
(:func:`dtkv.decode.alloc_decode_pages`). Under ``DTKV_DEBUG`` each selection is checked against the top-k of the
gathered full view (:func:`dtkv.decode.check_selection`, on every rank together).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv import _env
from dtkv._util import cdiv
from dtkv.allocator import PageAllocator
from dtkv.decode import (
    DecodeLayerOutput,
    DecodePlan,
    DecodeQueries,
    DecodeStep,
    DecodeStepConfig,
    StepInputs,
    alloc_decode_pages,
    check_selection,
    decode_layer,
    index_scores,
    plan_decode,
    sharded_decode_comm_bytes,
)
from dtkv.kvio import read_rows, round_trip, write_rows
from dtkv.layouts import IndexerFp8Layout, MLAFp8Layout, MLALatentLayout
from dtkv.ops import HAS_TRITON
from dtkv.ownership import OwnershipSpec, PageOwnership
from dtkv.pool import ShardedKVPool
from dtkv.runtime._invariant import suspended
from dtkv.runtime._request import Request

__all__ = ["GraphUnsupported", "ShardedDecodeAttention", "alloc_sharded_pages", "plan_sharded_step"]


class GraphUnsupported(RuntimeError):
    """A decode step's forward reached a piece a CUDA graph cannot hold (raised while a bucket warms up; the step
    then runs eager)."""


def alloc_sharded_pages(reqs: Sequence[Request], *, allocator: PageAllocator, page_size: int) -> None:
    """Give each request its next page if its new token needs one (host; SPMD; all or nothing:
    :class:`dtkv.AllocationError` leaves every request's pages as they were)."""
    needs = [max(0, cdiv(r.num_computed + 1, page_size) - len(r.pages)) for r in reqs]
    if not any(needs):
        return
    for r, new in zip(reqs, alloc_decode_pages(allocator, [r.pages for r in reqs], needs)):
        r.pages.extend(new)


def plan_sharded_step(
    reqs: Sequence[Request],
    *,
    allocator: PageAllocator,
    ownership: PageOwnership,
    rank: int,
    page_size: int,
    topk: int,
    device: torch.device,
) -> DecodePlan:
    """Allocate each request's next page if its new token needs one, then plan the step (host; SPMD).

    All or nothing: :class:`dtkv.AllocationError` leaves every request's pages as they were.
    """
    alloc_sharded_pages(reqs, allocator=allocator, page_size=page_size)
    seq_lens = [r.num_computed + 1 for r in reqs]
    return plan_decode([r.pages for r in reqs], seq_lens, ownership, rank, page_size=page_size, topk=topk,
                       device=device)  # fmt: skip


class ShardedDecodeAttention:
    """The attention of one sharded decode step on one rank, and the row writes it holds (run phase; see the module
    docstring).

    Args:
        pool: the runtime's pools; ``spec``: their ownership as plain ints.
        attention: the name of the runtime's attention backend (the production step's).
        stats: the runtime's counters (``decode_comm_bytes``, ``topk_checks`` are added to).
        plan: the step's :class:`dtkv.decode.DecodePlan` (:func:`plan_sharded_step`), or
        bucket: a graph bucket of :mod:`dtkv.runtime._graphs` (its ``decode_step(num_heads, softmax_scale)``, its
            static ``positions``, ``num_queries`` and ``topk``): exactly one of the two.
        page_tables: with ``plan``, every request's pages, in the plan's order (after the step's allocation).

    Attributes:
        positions: int64 ``[N]`` the queries' positions (a graph bucket's static buffer, padding rows 0).
    """

    def __init__(
        self,
        *,
        pool: ShardedKVPool,
        spec: OwnershipSpec,
        attention: str,
        stats: dict[str, int],
        plan: DecodePlan | None = None,
        page_tables: Sequence[Sequence[int]] = (),
        bucket=None,
    ) -> None:
        if (plan is None) == (bucket is None):
            raise ValueError("ShardedDecodeAttention needs a plan (eager) or a graph bucket, exactly one of the two")
        self.pool, self.spec, self.attention_name, self.stats = pool, spec, attention, stats
        self.plan, self.bucket, self.page_tables = plan, bucket, [list(p) for p in page_tables]
        self.positions: torch.Tensor = plan.query_pos if plan is not None else bucket.positions
        self.num_queries = plan.num_queries if plan is not None else bucket.num_queries
        self.topk = plan.topk if plan is not None else bucket.topk
        lays = pool.layouts
        self.kv_layout, self.index_layout = lays["kv"], lays["index"]
        self.fused = self.takes(lays)
        self._step: DecodeStep | None = None
        self._held: dict[tuple[str, int], torch.Tensor] = {}

    @staticmethod
    def takes(layouts) -> bool:
        """Whether the production step takes pools of these layouts: fp8 indexer pages (its indexer op and its
        one-launch row write) beside MLA rows."""
        return isinstance(layouts["index"], IndexerFp8Layout) and isinstance(
            layouts["kv"], (MLAFp8Layout, MLALatentLayout)
        )

    # ------------------------------------------------------------------------------------------ writes
    def write(self, name: str, layer: int, rows: torch.Tensor) -> None:
        """The layer's rows ``[N, C]`` of pool ``name``: held for the decode step's one-launch write of the layer
        (``fused``), else written now (owner-filtered, no collective)."""
        if self.fused and name in ("kv", "index"):
            self._held[(name, layer)] = rows
            return
        self._write_now(name, layer, rows)

    def _write_now(self, name: str, layer: int, rows: torch.Tensor) -> None:
        if self.plan is None:
            raise GraphUnsupported(f"a write of pool {name!r} outside the decode step's fused write")
        pool = self.pool
        # the runtime planned these locations itself: no host validation (one sync a write) unless DTKV_DEBUG
        write_rows(pool.local(name, layer), pool.layouts[name], rows, self.plan.new_locs, self.spec, pool.rank,
                   validate=_env.debug_enabled())  # fmt: skip

    def flush(self, layer: int | None = None) -> None:
        """Write the held rows (of ``layer``, or all) the way :meth:`write` writes rows that are not held."""
        for key in [k for k in self._held if layer is None or k[1] == layer]:
            self._write_now(key[0], key[1], self._held.pop(key))

    # ------------------------------------------------------------------------------------------ attention
    def _decode_step(self, num_heads: int, softmax_scale: float, iq_fp8: bool) -> DecodeStep:
        """The step's :class:`dtkv.decode.DecodeStep`: a graph bucket's, or (eager) one built at the first layer,
        sized for this batch, on the runtime's attention backend, its plan set (host)."""
        if self.bucket is not None:
            return self.bucket.decode_step(num_heads, softmax_scale, iq_fp8)
        if (
            self._step is None
            or self._step.config.num_heads != num_heads
            or (self._step.softmax_scale != float(softmax_scale))
        ):
            assert self.plan is not None, "an eager sharded decode step has a plan"
            plan = self.plan
            width = max(len(p) for p in self.page_tables)
            config = step_config(
                num_heads=num_heads, topk=plan.topk, softmax_scale=softmax_scale, batch=plan.num_queries,
                max_pages=width, scored_pages=width, attention=self.attention_name, device=self.pool.device,
                iq_fp8=iq_fp8,
            )  # fmt: skip
            step = DecodeStep(self.pool, config)
            step.set_plan(self.page_tables, (plan.query_pos + 1).tolist())
            step.exchange.begin_step()
            self._step = step
        return self._step

    def attention(
        self,
        layer: int,
        q: DecodeQueries,
        *,
        softmax_scale: float,
        positions: torch.Tensor | None = None,
        return_positions: bool = True,
    ) -> DecodeLayerOutput:
        """One layer of the step (collective; :meth:`dtkv.runtime.StepContext.decode_attention`)."""
        kv_lay = self.kv_layout
        select = positions is None
        heads = q.q_nope.shape[1]
        if self.bucket is not None and not (select and self.fused):
            raise GraphUnsupported(
                "a layer that reuses the previous layer's selection" if self.fused else "index pages stored as rows"
            )
        with suspended():  # not batch-invariant by design: the merge sums in page-placement order
            if select and self.fused:
                kv_row, index_k = self._held.pop(("kv", layer), None), self._held.pop(("index", layer), None)
                if kv_row is None or index_k is None:
                    raise RuntimeError(
                        f"layer {layer}: a sharded decode step's attention reads the layer's 'kv' and 'index' rows; "
                        "write both (ctx.write) before ctx.decode_attention"
                    )
                step = self._decode_step(heads, softmax_scale, q.iq_fp8)
                qs = step.attn.cast_queries(_joined_queries(q.q_nope, q.q_rope))
                iq = q.iq if step.q_fp8 else rounded_queries(q).iq  # the kernel rounds them itself
                x = StepInputs(iq=iq, iw=q.iw, q=qs, kv_row=kv_row, index_k=index_k)
                got = step.layer(layer, x)  # writes the rows (owner filter), selects, attends, merges
                # the layer's output in the queries' compute dtype (the contract of DecodeLayerOutput): FlashMLA's
                # partial is bf16 and, with nothing to merge (one rank), would reach the model as it is
                dt = q.q_nope.dtype
                listed = return_positions or _env.debug_enabled()  # a sort of the keys: only where read
                res = DecodeLayerOutput(
                    out=got.out.to(dt), lse=got.lse.to(dt), positions=DecodeStep.positions(got) if listed else None
                )
                out_isz, lse_isz = _partial_itemsizes(step.attn.name, qs.dtype)
            else:
                assert self.plan is not None, "the float64 path runs eager, over a plan"
                q = rounded_queries(q)
                self.flush(layer)
                pool = self.pool
                res = decode_layer(
                    pool.local("kv", layer), pool.local("index", layer), kv_lay, self.index_layout, self.plan, q,
                    softmax_scale=softmax_scale, group=pool.group, positions=positions,
                )  # fmt: skip
                out_isz = lse_isz = q.q_nope.element_size()
        comm = sharded_decode_comm_bytes(
            num_queries=self.num_queries, topk=self.topk if select else 0, num_heads=heads,
            kv_lora_rank=q.q_nope.shape[-1], cp_size=self.pool.ownership.cp_size, partial_itemsize=out_isz,
            lse_itemsize=lse_isz,
        )  # fmt: skip
        self.stats["decode_comm_bytes"] += comm.sent
        if select and self.plan is not None and _env.debug_enabled():
            with suspended():
                _check_against_full_view(self.pool, layer, self.plan, rounded_queries(q), res.positions,
                                         self.page_tables)  # fmt: skip
            self.stats["topk_checks"] += 1
        return res


def rounded_queries(q: DecodeQueries) -> DecodeQueries:
    """``q`` with its indexer queries rounded to fp8 where they are not yet (:attr:`DecodeQueries.iq_unrounded`):
    each row e4m3 with the scale ``amax / 448``, given back as float32 ``codes * scale``."""
    if not q.iq_unrounded:
        return q
    iq = round_trip(q.iq.float(), IndexerFp8Layout(page_size=1, head_dim=q.iq.shape[-1]))
    return q._replace(iq=iq, iq_unrounded=False)


def _joined_queries(q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    """``[N, H, R + E]``: ``cat((q_nope, q_rope), -1)``, or the contiguous buffer both are views of where they are
    its two halves (a model that writes its latent query beside the rope part: no copy)."""
    n, h, r = q_nope.shape
    e = q_rope.shape[-1]
    adjacent = (
        q_nope.dtype == q_rope.dtype
        and q_nope.device == q_rope.device
        and q_rope.shape[:2] == q_nope.shape[:2]
        and q_nope.stride() == q_rope.stride() == (h * (r + e), r + e, 1)
        and q_rope.data_ptr() == q_nope.data_ptr() + r * q_nope.element_size()
    )
    if adjacent:  # the same memory the two views read, element for element
        return q_nope.as_strided((n, h, r + e), (h * (r + e), r + e, 1))
    return torch.cat((q_nope, q_rope), dim=-1)


def step_config(
    *,
    num_heads: int,
    topk: int,
    softmax_scale: float,
    batch: int,
    max_pages: int,
    scored_pages: int,
    attention: str,
    device: torch.device,
    iq_fp8: bool,
) -> DecodeStepConfig:
    """The :class:`dtkv.decode.DecodeStepConfig` of the runtime's sharded decode (eager and graph buckets alike):
    the runtime's attention backend; Triton's fp8 indexer on a GPU for fp8 indexer queries, else the torch one."""
    triton = torch.device(device).type == "cuda" and HAS_TRITON and bool(iq_fp8)
    return DecodeStepConfig(
        mode="sharded", num_heads=num_heads, topk=topk, softmax_scale=softmax_scale, max_batch=batch,
        max_pages=max_pages, scored_pages=scored_pages, attention=attention,
        indexer="triton" if triton else "torch", q_fp8=triton,
    )  # fmt: skip


def _partial_itemsizes(backend: str, q_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes per element of a partial's ``out`` and ``lse`` as the backend returns them (what the merge sends)."""
    if backend == "flashmla":
        return 2, 4
    if q_dtype == torch.float64:
        return (8, 8) if backend == "torch" else (4, 4)
    if backend == "torch":
        return 4, 4
    return torch.empty((), dtype=q_dtype).element_size(), 4


def _check_against_full_view(pool, layer: int, plan: DecodePlan, q: DecodeQueries, positions, page_tables) -> None:
    """``DTKV_DEBUG``: the layer's sharded top-k against a stable sort over the full view's keys (collective)."""
    ps, dtype = plan.page_size, q.iq.dtype
    index_keys = read_rows(pool.gather_full(layer, "index"), pool.layouts["index"], dtype)
    reference = torch.full_like(positions, -1)
    for b, pages in enumerate(page_tables):
        kv_len = int(plan.query_pos[b]) + 1
        pos = torch.arange(kv_len, device=index_keys.device)
        rows = torch.tensor(list(pages), dtype=torch.int64, device=index_keys.device)[pos // ps] * ps + pos % ps
        scores = index_scores(q.iq[b : b + 1], q.iw[b : b + 1], index_keys[rows][None])[0].to(torch.float32)
        k = min(plan.topk, kv_len)
        order = torch.sort(scores, descending=True, stable=True).indices[:k]  # ties: the lower position first
        reference[b, :k] = order
    check_selection(positions, reference, pool.group, what=f"layer {layer}")
