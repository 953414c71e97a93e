"""``StepContext``: what a model's attention calls during one step of the runtime (run phase).

One context per step, created by :class:`dtkv.runtime.Runtime` (:meth:`~dtkv.runtime.Runtime.context` gives an
extend plan's, to drive an adapter's forward yourself) and handed to :meth:`ModelAdapter.forward`:

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
import torch.distributed as dist

from dtkv import _env
from dtkv._collectives import gather_padded
from dtkv.attention import AttentionBackend
from dtkv.debug import check_write_ownership
from dtkv.kvio import write_rows
from dtkv.materialize import Materializer, check_view, gather_view
from dtkv.ownership import OwnershipSpec, PageOwnership
from dtkv.pool import ShardedKVPool

if TYPE_CHECKING:
    from dtkv.decode import DecodeLayerOutput, DecodeQueries
    from dtkv.runtime._decode import ShardedDecodeAttention
    from dtkv.runtime._plan import ExtendPlan

__all__ = ["StepContext"]


class StepContext:
    """The runtime as one step's attention sees it (see the module docstring).

    Args:
        pool: the runtime's pools.
        mode: its KV mode (:mod:`dtkv.runtime` table).
        group: its CP group (``None``: one process).
        ownership: the pool's page ownership, and ``spec`` the same as plain ints (what the ops are given).
        attention: the attention backend.
        plan: an extend step's :class:`dtkv.runtime.ExtendPlan`, or
        sharded: a sharded decode step's attention (and ``ids``, its token ids): exactly one of the two.
        decoding: an extend plan that is a decode step (one new token per request, one query per request in
            request order): attention may take the backend's decode kernel (:meth:`decode_schedule`).
        schedules: the runtime's decode schedules by ``(num_queries, width)`` (kept across steps).
        validate: the host check of the writes' locations (``None``: the ops' default; ``False`` in decode steps,
            whose locations the runtime planned itself: no sync a write; ``DTKV_DEBUG`` checks them).

    Attributes:
        plan: the extend step's :class:`dtkv.runtime.ExtendPlan` (``None`` in a sharded decode step).
        decode: the sharded decode step's :class:`dtkv.decode.DecodePlan` (``None`` in an extend step and in a
            captured sharded decode step, whose plan is its graph bucket's).
        decoding: the step is a decode step (``sharded_decode``, or a full-view decode step's extend plan).
        materializer: the extend step's :class:`dtkv.materialize.Materializer` when it prefetches, else ``None``.
        attention: the runtime's :class:`dtkv.attention.AttentionBackend` (``name``: ``"torch"``, ``"triton"`` or
            ``"flashmla"``).
        layouts: the pools' layouts, by name.
        page_size: tokens per page.
    """

    def __init__(
        self,
        *,
        pool: ShardedKVPool,
        mode: str,
        group: dist.ProcessGroup | None,
        ownership: PageOwnership,
        spec: OwnershipSpec,
        attention: AttentionBackend,
        plan: ExtendPlan | None = None,
        sharded: ShardedDecodeAttention | None = None,
        ids: torch.Tensor | None = None,
        decoding: bool = False,
        schedules: dict | None = None,
        validate: bool | None = None,
    ) -> None:
        if (plan is None) == (sharded is None):
            raise ValueError(
                "StepContext needs one step: an extend plan (plan=) or a sharded decode step (sharded=), got "
                f"plan={'None' if plan is None else 'a plan'}, sharded={'None' if sharded is None else 'a step'}"
            )
        if sharded is not None and ids is None:
            raise ValueError("a sharded decode step's StepContext needs its token ids (ids=)")
        self.pool, self.mode, self.group = pool, mode, group
        self.ownership, self.spec = ownership, spec
        self.plan = plan
        self.decode = None if sharded is None else sharded.plan
        self.materializer: Materializer | None = None
        self._ids = ids
        self._sharded = sharded
        self.attention = attention
        self.layouts = pool.layouts
        self.page_size = next(iter(pool.layouts.values())).page_size
        self.decoding = bool(decoding) or sharded is not None
        self.validate = False if self.decoding and validate is None and not _env.debug_enabled() else validate
        self._schedules = {} if schedules is None else schedules
        self._once: dict[object, object] = {}

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
        assert self._sharded is not None, "a step's context holds an extend plan or a sharded decode step"
        return self._sharded.positions

    @property
    def sharded_decode(self) -> bool:
        """Whether this is a sharded decode step (every rank runs every query; attention on the shards)."""
        return self._sharded is not None

    def decode_schedule(self, num_queries: int, width: int):
        """The attention backend's :class:`dtkv.attention.DecodeSchedule` for decode calls of ``num_queries`` rows
        and index width ``width`` in a full-view decode step (plan: built once per shape and kept by the runtime
        across steps, so FlashMLA builds its tile-scheduler metadata once and a CUDA graph can capture the call).
        Its ``lse`` is not for merging (nothing is merged in a full view)."""
        key = (int(num_queries), int(width))
        schedule = self._schedules.get(key)
        if schedule is None:
            schedule = self._schedules[key] = self.attention.plan_decode(key[0], key[1], merge_lse=False)
        return schedule

    def once(self, key: object, build):
        """``build()``'s value, built on the first call of the step with this ``key`` and kept for the step's later
        layers: what every layer derives alike from the plan (a decode bucket's page tables, say) costs its
        device work once a step, and a captured step records it once, not once a layer.

        Args:
            key: hashable; what the value depends on besides the step (a page size, a stride).
            build: a function of no arguments (run phase: tensors only).
        """
        if key not in self._once:
            self._once[key] = build()
        return self._once[key]

    # ------------------------------------------------------------------------------------------ writes
    def _gather(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """Rank-major all-gather of ``x`` padded to ``rows`` rows: ``[cp * rows, ...]`` (one process: ``x`` padded,
        nothing exchanged -- ``mode="replicated"`` or ``"sharded"`` of a group of one, or of no group)."""
        return gather_padded(x, rows, self.group)

    def write(self, name: str, layer: int, rows: torch.Tensor) -> None:
        """Store this step's rows ``[n, C]`` of pool ``name``, layer ``layer`` (collective in the CP modes).

        In a sharded decode step every rank holds every row: each keeps the rows of the pages it stores
        (owner-filtered, no collective; with fp8 index pages the layer's rows are written by the decode step's one
        launch, at its attention: every row once). An extend step's writes are not validated on the host (no
        synchronization in the run phase): the plan's locations come from the allocator's pages; ``DTKV_DEBUG=1``
        validates them (one synchronization a write).
        """
        lay, pool = self.layouts[name], self.pool.local(name, layer)
        spec, rank = self.spec, self.pool.rank
        if self._sharded is not None:
            self._sharded.write(name, layer, rows)
            return
        plan, mode = self.plan, self.mode
        assert plan is not None, "a step's context holds an extend plan or a decode plan"
        check = self.validate
        if check is None and not _env.debug_enabled():
            check = False  # the plan's locations are valid by construction
        if mode == "single":
            write_rows(pool, lay, rows, plan.locs, spec, 0, validate=check)
        elif mode in ("replicated", "sharded"):
            write_rows(pool, lay, self._gather(rows, plan.max_local), plan.locs_gathered, spec, rank, validate=check)
        else:
            locs = plan.locs[plan.direct_rows]
            if _env.debug_enabled():
                what = f"direct write of {name!r}, layer {layer}"
                check_write_ownership(locs, self.ownership, rank, self.page_size, self.group, what=what)
            write_rows(pool, lay, rows[plan.direct_rows], locs, spec, rank, direct=True, validate=check)
            if plan.max_handoff:
                gathered = self._gather(rows[plan.handoff_rows], plan.max_handoff)
                write_rows(pool, lay, gathered, plan.handoff_locs_gathered, spec, rank, validate=check)

    # ------------------------------------------------------------------------------------------ reads
    def views(self, layer: int, names: tuple[str, ...] = ("index", "kv")) -> dict[str, torch.Tensor]:
        """``layer``'s full views (name -> ``[num_view_pages, *page_shape]``); call after the layer's writes.

        A whole pool (``single``, ``replicated``) is its own view. With a materializer the next layer's history
        pages are gathered while this layer computes (its view holds every pool).
        """
        pool, plan = self.pool, self.plan
        if plan is None:
            raise RuntimeError("views() belongs to an extend step; a sharded decode step reads decode_attention()")
        if plan.mat_plan is None:
            return {n: pool.local(n, layer) for n in names}
        if self.materializer is not None:
            self.materializer.prefetch(layer + 1)  # the next layer's history gather overlaps this layer
            return self.materializer.view(layer)
        views = {n: gather_view(pool.local(n, layer), plan.mat_plan, self.group) for n in names}
        if _env.debug_enabled():
            check_view(pool, layer, plan.mat_plan, views)
        return views

    def decode_attention(
        self,
        layer: int,
        queries: DecodeQueries,
        *,
        softmax_scale: float,
        positions: torch.Tensor | None = None,
        return_positions: bool = True,
    ) -> DecodeLayerOutput:
        """A sharded decode step's sparse attention of one layer (collective; run phase).

        Args:
            layer: the layer (its rows are written already).
            queries: absorbed-MLA queries of every request (:class:`dtkv.decode.DecodeQueries`, compute dtype
                float32 or float64).
            softmax_scale: attention logit scale.
            positions: int64 ``[N, K]`` a selection to reuse (a layer without its own indexer reuses the previous
                layer's ``positions``); ``None`` runs the layer's indexer over the ranks' own index pages.
            return_positions: list the selected positions in the result (a sort of the keys a layer); ``False``
                when nothing reads them (no later layer reuses the selection): the result's ``positions`` is then
                ``None`` (and ``-1`` padded positions are not built).

        Returns:
            :class:`dtkv.decode.DecodeLayerOutput` (merged latent output, LSE, selected positions), the same on
            every rank.
        """
        if self._sharded is None:
            raise RuntimeError("decode_attention() belongs to a sharded decode step; an extend step reads views()")
        return self._sharded.attention(layer, queries, softmax_scale=softmax_scale, positions=positions,
                                       return_positions=return_positions)  # fmt: skip

    def finish(self) -> None:
        """End of the model's forward: rows a sharded decode step still holds are written (run phase)."""
        if self._sharded is not None:
            self._sharded.flush()
