"""Gather backends of :class:`dtkv.materialize.Materializer`: how one page group of one layer reaches every rank.

=================  ==========================================================================================
backend            per (group, layer)
=================  ==========================================================================================
``local``          no CP group: the send rows are copied into the view
``all_gather``     one all-gather of every layout's send buffer (coalesced into one collective; NCCL on GPUs,
                   gloo on CPUs). The send buffer is a slice of the pool when this rank's pages already sit
                   there in send order (no pack), else one pack launch for every layout of the layer
``copy_engine``    ranks on one NVLink domain; the views live in symmetric memory (:mod:`._symm`). This rank's
                   pages go straight into its own rows of its view (a ``copy_`` per layout where the pool holds
                   them in order, else one pack launch), a device barrier (every rank has written; the reuse rule
                   of :mod:`._symm`), then ``copy_`` of each peer's own rows into the same rows here: peer reads
                   by the copy engines, no SMs taken from the layer it overlaps, and no send buffer
=================  ==========================================================================================

Both backends allocate their views once for ``capacity`` pages and serve any plan up to it
(:meth:`set_geometry`); growing past it reallocates (collectively for the copy engines).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_into, as_bytes

from ._exchange import Vote, exchange_votes
from ._symm import SymmBuffers, symm_mem_module

__all__ = ["COPY_ENGINE_MIN_BYTES", "GatherBackend", "GroupGeometry", "copy_engine_usable", "resolve_gather_backend"]

logger = logging.getLogger(__name__)

GatherBackend = Literal["auto", "all_gather", "copy_engine"]
_BACKENDS = ("auto", "all_gather", "copy_engine")

COPY_ENGINE_MIN_BYTES = 4 << 20
"""``backend="auto"`` uses the copy engines from this many view bytes per layer up (all-gather below)."""

HISTORY, CURRENT = 0, 1  # page groups; also the copy-engine signal channels


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupGeometry:
    """One non-empty page group of a plan, as this rank sends and receives it."""

    channel: int
    """``HISTORY`` (0) or ``CURRENT`` (1)."""
    rows_per_rank: int
    """Send rows of every rank (``M``)."""
    lo: int
    """First view row of the group (rank ``r``'s rows are ``[lo + r*M, lo + (r+1)*M)``)."""
    count: int
    """This rank's owned pages in the group (send rows ``[0, count)``; the rest is padding)."""
    slice_start: int | None
    """First local page of the pool run holding the send rows in order, or ``None`` (pack)."""
    send_idx: torch.Tensor
    """int64 ``[count]`` local page of each real send row, on the pool's device."""


# ------------------------------------------------------------------------------------------- selection
_CE_USABLE: dict[tuple[str, str], bool] = {}


def copy_engine_usable(group: dist.ProcessGroup, device: torch.device) -> bool:
    """True when every rank of ``group`` can read every other rank's memory with the copy engines.

    Collective over ``group`` on first use (two fixed-size CPU exchanges: host and device of each rank, then each
    rank's verdict on peer access); cached per group afterwards.
    """
    key = (group.group_name, str(device))
    if key in _CE_USABLE:
        return _CE_USABLE[key]
    local_ok = device.type == "cuda" and symm_mem_module() is not None and "nccl" in str(dist.get_backend(group))
    host = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
    index = device.index if device.index is not None else (torch.cuda.current_device() if local_ok else 0)
    me = Vote(digest=host + index.to_bytes(8, "little"), ok=local_ok)
    votes = exchange_votes(me, group)
    verdict = all(v.ok for v in votes) and all(v.digest[:8] == host for v in votes)
    if verdict:
        peers = [int.from_bytes(v.digest[8:16], "little") for v in votes]
        mine = dist.get_rank(group)
        verdict = len(set(peers)) == len(peers) and all(
            torch.cuda.can_device_access_peer(peers[mine], p) for r, p in enumerate(peers) if r != mine
        )
    usable = all(v.ok for v in exchange_votes(Vote(digest=b"", ok=verdict), group))
    _CE_USABLE[key] = usable
    return usable


def resolve_gather_backend(
    backend: str, group: dist.ProcessGroup | None, device: torch.device, view_bytes: int
) -> Literal["local", "all_gather", "copy_engine"]:
    """The backend a Materializer uses (identical on every rank when every rank passes the same arguments)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got backend={backend!r}")
    if group is None or dist.get_world_size(group) == 1:
        return "local"
    if backend == "all_gather" or (backend == "auto" and (device.type != "cuda" or view_bytes < COPY_ENGINE_MIN_BYTES)):
        return "all_gather"
    if copy_engine_usable(group, device):
        return "copy_engine"
    if backend == "copy_engine":
        warnings.warn(
            "backend='copy_engine' needs CUDA tensors, torch symmetric memory and every rank on one NVLink domain; "
            f"falling back to 'all_gather' (device {device})",
            stacklevel=3,
        )
    return "all_gather"


# ------------------------------------------------------------------------------------------- packing
def make_packer(impl: str):
    """``pack(key, dsts, srcs, idx)``: copy local pages ``idx`` of each ``srcs[k]`` into ``dsts[k]`` rows (eager).

    ``key`` names the (dsts, srcs) pair: the Triton launch's word views are built once per key (they cost more host
    time than the launch); ``pack.clear()`` forgets them when the buffers change.
    """
    if impl == "triton":
        from dtkv.ops.pack_layer_pages import _words, launch_pack

        cache: dict[object, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}

        def pack(key, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], idx: torch.Tensor) -> None:
            args = cache.get(key)
            if args is None:
                pairs = [_words(d, s) for d, s in zip(dsts, srcs)]
                args = cache[key] = ([d for d, _ in pairs], [s for _, s in pairs], srcs[0].shape[0])
            launch_pack(args[0], args[1], idx, args[2])

        pack.clear = cache.clear
        return pack

    def pack_torch(key, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], idx: torch.Tensor) -> None:
        for d, s in zip(dsts, srcs):
            torch.index_select(s, 0, idx, out=d)

    pack_torch.clear = lambda: None
    return pack_torch


def _all_gather_many(outs: list[torch.Tensor], ins: list[torch.Tensor], group, async_op: bool):
    """Rank-major all-gather of each ``ins[k]`` into ``outs[k]`` as one collective where the backend coalesces.

    Gloo never takes the coalesced path: its coalesced all-gather (a flattened copy of every input and output) has
    a history of crashing its process (pytorch/pytorch#65231, #65237: asynchronous use), and this module's
    prefetch runs it asynchronously; a CI rank died of heap corruption ("munmap_chunk(): invalid pointer",
    SIGABRT) while the other ranks waited in it. One all-gather per tensor moves the same bytes.
    """
    if len(outs) == 1:
        return all_gather_into(outs[0], ins[0], group, async_op=async_op)
    coalesced = getattr(group, "all_gather_single_coalesced", None) or getattr(  # torch 2.13 name, then 2.11
        group, "allgather_into_tensor_coalesced", None
    )
    if coalesced is not None and _coalesces(group) and _COALESCED.get(group.group_name, True):
        try:
            work = coalesced(outs, ins)
        except (RuntimeError, NotImplementedError):  # the backend does not coalesce: the same on every rank
            _COALESCED[group.group_name] = False
        else:
            if not async_op:
                work.wait()
                return None
            return work
    works = [all_gather_into(o, i, group, async_op=True) for o, i in zip(outs, ins)]
    if not async_op:
        for w in works:
            w.wait()
        return None
    return _Works(works)


_COALESCED: dict[str, bool] = {}


def _coalesces(group) -> bool:
    """Whether ``group``'s backend may take the coalesced all-gather: not gloo (see :func:`_all_gather_many`)."""
    return "gloo" not in str(dist.get_backend(group))


class _Works:
    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


# ------------------------------------------------------------------------------------------- streams
_STREAMS: dict[str, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def gather_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The (history, current) gather streams of a device, shared by every Materializer: successive gathers of one
    page group stay in stream order, which the copy-engine reuse rule relies on."""
    key = str(device)
    if key not in _STREAMS:
        _STREAMS[key] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
    return _STREAMS[key]


def _view_buffers(pool, names, capacity: int) -> list[dict[str, torch.Tensor]]:
    return [
        {n: torch.empty((capacity, *pool.layouts[n].page_shape), dtype=pool.layouts[n].dtype, device=pool.device)
         for n in names}
        for _ in range(2)
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------- backends
class AllGatherGather:
    """``local`` and ``all_gather`` backends (see the module table); private views of ``capacity`` pages."""

    def __init__(self, *, pool, names, capacity: int, group, pack: str, history_group=None) -> None:
        self.group, self.pool, self.names = group, pool, tuple(names)
        self._groups = {HISTORY: group if history_group is None else history_group, CURRENT: group}
        self._pack = make_packer(pack)
        self._srcs = [[pool.local(n, layer) for n in names] for layer in range(pool.num_layers)]
        self._cp = 1 if group is None else dist.get_world_size(group)
        self._send_bufs: dict[int, list[list[torch.Tensor]]] = {}  # [channel][parity][layout]
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """(Re)allocate the views for ``capacity`` pages (earlier views stay as they are)."""
        self.capacity = capacity
        self.views = _view_buffers(self.pool, self.names, capacity)

    def set_geometry(self, geoms: Sequence[GroupGeometry]) -> None:
        """Serve a new plan's page groups (buffers reused; send buffers reallocated where their size changes)."""
        pool, names, cp = self.pool, self.names, self._cp
        self._pack.clear()
        self._packed_rows: dict[int, list[list[torch.Tensor]]] = {}  # [channel][parity] -> per layout rows [0, count)
        self._ins: dict[int, list[list[torch.Tensor]]] = {}  # [channel][layer or parity] -> per layout bytes
        self._outs: dict[int, list[list[torch.Tensor]]] = {}  # [channel][parity] -> per layout bytes
        send_bufs = {}
        for g in geoms:
            m = g.rows_per_rank
            rows = slice(g.lo, g.lo + cp * m)
            self._outs[g.channel] = [[as_bytes(self.views[p][n][rows]) for n in names] for p in range(2)]
            if g.slice_start is not None:
                a = g.slice_start
                self._ins[g.channel] = [[as_bytes(src[a : a + m]) for src in srcs] for srcs in self._srcs]
                continue
            bufs = self._send_bufs.get(g.channel)
            if bufs is None or bufs[0][0].shape[0] != m:  # zero padding rows once; packs write rows [0, count)
                bufs = [[torch.zeros((m, *pool.layouts[n].page_shape), dtype=pool.layouts[n].dtype,
                                     device=pool.device) for n in names] for _ in range(2)]  # fmt: skip
            send_bufs[g.channel] = bufs
            self._ins[g.channel] = [[as_bytes(b) for b in parity] for parity in bufs]
            self._packed_rows[g.channel] = [[b[: g.count] for b in parity] for parity in bufs]
        self._send_bufs = send_bufs

    def scratch_bytes(self) -> int:
        bufs = [t for parity in self.views for t in parity.values()]
        bufs += [b for per_channel in self._send_bufs.values() for p in per_channel for b in p]
        return sum(b.numel() * b.element_size() for b in bufs)

    def tensors(self) -> list[torch.Tensor]:
        """Buffers the gather streams use (the caller marks them for the allocator)."""
        return [t for parity in self.views for t in parity.values()] + [
            b for per_channel in self._send_bufs.values() for p in per_channel for b in p
        ]

    def before_replay(self, g: GroupGeometry, layer: int) -> None:
        """Nothing to fence: the views' parity already orders reuse."""

    def launch(self, g: GroupGeometry, layer: int, parity: int, async_op: bool, *, captured: bool = False):
        """Gather group ``g`` of ``layer`` into the views of ``parity`` on the current stream (a work or None)."""
        outs = self._outs[g.channel][parity]
        if g.slice_start is not None:
            ins = self._ins[g.channel][layer]
        else:
            if g.count:
                self._pack((g.channel, layer, parity), self._packed_rows[g.channel][parity], self._srcs[layer],
                           g.send_idx)  # fmt: skip
            ins = self._ins[g.channel][parity]
        if self.group is None:
            for o, i in zip(outs, ins):
                o.copy_(i)
            return None
        return _all_gather_many(outs, ins, self._groups[g.channel], async_op)


def _align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


class CopyEngineGather:
    """``copy_engine`` backend (see the module table): views in symmetric memory, no send buffer."""

    def __init__(self, *, pool, names, capacity: int, group, pack: str, history_group=None) -> None:
        self.group, self.pool, self.names = group, pool, tuple(names)
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._pack = make_packer(pack)
        self._lays = [pool.layouts[n] for n in names]
        self._srcs = [[pool.local(n, layer) for n in names] for layer in range(pool.num_layers)]
        self.registry = SymmBuffers.get(group, pool.device)
        self._streams = gather_streams(pool.device) if pool.device.type == "cuda" else None
        self._finalizer = None
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Views for ``capacity`` pages in one symmetric buffer (collective: acquired from the registry)."""
        sizes = [_align(capacity * lay.page_bytes) for lay in self._lays]
        buf = self.registry.acquire(2 * sum(sizes))
        if self._finalizer is not None:
            self._finalizer()  # the outgrown buffer goes back to the registry now
        self.buf, self.capacity = buf, capacity
        self._finalizer = weakref.finalize(self, self.registry.release, buf.id)
        self.views, self._offsets, off = [], {}, 0
        for parity in range(2):
            views = {}
            for n, lay, size in zip(self.names, self._lays, sizes):
                flat = buf.tensor[off : off + capacity * lay.page_bytes]
                views[n] = flat.view(lay.dtype).view(capacity, *lay.page_shape)
                self._offsets[(parity, n)] = off
                off += size
            self.views.append(views)

    def set_geometry(self, geoms: Sequence[GroupGeometry]) -> None:
        """Serve a new plan's page groups: the peer rows each gather reads (the next write of each channel is
        fenced, see :mod:`._symm`)."""
        self.buf.fresh = [True, True]
        self._pack.clear()
        self._own: dict[tuple[int, int], list[torch.Tensor]] = {}  # (channel, parity) -> own rows per layout
        self._peers: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}  # -> (view rows, peer rows)
        self._slices: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for g in geoms:
            m = g.rows_per_rank
            for parity in range(2):
                own, peers = [], []
                for n, lay in zip(self.names, self._lays):
                    view = self.views[parity][n]
                    own.append(view[g.lo + self.rank * m : g.lo + self.rank * m + g.count])
                    for p in range(self.cp):
                        if p == self.rank:
                            continue
                        rows = as_bytes(view[g.lo + p * m : g.lo + (p + 1) * m]).view(-1)
                        off = self._offsets[(parity, n)] + (g.lo + p * m) * lay.page_bytes
                        peers.append((rows, self.buf.handle.get_buffer(p, (m * lay.page_bytes,), torch.uint8, off)))
                self._own[(g.channel, parity)] = own
                self._peers[(g.channel, parity)] = peers

    def _slice_copies(self, g: GroupGeometry, layer: int, parity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (g.channel, layer, parity)
        pairs = self._slices.get(key)
        if pairs is None:
            a = g.slice_start
            pairs = [(dst, src[a : a + g.count]) for dst, src in zip(self._own[(g.channel, parity)], self._srcs[layer])]
            self._slices[key] = pairs
        return pairs

    def scratch_bytes(self) -> int:
        """Bytes of this Materializer's symmetric buffer (both views)."""
        return self.buf.nbytes

    def tensors(self) -> list[torch.Tensor]:
        """Buffers besides the views that the gather streams use (none: the registry keeps the views alive)."""
        return []

    def _other_stream(self, channel: int):
        return None if self._streams is None else self._streams[CURRENT if channel == HISTORY else HISTORY]

    def before_replay(self, g: GroupGeometry, layer: int) -> None:
        """Before replaying a captured gather: the host side of the reuse rule (an extra barrier where needed)."""
        self.registry.before_write(self.buf, g.channel, layer % 2, self._other_stream(g.channel))

    def launch(self, g: GroupGeometry, layer: int, parity: int, async_op: bool, *, captured: bool = False):
        """Own rows, barrier, peers' rows into the views of ``parity`` (on the current stream); returns None."""
        if not captured:
            self.registry.before_write(self.buf, g.channel, parity, self._other_stream(g.channel))
        if g.count:
            if g.slice_start is not None:  # the pool holds the pages in order: copies (copy engine), no kernel
                for dst, src in self._slice_copies(g, layer, parity):
                    dst.copy_(src, non_blocking=True)
            else:
                self._pack((g.channel, layer, parity), self._own[(g.channel, parity)], self._srcs[layer], g.send_idx)
        self.registry.barrier(self.buf, g.channel)
        for dst, src in self._peers[(g.channel, parity)]:
            dst.copy_(src, non_blocking=True)
        return None
