"""Decode steps as CUDA graphs: one captured step per batch bucket, static inputs, host plans copied in, replay.

:class:`dtkv.runtime.Runtime` (``cuda_graphs=``, :func:`resolve_cuda_graphs`) hands a decode step here when the step
can be a graph (:meth:`DecodeGraphs.reason`); the model runs unchanged, over a :class:`StepContext` whose tensors are
the bucket's static buffers:

=================  ===============================================================================================
``decode_mode``    what a bucket captures (every rank runs every query; per layer, as the eager step)
=================  ===============================================================================================
``"sharded"``      the model's forward over a persistent :class:`dtkv.decode.DecodeStep` (its int32 plan: pages,
                   positions, locations, the page map; the attention backend's schedule: FlashMLA's tile-scheduler
                   metadata), the LM head; static token ids and positions
``"full"``         the model's forward over a static extend plan of one query per request (a pool every rank
                   holds whole: ``mode="single"`` or ``"replicated"``): token ids, positions, write locations, each
                   request's pages and length, from which the step's key table is built on the device (a fixed
                   stride of ``M * page_size`` entries per request); attention through the backend's *decode*
                   kernel (:meth:`dtkv.runtime.StepContext.decode_schedule`), the LM head
=================  ===============================================================================================

**Buckets.** A step of ``n`` requests runs in the bucket of ``batch_bucket(n)`` rows (1, 2, 4, 8, then multiples
of 8; the rows past ``n`` are padding: they write nothing and read one slot of page 0), sized for the longest
request's pages rounded up (:func:`page_bucket`: to 1/16 of the count), and for sharded decode the most pages a
rank holds of one request (rounded alike). A bucket is built and captured the first time a step needs it (lazily):
that step runs eagerly over the static buffers (its result is the step's; kernels compile, FlashMLA's schedule is
built, communicators start), once more on a side stream, then the capture; later steps of the bucket copy their
host plan into the buffers (one pinned copy each) and replay. A longer request than a bucket holds moves the batch
to a larger bucket (the old one of that batch size is dropped: its memory goes back to the pool); buckets share one
graph memory pool (:func:`torch.cuda.graph_pool_handle`; one step replays at a time, and every output is copied
out before the next). Once the last graph of that pool is gone (every bucket dropped), the next capture takes a new
handle: the caching allocator asserts on a capture into a pool that no graph holds any more (``use_count > 0``).
A pool whose buffers moved or changed shape (its geometry) drops every bucket: they are captured again over the new
buffers.

**A step ahead of the host.** :meth:`dtkv.runtime.Runtime.decode` does not read a graph step's tokens before it
plans the next step: the step's argmax stays on the device and becomes the next bucket's ids (a device copy after
the staged host plan), its values travel back in a pinned copy, and the requests' outputs hold placeholders until
the next replay is launched (:class:`PendingTokens`). So the host plans step ``t + 1`` while the GPU runs step
``t``; only a call's first step, an eager step and a call with a ``progress`` callback read the tokens first.

**Modes** (``cuda_graphs=``): ``True`` captures (CUDA only), ``"emulate"`` runs every step of the graph path --
buckets, padding, static buffers, host plans copied in, lazy builds, geometry checks -- eagerly instead of replaying
(every device; what the CPU tests check bitwise against the eager path), ``False`` runs the eager path.
``None`` (the default) is ``True`` on CUDA unless ``batch_invariant`` (whose products loop on the host), else
``False``.

**What runs eager instead** (:attr:`DecodeGraphs.reason` says why, logged once per reason): ``DTKV_DEBUG`` (its
checks synchronize); full-view decode over page-sharded pools at ``cp > 1`` (the view's size follows the batch);
sharded decode of index pages stored as rows, or of a model layer that reuses the previous layer's selection
(GLM-5's shared indexers: the float64 path plans on the host); an adapter's own reason
(:meth:`dtkv.runtime.ModelAdapter.graph_reason`, e.g. transformers' ``"eager"`` MoE experts, which synchronize).

**What a graph reads.** The weights, the pools and the runtime's buffers at the addresses it was captured with:
change weights in place (``copy_``), never by replacing the parameters, or build a new runtime.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from dtkv import _env
from dtkv._agree import agree
from dtkv._collectives import cpu_channel
from dtkv._util import cdiv
from dtkv.runtime._decode import GraphUnsupported, ShardedDecodeAttention, alloc_sharded_pages, step_config
from dtkv.runtime._plan import ExtendPlan, alloc_pages
from dtkv.runtime._prefix import make_room_for_decode
from dtkv.runtime._request import Request
from dtkv.runtime.context import StepContext

if TYPE_CHECKING:
    from dtkv.decode import DecodeStep

__all__ = [
    "GRAPH_MODES",
    "CudaGraphs",
    "DecodeGraphs",
    "PendingTokens",
    "batch_bucket",
    "page_bucket",
    "resolve_cuda_graphs",
]

logger = logging.getLogger(__name__)

CudaGraphs = bool | Literal["emulate"] | None
GRAPH_MODES: tuple[str, ...] = ("capture", "emulate", "off")
MAX_BUCKETS = 8
"""Buckets kept at once (least recently used dropped first)."""


def resolve_cuda_graphs(setting: object, device: torch.device, *, batch_invariant: bool) -> str:
    """``"capture"``, ``"emulate"`` or ``"off"`` for ``Runtime(cuda_graphs=setting)`` on ``device``.

    Raises:
        TypeError: ``setting`` is not a bool, ``"emulate"`` or None.
        ValueError: ``True`` on a device that is not CUDA, or with ``batch_invariant`` (naming the way out).
    """
    if setting is None:
        return "capture" if device.type == "cuda" and not batch_invariant else "off"
    if setting == "emulate" and isinstance(setting, str):
        return "emulate"
    if not isinstance(setting, bool):
        raise TypeError(f"cuda_graphs must be True, False, 'emulate' or None, got cuda_graphs={setting!r}")
    if not setting:
        return "off"
    if device.type != "cuda":
        raise ValueError(
            f"cuda_graphs=True captures CUDA graphs, but the model is on {device}: use cuda_graphs='emulate' (the "
            "graph path's buckets and static buffers, run eagerly) or False"
        )
    if batch_invariant:
        raise ValueError(
            "cuda_graphs=True cannot capture batch_invariant=True steps (their products loop on the host and read "
            "group offsets there): use one of the two"
        )
    return "capture"


def batch_bucket(n: int) -> int:
    """Rows of the bucket that takes ``n`` requests: 1, 2, 4, 8, then the next multiple of 8."""
    if n <= 8:
        return 1 << max(0, n - 1).bit_length()
    return cdiv(n, 8) * 8


def page_bucket(m: int) -> int:
    """``m`` pages rounded up to a multiple of ``2**(bit_length(m) - 5)`` (at most 1/16 more, at least 1)."""
    grain = 1 << max(0, m.bit_length() - 5)
    return cdiv(max(m, 1), grain) * grain


def _geometry(pool) -> tuple:
    return tuple(
        (name, buf.data_ptr(), tuple(buf.shape), str(buf.dtype))
        for name, buf in ((n, pool.buffer(n)) for n in sorted(pool.layouts))
    )


class DecodeGraphs:
    """The graph buckets of one runtime's decode steps (see the module docstring).

    Attributes:
        mode: ``"capture"`` or ``"emulate"``.
        reason: why the last step ran eager (``""`` when it ran in a bucket).
        stats: ``captures`` (buckets built: captured, or emulated), ``replays`` (steps a bucket ran after its
            first), ``eager_steps``
            (decode steps that ran eager instead), ``recaptures`` (buckets dropped for a pool's new geometry).
    """

    def __init__(self, runtime, mode: str) -> None:
        if mode not in ("capture", "emulate"):
            raise ValueError(f"mode must be 'capture' or 'emulate', got mode={mode!r}")
        self.rt, self.mode = runtime, mode
        self.buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self.pool_handle = None
        """The buckets' graph memory pool (:meth:`capture_pool` takes it)."""
        self.reason = ""
        self.stats = {"captures": 0, "replays": 0, "eager_steps": 0, "recaptures": 0}
        self.schedules: dict = {}
        """The attention backend's decode schedules of full-view buckets, by ``(rows, width)``."""
        self._geometry = _geometry(runtime.pool)
        self.refused = ""
        """Why the model's decode step cannot be a graph, found when a bucket first ran it (every later step runs
        eager)."""
        self._logged: set[str] = set()
        self._shape_key: tuple | None = None
        self._shape: tuple[int, int] = (0, 0)

    def capture_pool(self):
        """The memory pool handle of the next capture: the buckets' shared one while a graph holds it, else a new
        one (a handle whose last graph was destroyed is released by the allocator, and a capture into it fails
        torch's ``use_count > 0`` assert; seen on an H200 after a batch moved to a larger bucket)."""
        if not any(b._graph is not None for b in self.buckets.values()):
            self.pool_handle = torch.cuda.graph_pool_handle()
        return self.pool_handle

    # ------------------------------------------------------------------------------------------ plan
    def _static_reason(self) -> str:
        rt = self.rt
        if _env.debug_enabled():
            return "DTKV_DEBUG is on (its checks synchronize with the host)"
        if rt.decode_mode == "full" and rt.mode not in ("single", "replicated"):
            return (
                f"full-view decode over page-sharded pools (mode={rt.mode!r}) gathers a view whose size follows the "
                "batch"
            )
        if rt.decode_mode == "sharded" and not ShardedDecodeAttention.takes(rt.pool.layouts):
            return "sharded decode of index pages stored as rows runs the float64 path, planned on the host"
        hook = getattr(rt.adapter, "graph_reason", None)
        return hook(rt.decode_mode) if hook is not None else ""

    def _shapes(self, reqs: Sequence[Request]) -> tuple[int, int]:
        """``(max pages, max pages on one rank)`` of the step's requests (after its allocation), cached while the
        requests and their page counts stay."""
        key = tuple((r.rid, len(r.pages)) for r in reqs)
        if key != self._shape_key:
            width = max(len(r.pages) for r in reqs)
            per_rank = width
            own = self.rt.pool.ownership
            if self.rt.decode_mode == "sharded" and own.cp_size > 1:
                flat = torch.tensor([p for r in reqs for p in r.pages], dtype=torch.int64)
                which = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor([len(r.pages) for r in reqs]))
                counts = torch.zeros((len(reqs), own.cp_size), dtype=torch.int64)
                counts.index_put_((which, own.owner(flat)), torch.ones_like(flat), accumulate=True)
                per_rank = int(counts.max())
            self._shape_key, self._shape = key, (width, per_rank)
        return self._shape

    def reason_for(self, reqs: Sequence[Request]) -> str:
        """Why the next decode step cannot run in a bucket (``""`` when it can; host, before anything changes)."""
        return self._static_reason() or self.refused

    def allocate(self, reqs: Sequence[Request]) -> None:
        """The step's new pages, as the eager step takes them (plan phase; all or nothing)."""
        rt = self.rt
        if rt.prefix_cache is not None:
            make_room_for_decode(rt, reqs)
        if rt.decode_mode == "sharded":
            alloc_sharded_pages(reqs, allocator=rt.allocator, page_size=rt.page_size)
        else:
            alloc_pages(rt.allocator, reqs, [1] * len(reqs), rt.page_size)

    def note_eager(self, reason: str) -> None:
        """Count a decode step that runs eager, logging each reason once."""
        self.reason = reason
        self.stats["eager_steps"] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("decode steps run eager, not as CUDA graphs: %s", reason)

    # ------------------------------------------------------------------------------------------ run
    def run(self, reqs: Sequence[Request], ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's logits ``[n, V]`` from its bucket (run phase; collective like the eager step), or None when
        the model's forward refused the bucket at its first run (:class:`GraphUnsupported`: the caller runs the step
        eager, which writes its rows again).

        ``ids``: the step's token ids on the device (int64 ``[n]``, the previous step's argmax that the host has not
        read yet: :class:`PendingTokens`), copied into the bucket after its host plan; None reads them from
        ``reqs``."""
        rt = self.rt
        geometry = _geometry(rt.pool)
        if geometry != self._geometry:
            self.stats["recaptures"] += len(self.buckets)
            self.buckets.clear()
            self._geometry = geometry
        width, per_rank = self._shapes(reqs)
        key = (rt.decode_mode, batch_bucket(len(reqs)), page_bucket(width), page_bucket(per_rank))
        bucket = self.buckets.get(key)
        if bucket is None:
            for old in [k for k in self.buckets if k[:2] == key[:2]]:  # the batch moved to larger pages
                del self.buckets[old]
            while len(self.buckets) >= MAX_BUCKETS:
                self.buckets.popitem(last=False)
            cls = _ShardedBucket if rt.decode_mode == "sharded" else _FullBucket
            bucket = cls(self, batch=key[1], max_pages=key[2], scored_pages=key[3])
        self.buckets.pop(key, None)
        self.buckets[key] = bucket
        bucket.prepare(reqs)
        if ids is not None:
            bucket.ids[: len(reqs)].copy_(ids)  # stream-ordered after the staged plan it overwrites
        if bucket.ready:
            logits = bucket.replay()
            self.stats["replays"] += 1
        else:
            try:
                logits = bucket.build()
            except GraphUnsupported as e:
                self.buckets.pop(key, None)
                self.refused = f"the model's decode step holds {e} (the float64 path, planned on the host)"
                return None
            self.stats["captures"] += 1
        bucket.account(len(reqs))
        self.reason = ""
        return logits[: len(reqs)]


class PendingTokens:
    """A decode step's greedy tokens while the host has not read them: the step's argmax stays on the device (the
    next step's ids copy it there), a pinned copy travels back meanwhile, and :meth:`resolve` writes the values into
    the requests' outputs once it has arrived.

    :meth:`dtkv.runtime.Runtime.decode` appends a placeholder (``-1``) to each output when the step settles and runs
    the next step's host plan while the GPU still runs this one; the next step resolves these tokens once its own
    replay is launched, before anything reads them (its commit: the prefix cache hashes computed tokens), and the
    eager path resolves them before it reads ids from the requests.
    """

    PLACEHOLDER = -1

    def __init__(self, reqs: Sequence[Request], tokens: torch.Tensor) -> None:
        self.reqs = list(reqs)
        self.tokens = tokens
        cuda = tokens.device.type == "cuda"
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        self._host.copy_(tokens, non_blocking=cuda)
        self._event = torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()
        self._slots: list[int] = []

    def hold(self) -> None:
        """Append the placeholder to every request's output (the step settled: its tokens exist)."""
        for r in self.reqs:
            self._slots.append(len(r.output))
            r.output.append(self.PLACEHOLDER)

    def ids_for(self, reqs: Sequence[Request]) -> torch.Tensor | None:
        """The next step's ids ``[len(reqs)]`` on the device, or None when a request of it was not in this step."""
        if [r.rid for r in reqs] == [r.rid for r in self.reqs]:
            return self.tokens
        where = {r.rid: i for i, r in enumerate(self.reqs)}
        if any(r.rid not in where for r in reqs):
            return None
        index = torch.tensor([where[r.rid] for r in reqs], dtype=torch.int64, device=self.tokens.device)
        return self.tokens.index_select(0, index)

    def resolve(self) -> None:
        """Wait for the values and write them over the placeholders (idempotent)."""
        if not self._slots:
            return
        if self._event is not None:
            self._event.synchronize()
        for r, slot, t in zip(self.reqs, self._slots, self._host.tolist()):
            r.output[slot] = t
        self._slots = []


class _Bucket:
    """Static buffers and the captured (or emulated) step of one bucket."""

    def __init__(self, graphs: DecodeGraphs, *, batch: int, max_pages: int, scored_pages: int) -> None:
        self.graphs, self.rt = graphs, graphs.rt
        self.batch, self.max_pages, self.scored_pages = batch, max_pages, scored_pages
        self.num_queries = 0
        self.ready = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self.ids: torch.Tensor
        """The static token ids ``[B]``."""
        dev = self.rt.device
        self._cuda = dev.type == "cuda"
        self._copied = torch.cuda.Event() if self._cuda else None

    def _stage(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        """One copy of a host plan into its device buffer (pinned on CUDA; the previous copy has left it)."""
        dev.copy_(host, non_blocking=self._cuda)
        if self._copied is not None:
            self._copied.record()

    def _wait_staging(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def prepare(self, reqs: Sequence[Request]) -> None:
        """Copy the step's host plan into the static buffers (plan phase)."""
        raise NotImplementedError

    def forward(self) -> torch.Tensor:
        """The step over the static buffers: logits ``[B, V]`` (run phase: what a graph captures)."""
        raise NotImplementedError

    def build(self) -> torch.Tensor:
        """The bucket's first step: eager over the static buffers (its result is the step's), then (capture) a
        warm-up on a side stream and the capture. A capture that fails on any rank fails on every rank
        (:func:`dtkv._agree.agree`): the graphs refuse every later step (:attr:`DecodeGraphs.refused`) and this one
        keeps its eager result."""
        with torch.no_grad():
            logits = self.forward().clone()
            if self.graphs.mode == "capture":
                error = None
                try:
                    self._capture()
                except Exception as e:  # noqa: BLE001 - agreed with the other ranks below, then the step goes on
                    error = e
                    self._graph = self._out = None
                    torch.cuda.synchronize(self.rt.device)
                try:
                    group = self.rt.group
                    agree(error, cpu_channel(group) if group is not None else None, what="CUDA graph capture")
                except Exception as e:  # noqa: BLE001 - every rank refuses graphs from now on
                    self.graphs.refused = f"the capture failed ({type(e).__name__}: {e})"[:300]
                    return logits
        self.ready = True
        return logits

    def _capture(self) -> None:
        dev = self.rt.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self.forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graphs.capture_pool(), capture_error_mode="thread_local"):
            out = self.forward()
        self._graph, self._out = graph, out

    def replay(self) -> torch.Tensor:
        if self._graph is None:  # emulate
            with torch.no_grad():
                return self.forward().clone()
        assert self._out is not None, "a captured bucket holds its output"
        self._graph.replay()
        return self._out.clone()

    def account(self, n: int) -> None:
        """Add the step's counters to the runtime's stats."""


class _ShardedBucket(_Bucket):
    """A sharded decode bucket: the persistent :class:`dtkv.decode.DecodeStep`, static ids and positions."""

    def __init__(self, graphs: DecodeGraphs, **kw) -> None:
        super().__init__(graphs, **kw)
        b, dev = self.batch, self.rt.device
        self.topk = self.rt.model_spec.index_topk
        self._host = torch.zeros((2, b), dtype=torch.int64, pin_memory=self._cuda)
        self._dev = torch.zeros((2, b), dtype=torch.int64, device=dev)
        self.ids, self.positions = self._dev[0], self._dev[1]
        self.step: DecodeStep | None = None
        self._plan: tuple[list[list[int]], list[int]] = ([], [])
        self._keys: list[int] = []
        self._probe = {"decode_comm_bytes": 0, "topk_checks": 0}
        self._bytes_per_query = 0

    def decode_step(self, num_heads: int, softmax_scale: float, iq_fp8: bool) -> DecodeStep:
        from dtkv.decode import DecodeStep

        if self.step is None:
            rt = self.rt
            config = step_config(
                num_heads=num_heads, topk=self.topk, softmax_scale=softmax_scale, batch=self.batch,
                max_pages=self.max_pages, scored_pages=self.scored_pages, attention=rt.attention.name,
                device=rt.device, iq_fp8=iq_fp8,
            )  # fmt: skip
            self.step = DecodeStep(rt.pool, config)
            self.step.set_plan(*self._plan, keys=self._keys)
            self.step.exchange.begin_step()
        elif self.step.config.num_heads != num_heads or self.step.softmax_scale != float(softmax_scale):
            raise GraphUnsupported("layers of different head counts or softmax scales")
        return self.step

    def prepare(self, reqs: Sequence[Request]) -> None:
        self._plan = ([r.pages for r in reqs], [r.num_computed + 1 for r in reqs])
        self._keys = [r.rid for r in reqs]
        if self.step is not None:
            self.step.set_plan(*self._plan, keys=self._keys)  # rebuilds the rows whose pages changed
        self.num_queries = n = len(reqs)
        self._wait_staging()
        host = self._host.numpy()
        host[:] = 0
        host[0, :n] = [r.token(r.num_computed) for r in reqs]
        host[1, :n] = self._plan[1]
        host[1, :n] -= 1
        self._stage(self._host, self._dev)

    def forward(self) -> torch.Tensor:
        rt = self.rt
        if self.step is not None:
            self.step.exchange.begin_step()
        sharded = ShardedDecodeAttention(pool=rt.pool, spec=rt.ownership_spec, attention=rt.attention.name,
                                         stats=self._probe, bucket=self)  # fmt: skip
        ctx = rt._context(sharded=sharded, ids=self.ids)
        hidden = rt._run_model(ctx)
        ctx.finish()
        return rt._logits(hidden)

    def build(self) -> torch.Tensor:
        before = self._probe["decode_comm_bytes"]
        logits = super().build()
        runs = 3 if self.graphs.mode == "capture" else 1
        per_step = (self._probe["decode_comm_bytes"] - before) // runs
        self._bytes_per_query = per_step // max(1, self.num_queries)
        return logits

    def account(self, n: int) -> None:
        stats = self.rt.stats
        stats["sharded_decode_steps"] += 1
        stats["decode_comm_bytes"] += self._bytes_per_query * n


class _FullBucket(_Bucket):
    """A full-view decode bucket over a pool every rank holds whole: a static extend plan of one query a request."""

    def __init__(self, graphs: DecodeGraphs, **kw) -> None:
        super().__init__(graphs, **kw)
        rt, b, m = self.rt, self.batch, self.max_pages
        dev, ps = rt.device, rt.page_size
        self.stride = c = m * ps
        # one int64 buffer: ids, positions, write locations, lengths [4, B], then the page table [B, M]
        self._host = torch.zeros((4 * b + b * m,), dtype=torch.int64, pin_memory=self._cuda)
        self._dev = torch.zeros_like(self._host, device=dev)
        ids, pos, locs, lens = self._dev[: 4 * b].view(4, b)
        self.ids, self.lens, self.table = ids, lens, self._dev[4 * b :].view(b, m)
        rows = torch.arange(b, dtype=torch.int64, device=dev)
        self._col = torch.arange(c, dtype=torch.int64, device=dev)
        self._page_of_col = (self._col // ps).expand(b, c)
        self._key_slots = torch.full((b * c,), -1, dtype=torch.int64, device=dev)
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        # each row's key-table range [i * C, i * C + its length): the end is set on the device in forward
        self._key_start = rows * c
        self._key_end = self._key_start + 1
        self.plan = ExtendPlan(
            num_reqs=b, extend_lens=(1,) * b, ids=ids, positions=pos, req_idx=rows, locs=locs, locs_gathered=locs,
            max_local=b, direct_rows=empty, handoff_rows=empty, handoff_locs_gathered=empty, max_handoff=0,
            groups=tuple((i, i, i + 1, c) for i in range(b)), key_indptr=tuple(i * c for i in range(b + 1)),
            key_locs=self._key_slots, key_req=rows.repeat_interleave(c), key_pos=self._col.repeat(b),
            key_slots=self._key_slots, key_start=self._key_start, key_end=self._key_end, mat_plan=None,
            restore_rows=rows, last_rows=rows, page_aligned=False, key_stride=c,
        )  # fmt: skip
        self._rows: list[object] = ["unset"] * b

    def prepare(self, reqs: Sequence[Request]) -> None:
        b, m, ps = self.batch, self.max_pages, self.rt.page_size
        self.num_queries = n = len(reqs)
        self._wait_staging()
        host = self._host.numpy()
        head = host[: 4 * b].reshape(4, b)
        head[0, :] = 0
        head[1, :] = 0
        head[2, :] = -1
        head[3, :] = 1  # padding rows: one key, slot 0 of page 0 (read, never written)
        pos = [r.num_computed for r in reqs]
        head[0, :n] = [r.token(p) for r, p in zip(reqs, pos)]
        head[1, :n] = pos
        head[2, :n] = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, pos)]
        head[3, :n] = pos
        head[3, :n] += 1
        table = host[4 * b :].reshape(b, m)
        for i in range(b):  # rows whose request or pages changed (a page every page_size steps)
            r = reqs[i] if i < n else None
            ident = None if r is None else (r.rid, len(r.pages), r.pages[-1])
            if self._rows[i] != ident:
                table[i] = -1
                if r is None:
                    table[i, 0] = 0
                else:
                    table[i, : len(r.pages)] = r.pages
                self._rows[i] = ident
        self._stage(self._host, self._dev)

    def forward(self) -> torch.Tensor:
        rt, ps = self.rt, self.rt.page_size
        # the key table on the device: request i's entries [i * C, (i + 1) * C), positions 0.. its length - 1
        page = self.table.gather(1, self._page_of_col)
        valid = (self._col[None, :] < self.lens[:, None]) & (page >= 0)
        slots = torch.where(valid, page * ps + self._col % ps, torch.full_like(page, -1))
        self._key_slots.copy_(slots.view(-1))
        torch.add(self._key_start, self.lens, out=self._key_end)
        ctx = StepContext(pool=rt.pool, mode="single", group=None, ownership=rt.ownership, spec=rt.ownership_spec,
                          attention=rt.attention, plan=self.plan, decoding=True,
                          schedules=self.graphs.schedules)  # fmt: skip
        hidden = rt._run_model(ctx)
        return rt._logits(hidden)

    def account(self, n: int) -> None:
        self.rt.stats["steps"] += 1
