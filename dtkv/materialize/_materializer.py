"""The eager :class:`Materializer`: static buffers, layer-ahead prefetch, a gather backend, optional CUDA graphs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv import _env
from dtkv.layouts import total_page_bytes
from dtkv.ops._common import resolve_backend

from ._gather import (
    CURRENT,
    HISTORY,
    AllGatherGather,
    CopyEngineGather,
    GatherBackend,
    GroupGeometry,
    gather_streams,
    resolve_gather_backend,
)
from ._plan import MaterializePlan, agree_plan
from ._views import check_view

__all__ = ["Materializer"]


def _geometry(plan: MaterializePlan, device: torch.device) -> list[GroupGeometry]:
    geoms = []
    lo = 0
    groups = ((HISTORY, plan.history, plan.history_slice), (CURRENT, plan.current, plan.current_slice))
    for channel, gp, start in groups:
        rows = gp.num_gathered_rows // plan.ownership.cp_size
        if rows:
            count = gp.counts[plan.rank]
            idx = gp.send_local_idx[plan.rank, :count].to(device=device, dtype=torch.int64).contiguous()
            geoms.append(GroupGeometry(channel=channel, rows_per_rank=rows, lo=lo, count=count, slice_start=start,
                                       send_idx=idx))  # fmt: skip
        lo += gp.num_gathered_rows
    return geoms


class Materializer:
    """Eager per-layer full views with layer-ahead history prefetch into preallocated double buffers.

    Call ``prefetch(layer + 1)`` before computing ``layer``; ``view(layer)`` (after the layer's writes) waits
    for the history gather, gathers the current pages and returns the views. Per layer and page group the host
    issues at most one pack launch (none where the pool's pages already sit in send order) and one collective
    (all-gather backend) or one barrier and a ``copy_`` per peer and layout (copy-engine backend), and nothing for
    an empty group. On CUDA the gathers run on dedicated streams shared by every Materializer of the device, and
    :meth:`capture` can record every gather into CUDA graphs.

    Build one Materializer per CP group and pool and :meth:`replan` it for each batch (the way a serving loop
    reuses an attention wrapper's workspace): the views are allocated once, for ``max_view_pages`` pages, and
    nothing is allocated, rendezvoused or synchronized per batch. Constructing one per batch works too.

    A view is a slice of one of two buffers (by layer parity) that the Materializer keeps: it holds ``layer``'s rows
    until ``prefetch(layer + 2)`` (or ``view(layer + 2)``) starts gathering into the same buffer -- work queued
    before that call still reads it (on CUDA the gather streams wait for the compute stream) -- or until
    :meth:`replan`, after which the same memory serves the new plan. Prefetching a layer while another layer of the
    same parity is still pending raises. Rows of a view that no page maps to are unspecified (zeros or other pages'
    bytes).

    Args:
        pool: a :class:`dtkv.ShardedKVPool`.
        plan: from :func:`plan_materialize` with ``pool.ownership`` and ``pool.rank``. A plan not yet checked
            across the CP group is checked here (collective: every rank constructs its Materializer).
        names: layouts to materialize (default: all).
        backend: ``"auto"`` (copy engines for views of at least
            :data:`~dtkv.materialize.COPY_ENGINE_MIN_BYTES` per layer when every rank shares one NVLink domain,
            else all-gather), ``"all_gather"`` or ``"copy_engine"`` (falls back to ``"all_gather"`` with a
            warning where symmetric memory is unavailable). Every rank must pass the same value. The backend in
            use is :attr:`backend`: ``"local"`` without a CP group; it is chosen once, for ``max_view_pages``.
        pack: kernel of the pack launches, ``"auto"`` | ``"torch"`` (``index_select`` per layout) |
            ``"triton"`` (one launch for every layout; the default on CUDA).
        history_group: a process group over the same ranks for the history all-gathers (default: the pool's).
            A dedicated communicator keeps prefetches off the queue of the model's own collectives (NCCL runs
            a communicator's collectives in issue order); build it once, e.g. with ``dist.new_group``.
        max_view_pages: view pages to allocate for (default and minimum: ``plan.num_view_pages``), so that
            :meth:`replan` to larger batches allocates nothing. Every rank must pass the same value.

    Scratch (:meth:`scratch_bytes`): the two views, plus, for the all-gather backend where a rank's pages are not
    in send order, two send buffers of ``1 / cp`` view each. The copy-engine views live in symmetric memory and
    each rank writes its pages straight into its own rows of them (no send buffer).
    """

    def __init__(
        self,
        pool,
        plan: MaterializePlan,
        *,
        names: Sequence[str] | None = None,
        backend: GatherBackend = "auto",
        pack: str = "auto",
        history_group=None,
        max_view_pages: int | None = None,
    ) -> None:
        self._check_plan(pool, plan)
        self.names = tuple(sorted(pool.layouts) if names is None else names)
        unknown = [n for n in self.names if n not in pool.layouts]
        if unknown or not self.names:
            raise ValueError(f"names must be a non-empty subset of {sorted(pool.layouts)}, got names={names!r}")
        if max_view_pages is not None and (
            isinstance(max_view_pages, bool) or not isinstance(max_view_pages, int) or max_view_pages < 0
        ):
            raise ValueError(f"max_view_pages must be an int >= 0 or None, got max_view_pages={max_view_pages!r}")
        if history_group is not None:
            import torch.distributed as dist

            if pool.group is None or dist.get_world_size(history_group) != dist.get_world_size(pool.group):
                raise ValueError(
                    "history_group must span the pool's CP group, got a group of "
                    f"{dist.get_world_size(history_group)} ranks for a pool with group={pool.group!r}"
                )
        agree_plan(plan, pool.group)
        self.pool = pool
        self._history_group = history_group
        dev = pool.device
        capacity = max(plan.num_view_pages, max_view_pages or 0)
        self._page_bytes = total_page_bytes(pool.layouts[n] for n in self.names)
        self.backend = resolve_gather_backend(backend, pool.group, dev, capacity * self._page_bytes)
        """The backend in use: ``"local"``, ``"all_gather"`` or ``"copy_engine"``."""
        impl = CopyEngineGather if self.backend == "copy_engine" else AllGatherGather
        self._impl = impl(
            pool=pool, names=self.names, capacity=capacity, group=pool.group, pack=resolve_backend(pack, dev),
            history_group=history_group,
        )  # fmt: skip
        self._cuda = dev.type == "cuda"
        self._hist_stream, self._cur_stream = gather_streams(dev) if self._cuda else (None, None)
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else None
        self._pending: dict[int, object] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] | None = None
        self._set_plan(plan)

    @staticmethod
    def _check_plan(pool, plan: MaterializePlan) -> None:
        if plan.ownership != pool.ownership or plan.rank != pool.rank:
            raise ValueError(
                f"plan was built for {plan.ownership!r} rank {plan.rank}, "
                f"but pool has {pool.ownership!r} rank {pool.rank}"
            )

    def _set_plan(self, plan: MaterializePlan) -> None:
        if plan.num_view_pages > self._impl.capacity:  # collective for the copy engines (plans agree on the size)
            self._impl.grow(plan.num_view_pages)
        self.plan = plan
        self._geoms = _geometry(plan, self.pool.device)
        self._history = next((g for g in self._geoms if g.channel == HISTORY), None)
        self._current = next((g for g in self._geoms if g.channel == CURRENT), None)
        self._impl.set_geometry(self._geoms)
        k = plan.num_view_pages
        self._views = [{n: v[:k] for n, v in parity.items()} for parity in self._impl.views]
        if self._cuda:  # buffers are used on the gather streams: the allocator must not reuse them early
            used = self._impl.tensors() + [g.send_idx for g in self._geoms]
            for t in (t for t in used if t.numel()):
                t.record_stream(self._hist_stream)
                t.record_stream(self._cur_stream)

    def replan(self, plan: MaterializePlan) -> None:
        """Serve another batch (plan phase: host work, no device synchronization): the views and, for the copy
        engines, the symmetric buffer are reused; they grow (collectively) only past their capacity.

        Views returned before alias the buffers the new plan gathers into (unless the buffers grew): read none of
        them after a replan. Captured graphs are dropped (call :meth:`capture` again). A plan not yet checked across
        the CP group is checked here (collective).

        Raises:
            ValueError: the plan was built for another ownership or rank.
            RuntimeError: a gather is in flight (view every prefetched layer first).
        """
        self._check_plan(self.pool, plan)
        if self._pending:
            raise RuntimeError(f"replan() needs no gather in flight, got layers {sorted(self._pending)} pending")
        agree_plan(plan, self.pool.group)
        self._graphs = None
        self._set_plan(plan)

    @property
    def capacity_pages(self) -> int:
        """View pages the buffers hold (plans up to this size need no allocation)."""
        return self._impl.capacity

    # ------------------------------------------------------------------------------------------ run
    def scratch_bytes(self) -> int:
        """Bytes of materialization scratch on this rank: the double-buffered views (at capacity) plus the
        all-gather backend's send buffers (none where the pool stands in for them; none on the copy engines)."""
        return self._impl.scratch_bytes()

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.pool.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.pool.num_layers}), got layer={layer!r}")

    def _launch(self, g: GroupGeometry, layer: int, async_op: bool):
        if self._graphs is not None:
            self._impl.before_replay(g, layer)
            self._graphs[(g.channel, layer)].replay()
            return None
        return self._impl.launch(g, layer, layer % 2, async_op)

    def prefetch(self, layer: int) -> None:
        """Start gathering ``layer``'s history pages (returns before the gather completes).

        Layers outside ``[0, num_layers)`` and layers already in flight are ignored, so ``prefetch(layer + 1)``
        is safe on the last layer.
        """
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.pool.num_layers:
            return
        if layer in self._pending:
            return
        clash = [q for q in self._pending if q % 2 == layer % 2]
        if clash:
            raise RuntimeError(
                f"prefetch(layer={layer}) would overwrite the view buffers of layer {clash[0]}, which was prefetched "
                "but not viewed: views are double-buffered by layer parity"
            )
        g = self._history
        if g is None:
            self._pending[layer] = None
        elif self._cuda:
            main = torch.cuda.current_stream(self.pool.device)
            stream = self._hist_stream
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                work = self._launch(g, layer, True)
                if work is not None:
                    work.wait()  # the gather stream waits for the collective (no host wait)
                event = self._events[layer % 2]  # re-recorded only after view() of its last layer waited on it
                event.record(stream)
            self._pending[layer] = event
        else:
            self._pending[layer] = self._launch(g, layer, True)

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s views (name -> ``[num_view_pages, *page_shape]``); call after the layer's writes."""
        self._check_layer(layer)
        self.prefetch(layer)
        pending = self._pending.pop(layer)
        if self._cuda:
            main = torch.cuda.current_stream(self.pool.device)
            if pending is not None:
                main.wait_event(pending)
            if self._current is not None:
                stream = self._cur_stream
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    work = self._launch(self._current, layer, False)
                main.wait_stream(stream)
                del work
        else:
            if pending is not None:
                pending.wait()
            if self._current is not None:
                self._launch(self._current, layer, False)
        views = dict(self._views[layer % 2])
        if _env.debug_enabled():
            written = self.plan.write_pages
            pages = self.plan.pages[~torch.isin(self.plan.pages, written)] if written.numel() else None
            check_view(self.pool, layer, self.plan, views, pages=pages)
        return views

    def check(self, layer: int) -> None:
        """Synchronizing check of every row of ``layer``'s views against the owners' bytes (collective).

        For plans with ``write_current=True``: call it after writing the step's rows into the views (``view()``
        under ``DTKV_DEBUG`` checks only the pages it gathered).

        Raises:
            MaterializeError: naming the first row that differs.
        """
        self._check_layer(layer)
        check_view(self.pool, layer, self.plan, self._views[layer % 2])

    # ------------------------------------------------------------------------------------------ graphs
    def capture(self) -> None:
        """Record every layer's gathers (per page group) into CUDA graphs for the current plan; collective.

        Afterwards :meth:`prefetch` and :meth:`view` replay one graph per layer and group instead of issuing
        launches (a static plan into static buffers: the host cost of a view becomes one or two graph
        launches). One eager pass over every layer runs first (communicators, kernels and handles must exist
        before capture). Call it on every rank, with no gather in flight; :meth:`replan` drops the graphs.

        With the ``all_gather`` backend the history gathers need their own communicator (``history_group``):
        replayed NCCL kernels bypass the process group's internal stream, so they must not share a communicator
        with collectives that may run at the same time (the current-page gathers and the model's own collectives
        stay ordered with the compute stream).

        Raises:
            RuntimeError: the pool is not on a CUDA device, a gather is in flight, or the ``all_gather`` backend
                has no dedicated ``history_group``.
        """
        if not self._cuda:
            raise RuntimeError(f"capture() records CUDA graphs; this pool is on {self.pool.device}")
        if self.backend == "all_gather" and self._history is not None and self._history_group is None:
            raise RuntimeError(
                "capture() with the all_gather backend needs a dedicated history_group (a communicator used by "
                "nothing else while a prefetch may run); pass history_group= to the Materializer"
            )
        if self._pending:
            raise RuntimeError(f"capture() needs no gather in flight, got layers {sorted(self._pending)} pending")
        if self._graphs is not None:
            return
        num_layers = self.pool.num_layers
        for layer in range(num_layers):
            self.prefetch(layer)
            self.view(layer)
        torch.cuda.synchronize(self.pool.device)
        graphs = {}
        for layer in range(num_layers):
            for g in self._geoms:
                graph = torch.cuda.CUDAGraph()
                stream = self._hist_stream if g.channel == HISTORY else self._cur_stream
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    self._impl.launch(g, layer, layer % 2, False, captured=True)
                graphs[(g.channel, layer)] = graph
        torch.cuda.synchronize(self.pool.device)
        self._graphs = graphs

    @property
    def captured(self) -> bool:
        """True after :meth:`capture`."""
        return self._graphs is not None
