"""``StepContext``: what a model's attention calls during one step of the runtime (run phase).

One context per step, created by :class:`dtkv.runtime.Runtime` and handed to :meth:`ModelAdapter.forward`:

- ``ctx.ids`` / ``ctx.positions``: the rows this rank runs (its share of an extend step; every query of a sharded
  decode step);
- :meth:`StepContext.write`: store a layer's new rows the way the KV mode says (owner-filtered, compute-owner
  direct plus the small handoff all-gather, or replicated);
- :meth:`StepContext.views`: an extend step's full views of the pages it reads (prefetched a layer ahead when the
  step has a materializer), with :attr:`StepContext.plan`'s key table to index them;
- :meth:`StepContext.decode_attention`: a sharded decode step's sparse attention over the ranks' own pages.

Every method is collective over the CP group in the modes where it moves data; every rank calls them in the same
order (the model's layers run in the same order everywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dtkv import _env
from dtkv._collectives import all_gather_rows
from dtkv.debug import check_write_ownership
from dtkv.materialize import Materializer, check_view, gather_view
from dtkv.runtime.kvio import write_rows

if TYPE_CHECKING:
    from dtkv.decode import DecodeLayerOutput, DecodePlan, DecodeQueries
    from dtkv.runtime._decode import ShardedDecodeStep
    from dtkv.runtime._plan import StepPlan
    from dtkv.runtime.runtime import Runtime

__all__ = ["StepContext"]


class StepContext:
    """The runtime as one step's attention sees it (see the module docstring).

    Attributes:
        runtime: the :class:`dtkv.runtime.Runtime` running the step.
        plan: the extend step's :class:`dtkv.runtime.StepPlan` (``None`` in a sharded decode step).
        decode: the sharded decode step's :class:`dtkv.decode.DecodePlan` (``None`` in an extend step).
        materializer: the extend step's :class:`dtkv.materialize.Materializer` when it prefetches, else ``None``.
        attention: the runtime's :class:`dtkv.attention.AttentionBackend` (``name``: ``"torch"``, ``"triton"`` or
            ``"flashmla"``).
        layouts: the pools' layouts, by name.
        page_size: tokens per page.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        plan: StepPlan | None = None,
        decode: DecodePlan | None = None,
        ids: torch.Tensor | None = None,
        decode_pages: list[list[int]] | None = None,
    ) -> None:
        if (plan is None) == (decode is None):
            raise ValueError(
                "StepContext needs one step: an extend plan (plan=) or a sharded decode plan (decode=), got "
                f"plan={'None' if plan is None else 'a plan'}, decode={'None' if decode is None else 'a plan'}"
            )
        if decode is not None and (ids is None or decode_pages is None):
            raise ValueError("a sharded decode step's StepContext needs its token ids (ids=) and page tables "
                             "(decode_pages=)")  # fmt: skip
        self.runtime = runtime
        self.plan = plan
        self.decode = decode
        self.materializer: Materializer | None = None
        self.decode_pages = decode_pages
        """A sharded decode step's page tables (what ``DTKV_DEBUG`` checks the selection against)."""
        self._ids = ids
        self._sharded: ShardedDecodeStep | None = None
        self.attention = runtime.attention
        self.layouts = runtime.pool.layouts
        self.page_size = runtime.page_size

    # ------------------------------------------------------------------------------------------ rows
    @property
    def ids(self) -> torch.Tensor:
        """int64 ``[n]``: token ids of the rows this rank runs."""
        if self.plan is not None:
            return self.plan.ids
        assert self._ids is not None, "a sharded decode step's context holds its token ids"
        return self._ids

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[n]``: their absolute positions."""
        if self.plan is not None:
            return self.plan.positions
        assert self.decode is not None, "a step's context holds an extend plan or a decode plan"
        return self.decode.query_pos

    @property
    def sharded_decode(self) -> bool:
        """Whether this is a sharded decode step (every rank runs every query; attention on the shards)."""
        return self.decode is not None

    # ------------------------------------------------------------------------------------------ writes
    def _gather(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Rank-major all-gather of ``x`` padded to ``rows`` rows: ``[cp * rows, ...]`` (one process: ``x`` padded,
        nothing exchanged -- ``mode="replicated"`` or ``"sharded"`` of a group of one, or of no group)."""
        group = self.runtime.group
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        return padded if group is None else all_gather_rows(padded, group)

    def write(self, name: str, layer: int, rows: torch.Tensor) -> None:
        """Store this step's rows ``[n, C]`` of pool ``name``, layer ``layer`` (collective in the CP modes).

        In a sharded decode step every rank holds every row: each keeps the rows of the pages it stores
        (owner-filtered, no collective; with fp8 index pages the layer's rows are written by the decode step's one
        launch, at its attention: every row once).
        """
        rt = self.runtime
        lay, pool = self.layouts[name], rt.pool.local(name, layer)
        spec, rank = rt.ownership_spec, rt.pool.rank
        if self.decode is not None:
            self._decode_step().write(name, layer, rows)
            return
        plan, mode = self.plan, rt.mode
        assert plan is not None, "a step's context holds an extend plan or a decode plan"
        if mode == "single":
            write_rows(pool, lay, rows, plan.locs, spec, 0)
        elif mode in ("replicated", "sharded"):
            write_rows(pool, lay, self._gather(rows, plan.max_local), plan.locs_gathered, spec, rank)
        else:
            locs = plan.locs[plan.direct_rows]
            if _env.debug_enabled():
                what = f"direct write of {name!r}, layer {layer}"
                check_write_ownership(locs, rt.ownership, rt.rank, self.page_size, rt.group, what=what)
            write_rows(pool, lay, rows[plan.direct_rows], locs, spec, rank, direct=True)
            if plan.max_handoff:
                gathered = self._gather(rows[plan.handoff_rows], plan.max_handoff)
                write_rows(pool, lay, gathered, plan.handoff_locs_gathered, spec, rank)

    # ------------------------------------------------------------------------------------------ reads
    def views(self, layer: int, names: tuple[str, ...] = ("index", "kv")) -> dict[str, torch.Tensor]:
        """``layer``'s full views (name -> ``[num_view_pages, *page_shape]``); call after the layer's writes.

        A whole pool (``single``, ``replicated``) is its own view. With a materializer the next layer's history
        pages are gathered while this layer computes (its view holds every pool).
        """
        rt, plan = self.runtime, self.plan
        if plan is None:
            raise RuntimeError("views() belongs to an extend step; a sharded decode step reads decode_attention()")
        if plan.mat_plan is None:
            return {n: rt.pool.local(n, layer) for n in names}
        if self.materializer is not None:
            self.materializer.prefetch(layer + 1)  # the next layer's history gather overlaps this layer
            return self.materializer.view(layer)
        views = {n: gather_view(rt.pool.local(n, layer), plan.mat_plan, rt.group) for n in names}
        if _env.debug_enabled():
            check_view(rt.pool, layer, plan.mat_plan, views)
        return views

    def decode_attention(
        self,
        layer: int,
        queries: DecodeQueries,
        *,
        softmax_scale: float,
        positions: torch.Tensor | None = None,
    ) -> DecodeLayerOutput:
        """A sharded decode step's sparse attention of one layer (collective; run phase).

        Args:
            layer: the layer (its rows are written already).
            queries: absorbed-MLA queries of every request (:class:`dtkv.decode.DecodeQueries`, compute dtype
                float32 or float64).
            softmax_scale: attention logit scale.
            positions: int64 ``[N, K]`` a selection to reuse (a layer without its own indexer reuses the previous
                layer's ``positions``); ``None`` runs the layer's indexer over the ranks' own index pages.

        Returns:
            :class:`dtkv.decode.DecodeLayerOutput` (merged latent output, LSE, selected positions), the same on
            every rank.
        """
        if self.decode is None:
            raise RuntimeError("decode_attention() belongs to a sharded decode step; an extend step reads views()")
        return self._decode_step().attention(layer, queries, softmax_scale=softmax_scale, positions=positions)

    def _decode_step(self) -> ShardedDecodeStep:
        if self._sharded is None:
            from dtkv.runtime._decode import ShardedDecodeStep

            assert self.decode is not None and self.decode_pages is not None, "a sharded decode step's context"
            self._sharded = ShardedDecodeStep(self.runtime, self.decode, self.decode_pages)
        return self._sharded

    def finish(self) -> None:
        """End of the model's forward: rows a sharded decode step still holds are written (run phase)."""
        if self._sharded is not None:
            self._sharded.flush()
