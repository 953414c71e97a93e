"""The eager :class:`Materializer`: static buffers, layer-ahead prefetch, a gather backend, optional CUDA graphs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtkv import _env
from dtkv.ops._common import resolve_backend

from ._gather import (
    CURRENT,
    HISTORY,
    AllGatherGather,
    CopyEngineGather,
    GatherBackend,
    GroupGeometry,
    resolve_gather_backend,
)
from ._plan import MaterializePlan, agree_plan
from ._views import check_view

__all__ = ["Materializer"]

_STREAMS: dict[str, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The (history, current) gather streams of a device, shared by every Materializer: successive gathers of
    one page group stay in stream order, which the copy-engine slot reuse relies on."""
    key = str(device)
    if key not in _STREAMS:
        _STREAMS[key] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
    return _STREAMS[key]


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
    issues at most one pack launch (none where the pool's pages already sit in send order) and one collective,
    and nothing for an empty group. On CUDA the history gathers run on a dedicated stream shared by every
    Materializer of the device, and :meth:`capture` can record every gather into CUDA graphs.

    A view stays valid until the view of ``layer + 2`` (same buffer parity) is gathered; prefetching a layer
    while another layer of the same parity is still pending raises. Rows of a view that no page maps to are
    unspecified (zeros or other pages' bytes).

    Args:
        pool: a :class:`dtkv.ShardedKVPool`.
        plan: from :func:`plan_materialize` with ``pool.ownership`` and ``pool.rank``. A plan not yet checked
            across the CP group is checked here (collective: every rank constructs its Materializer).
        names: layouts to materialize (default: all).
        backend: ``"auto"`` (copy engines for views of at least
            :data:`~dtkv.materialize.COPY_ENGINE_MIN_BYTES` per layer when every rank shares one NVLink domain,
            else all-gather), ``"all_gather"`` or ``"copy_engine"`` (falls back to ``"all_gather"`` with a
            warning where symmetric memory is unavailable). Every rank must pass the same value. The backend in
            use is :attr:`backend`: ``"local"`` without a CP group.
        pack: kernel of the pack launches, ``"auto"`` | ``"torch"`` (``index_select`` per layout) |
            ``"triton"`` (one launch for every layout; the default on CUDA).
        history_group: a process group over the same ranks for the history all-gathers (default: the pool's).
            A dedicated communicator keeps prefetches off the queue of the model's own collectives (NCCL runs
            a communicator's collectives in issue order); build it once, e.g. with ``dist.new_group``.
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
    ) -> None:
        if plan.ownership != pool.ownership or plan.rank != pool.rank:
            raise ValueError(
                f"plan was built for {plan.ownership!r} rank {plan.rank}, "
                f"but pool has {pool.ownership!r} rank {pool.rank}"
            )
        self.names = tuple(sorted(pool.layouts) if names is None else names)
        unknown = [n for n in self.names if n not in pool.layouts]
        if unknown or not self.names:
            raise ValueError(f"names must be a non-empty subset of {sorted(pool.layouts)}, got names={names!r}")
        if history_group is not None:
            import torch.distributed as dist

            if pool.group is None or dist.get_world_size(history_group) != dist.get_world_size(pool.group):
                raise ValueError(
                    "history_group must span the pool's CP group, got a group of "
                    f"{dist.get_world_size(history_group)} ranks for a pool with group={pool.group!r}"
                )
        agree_plan(plan, pool.group)
        self.pool, self.plan = pool, plan
        self._history_group = history_group
        dev = pool.device
        self._views = [
            {
                n: torch.empty(
                    (plan.num_view_pages, *pool.layouts[n].page_shape), dtype=pool.layouts[n].dtype, device=dev
                )
                for n in self.names
            }
            for _ in range(2)
        ]
        self._geoms = _geometry(plan, dev)
        self._history = next((g for g in self._geoms if g.channel == HISTORY), None)
        self._current = next((g for g in self._geoms if g.channel == CURRENT), None)
        view_bytes = plan.num_view_pages * sum(pool.layouts[n].page_bytes for n in self.names)
        self.backend = resolve_gather_backend(backend, pool.group, dev, view_bytes)
        """The backend in use: ``"local"``, ``"all_gather"`` or ``"copy_engine"``."""
        impl = CopyEngineGather if self.backend == "copy_engine" else AllGatherGather
        self._impl = impl(
            pool=pool, names=self.names, geoms=self._geoms, views=self._views, group=pool.group,
            pack=resolve_backend(pack, dev), history_group=history_group,
        )  # fmt: skip
        self._cuda = dev.type == "cuda"
        self._hist_stream, self._cur_stream = _streams(dev) if self._cuda else (None, None)
        if self._cuda:  # buffers are used on the gather streams: the allocator must not reuse them early
            used = [t for parity in self._views for t in parity.values()] + self._impl.tensors()
            used += [g.send_idx for g in self._geoms]
            for t in (t for t in used if t.numel()):
                t.record_stream(self._hist_stream)
                t.record_stream(self._cur_stream)
        self._pending: dict[int, object] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] | None = None

    # ------------------------------------------------------------------------------------------ run
    def scratch_bytes(self) -> int:
        """Bytes of materialization scratch on this rank: the double-buffered views plus the send buffers
        (none where the pool stands in for them; the Materializer's share of the symmetric send slots)."""
        views = sum(t.numel() * t.element_size() for buf in self._views for t in buf.values())
        return views + self._impl.scratch_bytes()

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
                event = torch.cuda.Event()
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
        """Record every layer's gathers (pack + collective, per page group) into CUDA graphs; collective.

        Afterwards :meth:`prefetch` and :meth:`view` replay one graph per layer and group instead of issuing
        launches (a static plan into static buffers: the host cost of a view becomes one or two graph
        launches). One eager pass over every layer runs first (communicators, kernels and handles must exist
        before capture). Call it on every rank, with no gather in flight.

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
        self._impl.prepare_capture(num_layers)
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
