"""Symmetric-memory view buffers of the copy-engine backend, and the ordering rules that make them safe to reuse.

A copy-engine Materializer keeps its two view buffers (layer parities 0 and 1, every layout) in one
``torch.distributed._symmetric_memory`` allocation, the same size on every rank. Each rank writes its own pages of
a gather straight into its own rows of its view (the *own region*); peers then read that region with the copy
engines into the same rows of their views. There is no send buffer: scratch is exactly the two views.

One gather of a page group (``channel``: history or current) on its gather stream, on every rank::

    [fence]  own rows <- pool pages  |  barrier(channel)  |  own views' peer rows <- each peer's own rows

Reuse rule: a rank rewrites its own region of buffer ``X`` at gather ``n`` of a channel only if gather ``n - 1``
of that channel did not use ``X``: the write follows barrier ``n - 1`` in stream order, which every peer reaches
only after finishing its copies of gather ``n - 2`` and earlier. Views alternate parities layer by layer, so the
rule costs nothing except where one parity repeats (an odd number of layers wrapping to layer 0, one layer, or
views out of order): then :meth:`SymmBuffers.before_write` issues one extra barrier first. The *fence* (the
gather stream waits for the other gather stream, then a barrier) runs before the first write of each channel into
a buffer under a new geometry (a new owner, or a new plan): it orders that write after every peer's copies of
both channels, whatever rows they used before.

Buffers are never freed while a Materializer owns them. When one is garbage-collected its buffer is released to
the registry of its (group, device) and may serve a later Materializer; which buffer is reused is agreed across
the ranks (a fixed-size exchange on the group's CPU channel), so every rank keeps the same registry. A buffer too
small for any later request is dropped when a larger one is allocated, after every rank synchronized its device.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtkv._agree import agree
from dtkv._collectives import all_gather_into, cpu_channel

from ._exchange import Vote, exchange_votes

__all__ = ["BARRIER_TIMEOUT_MS", "MAX_EXCHANGED_IDS", "SymmBuffer", "SymmBuffers", "symm_mem_module"]

logger = logging.getLogger(__name__)

BARRIER_TIMEOUT_MS = 300_000
"""Deadline of a copy-engine barrier; past it the device traps (the process fails rather than hangs)."""

MAX_EXCHANGED_IDS = 31
"""Free buffers each rank offers for reuse per request (the smallest ids; more are simply not reused)."""


def symm_mem_module():
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


@dataclass(eq=False)
class SymmBuffer:
    """One symmetric allocation of a registry."""

    id: int
    """Allocation order in the registry (the same buffer has the same id on every rank)."""
    tensor: torch.Tensor
    """uint8 ``[nbytes]``: this rank's memory."""
    handle: object
    """The symmetric-memory handle: ``get_buffer(peer, sizes, dtype, offset)``, ``barrier(channel, timeout_ms)``."""
    nbytes: int
    free: bool = False
    """Released by its Materializer (reusable once every rank agrees)."""
    fresh: list[bool] = field(default_factory=lambda: [True, True])
    """Per channel: the next write needs the fence (new owner or new geometry)."""


class SymmBuffers:
    """The symmetric view buffers of one (group, device), shared by every copy-engine Materializer of it."""

    _cache: dict[tuple[str, str], SymmBuffers] = {}

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device
        self.buffers: dict[int, SymmBuffer] = {}
        self.next_id = 0
        self.last: list[tuple[int, int] | None] = [None, None]  # per channel: (buffer id, parity) of the last write
        self.barriers = 0  # barriers issued (tests count the extra ones)

    @classmethod
    def get(cls, group: dist.ProcessGroup, device: torch.device) -> SymmBuffers:
        key = (group.group_name, str(device))
        if key not in cls._cache:
            cls._cache[key] = cls(group, device)
        return cls._cache[key]

    # ------------------------------------------------------------------------------------------ lifetime
    def acquire(self, nbytes: int) -> SymmBuffer:
        """A buffer of at least ``nbytes`` (collective over the group: every rank asks for the same size).

        Reuses a buffer released on every rank when one is large enough, else allocates one (``symm_mem.empty`` and
        a rendezvous; an allocation failure on any rank raises on every rank).

        Raises:
            MaterializeError: the ranks asked for different sizes.
        """
        from ._plan import MaterializeError

        world = dist.get_world_size(self.group)
        free = sorted(b.id for b in self.buffers.values() if b.free)[:MAX_EXCHANGED_IDS]
        mine = torch.full((MAX_EXCHANGED_IDS + 1,), -1, dtype=torch.int64)
        mine[0] = nbytes
        mine[1 : 1 + len(free)] = torch.tensor(free, dtype=torch.int64)
        rows = torch.empty(world * mine.numel(), dtype=torch.int64)
        all_gather_into(rows, mine, cpu_channel(self.group))
        rows = rows.view(world, -1)
        sizes = rows[:, 0].tolist()
        if len(set(sizes)) != 1:
            raise MaterializeError(
                "CP ranks asked for copy-engine view buffers of different sizes ("
                + ", ".join(f"rank {r}: {s} bytes" for r, s in enumerate(sizes))
                + "); every rank must pass the same plan, names and max_view_pages"
            )
        agreed = set(rows[0, 1:].tolist()) - {-1}
        for r in range(1, world):
            agreed &= set(rows[r, 1:].tolist())
        fits = sorted(i for i in agreed if self.buffers[i].nbytes >= nbytes)
        if fits:
            buf = self.buffers[fits[0]]
            buf.free, buf.fresh = False, [True, True]
            return buf
        if agreed:  # released everywhere and too small for this request: drop them once every device is idle
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            exchange_votes(Vote(digest=b"", ok=True), self.group)  # ... on every rank: no peer still reads them
            for i in sorted(agreed):
                del self.buffers[i]
        return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> SymmBuffer:
        symm_mem = symm_mem_module()
        tensor, error = None, None
        try:
            if symm_mem is None:
                raise RuntimeError("torch.distributed._symmetric_memory is not available in this torch build")
            tensor = symm_mem.empty(max(1, nbytes), dtype=torch.uint8, device=self.device)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # fail together, not in the rendezvous
            error = e
        agree(error, cpu_channel(self.group), what="copy-engine view buffers")
        try:
            handle = symm_mem.rendezvous(tensor, self.group.group_name)
        except RuntimeError:  # torch builds that still need the group registered first
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
            handle = symm_mem.rendezvous(tensor, self.group.group_name)
        buf = SymmBuffer(id=self.next_id, tensor=tensor, handle=handle, nbytes=nbytes)
        self.next_id += 1
        self.buffers[buf.id] = buf
        logger.debug("copy-engine view buffer %d of %s: %d bytes", buf.id, self.group.group_name, nbytes)
        return buf

    def release(self, buf_id: int) -> None:
        """Mark a buffer reusable (its Materializer is gone); local, agreed at the next :meth:`acquire`."""
        buf = self.buffers.get(buf_id)
        if buf is not None:
            buf.free = True

    # ------------------------------------------------------------------------------------------ ordering
    def barrier(self, buf: SymmBuffer, channel: int) -> None:
        self.barriers += 1
        buf.handle.barrier(channel=channel, timeout_ms=BARRIER_TIMEOUT_MS)

    def before_write(self, buf: SymmBuffer, channel: int, parity: int, other_stream=None) -> None:
        """Host side of the reuse rule (see the module docstring), on the gather stream about to write.

        Args:
            other_stream: the other channel's gather stream (CUDA), joined by the fence.
        """
        key = (buf.id, parity)
        if buf.fresh[channel]:
            if other_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(other_stream)
            self.barrier(buf, channel)
            buf.fresh[channel] = False
        elif self.last[channel] == key:
            self.barrier(buf, channel)
        self.last[channel] = key
