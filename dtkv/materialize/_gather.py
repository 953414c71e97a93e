"""Gather backends of :class:`dtkv.materialize.Materializer`: how one page group of one layer reaches every rank.

=================  ==========================================================================================
backend            per (group, layer)
=================  ==========================================================================================
``local``          no CP group: the send rows are copied into the view
``all_gather``     one all-gather of every layout's send buffer (coalesced into one collective; NCCL on GPUs,
                   gloo on CPUs). The send buffer is a slice of the pool when this rank's pages already sit
                   there in send order (no pack), else one pack launch for every layout of the layer
``copy_engine``    ranks on one NVLink domain: pack into a symmetric-memory send slot (one launch), a device
                   barrier through the symmetric-memory handle (every rank has packed; every rank has finished
                   reading the slot's previous contents), then ``copy_`` from each peer's slot into the view:
                   peer reads by the copy engines, no SMs taken from the layer it overlaps
=================  ==========================================================================================

Copy-engine send slots live in one symmetric workspace per (group, device), shared by every Materializer: two
slots per page group used alternately (three when an odd number of layers is captured into CUDA graphs), so a
slot is rewritten only after a later barrier proved every peer done with it (a gather's pack follows the previous
gather's barrier, which every peer reaches only after finishing its copies of the gather before). Growing the
workspace synchronizes the device and the ranks once; outgrown buffers stay mapped for graphs recorded on them.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_into, as_bytes

from ._exchange import Vote, exchange_votes

__all__ = ["COPY_ENGINE_MIN_BYTES", "GatherBackend", "GroupGeometry", "copy_engine_usable", "resolve_gather_backend"]

logger = logging.getLogger(__name__)

GatherBackend = Literal["auto", "all_gather", "copy_engine"]
_BACKENDS = ("auto", "all_gather", "copy_engine")

COPY_ENGINE_MIN_BYTES = 4 << 20
"""``backend="auto"`` uses the copy engines from this many view bytes per layer up (all-gather below)."""

BARRIER_TIMEOUT_MS = 300_000
"""Deadline of a copy-engine barrier; past it the device traps (the process fails rather than hangs)."""

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


def _symm_mem():
    """The symmetric-memory module when this torch build offers what the copy-engine path uses, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    if not all(hasattr(symm_mem, n) for n in ("empty", "rendezvous")):
        return None
    handle_type = getattr(symm_mem, "_SymmetricMemory", None)
    if handle_type is None or not all(hasattr(handle_type, n) for n in ("get_buffer", "barrier")):
        return None
    return symm_mem


def copy_engine_usable(group: dist.ProcessGroup, device: torch.device) -> bool:
    """True when every rank of ``group`` can read every other rank's memory with the copy engines.

    Collective over ``group`` on first use (two fixed-size CPU exchanges: host and device of each rank, then each
    rank's verdict on peer access); cached per group afterwards.
    """
    key = (group.group_name, str(device))
    if key in _CE_USABLE:
        return _CE_USABLE[key]
    local_ok = device.type == "cuda" and _symm_mem() is not None and "nccl" in str(dist.get_backend(group))
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
    if device.type == "cuda" and copy_engine_usable(group, device):
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
    """``pack(dsts, srcs, idx)``: copy local pages ``idx`` of each ``srcs[k]`` into ``dsts[k]`` rows (eager)."""
    if impl == "triton":
        from dtkv.ops.pack_layer_pages import _words, launch_pack

        def pack(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], idx: torch.Tensor) -> None:
            pairs = [_words(d, s) for d, s in zip(dsts, srcs)]
            launch_pack([d for d, _ in pairs], [s for _, s in pairs], idx, srcs[0].shape[0])

        return pack

    def pack_torch(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], idx: torch.Tensor) -> None:
        for d, s in zip(dsts, srcs):
            torch.index_select(s, 0, idx, out=d)

    return pack_torch


def _all_gather_many(outs: list[torch.Tensor], ins: list[torch.Tensor], group, async_op: bool):
    """Rank-major all-gather of each ``ins[k]`` into ``outs[k]`` as one collective where the backend coalesces."""
    if len(outs) == 1:
        return all_gather_into(outs[0], ins[0], group, async_op=async_op)
    coalesced = getattr(group, "all_gather_single_coalesced", None) or getattr(  # torch 2.13 name, then 2.11
        group, "allgather_into_tensor_coalesced", None
    )
    if coalesced is not None and _COALESCED.get(group.group_name, True):
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


class _Works:
    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


# ------------------------------------------------------------------------------------------- backends
class AllGatherGather:
    """``local`` and ``all_gather`` backends (see the module table)."""

    def __init__(self, *, pool, names, geoms, views, group, pack: str, history_group=None) -> None:
        self.group = group
        self._groups = {HISTORY: group if history_group is None else history_group, CURRENT: group}
        self._pack = make_packer(pack)
        self._send_bufs: dict[int, list[list[torch.Tensor]]] = {}
        self._ins: dict[int, list[list[torch.Tensor]]] = {}  # [channel][layer] -> per layout bytes
        self._outs: dict[int, list[list[torch.Tensor]]] = {}  # [channel][parity] -> per layout bytes
        self._srcs = [[pool.local(n, layer) for n in names] for layer in range(pool.num_layers)]
        cp = 1 if group is None else dist.get_world_size(group)
        for g in geoms:
            m = g.rows_per_rank
            self._outs[g.channel] = [
                [as_bytes(views[p][n][g.lo : g.lo + cp * m]) for n in names] for p in range(2)
            ]  # fmt: skip
            if g.slice_start is not None:
                a = g.slice_start
                self._ins[g.channel] = [[as_bytes(src[a : a + m]) for src in srcs] for srcs in self._srcs]
            else:  # zero padding rows once; packs write rows [0, count)
                bufs = [[torch.zeros((m, *pool.layouts[n].page_shape), dtype=pool.layouts[n].dtype,
                                     device=pool.device) for n in names] for _ in range(2)]  # fmt: skip
                self._send_bufs[g.channel] = bufs
                self._ins[g.channel] = [[as_bytes(b) for b in parity] for parity in bufs]

    def scratch_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self._send_bufs.values() for p in bufs for b in p)

    def tensors(self) -> list[torch.Tensor]:
        """Buffers the gather streams use (the caller marks them for the allocator)."""
        return [b for bufs in self._send_bufs.values() for p in bufs for b in p]

    def prepare_capture(self, num_layers: int) -> None:
        """Nothing to fix before capture: send buffers alternate with the view parity."""

    def before_replay(self, g: GroupGeometry, layer: int) -> None:
        """Nothing to fence: the views' parity already orders reuse."""

    def launch(self, g: GroupGeometry, layer: int, parity: int, async_op: bool, *, captured: bool = False):
        """Gather group ``g`` of ``layer`` into the views of ``parity`` on the current stream (a work or None)."""
        outs = self._outs[g.channel][parity]
        if g.slice_start is not None:
            ins = self._ins[g.channel][layer]
        else:
            bufs = self._send_bufs[g.channel][parity]
            if g.count:
                self._pack([b[: g.count] for b in bufs], self._srcs[layer], g.send_idx)
            ins = self._ins[g.channel][parity]
        if self.group is None:
            for o, i in zip(outs, ins):
                o.copy_(i)
            return None
        return _all_gather_many(outs, ins, self._groups[g.channel], async_op)


class _Workspace:
    """The symmetric send slots of one (group, device), shared by every Materializer (see the module docstring)."""

    _cache: dict[tuple[str, str], _Workspace] = {}

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.slot_bytes = [0, 0]  # per channel
        self.num_slots = 2
        self.tensor: torch.Tensor | None = None
        self.handle = None
        self.generation = 0
        self.last_slot: dict[int, list[int]] = {}  # per generation: the slot each channel's last gather used
        self._retired: list[tuple[torch.Tensor, object]] = []  # outgrown buffers: captured graphs may read them

    @classmethod
    def get(cls, group: dist.ProcessGroup, device: torch.device) -> _Workspace:
        key = (group.group_name, str(device))
        if key not in cls._cache:
            cls._cache[key] = cls(group, device)
        return cls._cache[key]

    def offset(self, channel: int, slot: int) -> int:
        return self.num_slots * self.slot_bytes[0] * channel + slot * self.slot_bytes[channel]

    def reserve(self, slot_bytes: Sequence[int], num_slots: int = 2) -> None:
        """Make room for ``slot_bytes[channel]`` per slot and ``num_slots`` slots (collective when it grows)."""
        want = [max(a, b) for a, b in zip(self.slot_bytes, slot_bytes)]
        slots = max(self.num_slots, num_slots)
        if self.tensor is not None and want == self.slot_bytes and slots == self.num_slots:
            return
        if self.tensor is not None:  # grow by at least half, so chunked prefill does not regrow every step
            want = [max(w, s + s // 2) if w > s else s for w, s in zip(want, self.slot_bytes)]
            torch.cuda.synchronize(self.device)  # the new slots start empty: no copy may still be in flight ...
            exchange_votes(Vote(digest=b"", ok=True), self.group)  # ... on any rank
            self._retired.append((self.tensor, self.handle))
        symm_mem = _symm_mem()
        total = max(1, slots * sum(want))
        tensor = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        try:
            handle = symm_mem.rendezvous(tensor, self.group.group_name)
        except RuntimeError:  # torch builds that still need the group registered first
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
            handle = symm_mem.rendezvous(tensor, self.group.group_name)
        self.tensor, self.handle = tensor, handle
        self.slot_bytes, self.num_slots = want, slots
        self.generation += 1
        self.last_slot[self.generation] = [-1, -1]
        logger.debug("copy-engine workspace of %s: %d bytes (%s per slot)", self.group.group_name, total, want)


def graph_slots(num_layers: int) -> list[int]:
    """Send slot of each layer's captured gather: neighbours differ, also across the wrap from the last layer to the
    first (replays repeat the cycle), with a third slot closing an odd cycle. One layer keeps slot 0 and is
    fenced by :meth:`CopyEngineGather.before_replay`."""
    slots = [layer % 2 for layer in range(num_layers)]
    if num_layers % 2 and num_layers > 1:
        slots[-1] = 2
    return slots


def next_slot(last: int) -> int:
    """Slot of an eager gather: never the slot of the gather before it (``last``, ``-1`` for none)."""
    return 1 if last == 0 else 0


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


class CopyEngineGather:
    """``copy_engine`` backend (see the module table)."""

    def __init__(self, *, pool, names, geoms, views, group, pack: str, history_group=None) -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._pack = make_packer(pack)
        self._srcs = [[pool.local(n, layer) for n in names] for layer in range(pool.num_layers)]
        self._lays = [pool.layouts[n] for n in names]
        self._geoms = list(geoms)
        # view rows of each peer, per (channel, parity, layout, peer), as flat bytes
        self._outs = {
            (g.channel, parity): [
                [as_bytes(views[parity][n][g.lo + p * g.rows_per_rank : g.lo + (p + 1) * g.rows_per_rank]).view(-1)
                 for p in range(self.cp)] for n in names
            ] for g in geoms for parity in range(2)
        }  # fmt: skip
        self.ws = _Workspace.get(group, pool.device)
        self._graph_slots: dict[tuple[int, int], int] = {}
        self._prepare(num_slots=2)

    def _region_bytes(self, g: GroupGeometry) -> list[int]:
        return [_align(g.rows_per_rank * lay.page_bytes) for lay in self._lays]

    def _prepare(self, num_slots: int) -> None:
        need = [0, 0]
        for g in self._geoms:
            need[g.channel] = sum(self._region_bytes(g))
        self.ws.reserve(need, num_slots)
        self._generation = self.ws.generation
        self._handle = self.ws.handle  # captured graphs keep using the buffers they were recorded with
        self._last = self.ws.last_slot[self._generation]
        self._bufs: dict[tuple[int, int], tuple[list, list]] = {}
        for g in self._geoms:
            m, sizes = g.rows_per_rank, self._region_bytes(g)
            for slot in range(self.ws.num_slots):
                off = self.ws.offset(g.channel, slot)
                mine, peers = [], [[] for _ in range(self.cp)]
                for lay, size in zip(self._lays, sizes):
                    flat = self.ws.tensor[off : off + m * lay.page_bytes]
                    mine.append(flat.view(lay.dtype).view(m, *lay.page_shape))
                    for p in range(self.cp):
                        peers[p].append(self._handle.get_buffer(p, (m * lay.page_bytes,), torch.uint8, off))
                    off += size
                self._bufs[(g.channel, slot)] = (mine, peers)

    def tensors(self) -> list[torch.Tensor]:
        """Buffers the gather streams use besides the views (the workspace lives as long as the process)."""
        return []

    def scratch_bytes(self) -> int:
        """This Materializer's share of the symmetric workspace (its send slots)."""
        return self.ws.num_slots * sum(sum(self._region_bytes(g)) for g in self._geoms)

    def prepare_capture(self, num_layers: int) -> None:
        """Fix each captured layer's slot: alternating, a third slot closing an odd cycle (collective if it grows)."""
        slots = graph_slots(num_layers)
        if max(slots) + 1 > self.ws.num_slots or self._generation != self.ws.generation:
            self._prepare(num_slots=max(max(slots) + 1, self.ws.num_slots))
        for g in self._geoms:
            for layer, slot in enumerate(slots):
                self._graph_slots[(g.channel, layer)] = slot

    def before_replay(self, g: GroupGeometry, layer: int) -> None:
        """Before replaying a captured gather: a barrier when its slot is the one read last (eager use between)."""
        slot = self._graph_slots[(g.channel, layer)]
        if self._last[g.channel] == slot:
            self._handle.barrier(channel=g.channel, timeout_ms=BARRIER_TIMEOUT_MS)
        self._last[g.channel] = slot

    def launch(self, g: GroupGeometry, layer: int, parity: int, async_op: bool, *, captured: bool = False):
        """Pack, barrier, copy every peer's rows into the views (on the current stream); returns None."""
        if captured:
            slot = self._graph_slots[(g.channel, layer)]
        else:
            if self._generation != self.ws.generation:  # another Materializer grew the workspace: move along
                self._prepare(num_slots=self.ws.num_slots)
            slot = next_slot(self._last[g.channel])
            self._last[g.channel] = slot
        mine, peers = self._bufs[(g.channel, slot)]
        if g.count:
            self._pack([b[: g.count] for b in mine], self._srcs[layer], g.send_idx)
        self._handle.barrier(channel=g.channel, timeout_ms=BARRIER_TIMEOUT_MS)
        for k, per_peer in enumerate(self._outs[(g.channel, parity)]):
            for p, out in enumerate(per_peer):
                out.copy_(peers[p][k], non_blocking=True)
        return None
