"""Fixed-size all-gathers of a decode step, through the process group (``"nccl"``) or symmetric memory
(``"symm_mem"``), both safe inside a CUDA graph.

Legend: ``C`` ranks, ``n`` bytes a rank contributes.

=============  ==========================================================================================
backend        one all-gather of ``n`` bytes per rank
=============  ==========================================================================================
``nccl``       ``all_gather_into_tensor`` on the CP group (NCCL on GPUs, gloo on CPUs): one collective
``symm_mem``   CUDA and ``torch.distributed._symmetric_memory`` only: each rank copies its bytes into its
               own region of a symmetric buffer, one device barrier, then each rank copies every peer's
               region out of the peer's memory (copy engines over NVLink, no SMs, no NCCL kernel)
=============  ==========================================================================================

**Reuse rule (symm_mem).** The buffer has two regions (parities) per rank and successive all-gathers alternate
between them. A rank rewrites a region only after the barrier of the all-gather in between, which every peer
reaches only after its copies out of that region: so no peer still reads what is overwritten. :meth:`begin_step`
issues one more barrier and resets the parity, so a captured step (a fixed sequence of all-gathers, replayed again
and again) keeps the rule across replays whatever its number of all-gathers.

Every rank must make the same calls with the same sizes (the step's shapes are the same on every rank). Setting up
``symm_mem`` is collective and fails on every rank together (:class:`dtkv.materialize` shares the allocation
registry); every barrier has a deadline past which the device traps rather than hangs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_into, as_bytes, group_rank, group_size

__all__ = ["COMMS", "Comm", "Exchange"]

Comm = Literal["nccl", "symm_mem"]
COMMS: tuple[str, ...] = ("nccl", "symm_mem")

_ALIGN = 256


class Exchange:
    """All-gathers of at most ``max_bytes`` per rank over ``group`` (see the module docstring).

    Args:
        group: the CP group (``None`` or one rank: nothing is ever exchanged).
        device: where the tensors live.
        backend: ``"nccl"`` or ``"symm_mem"``.
        max_bytes: the largest message one rank contributes (``symm_mem`` allocates for it once).
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, *, backend: str, max_bytes: int):
        if backend not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got comm={backend!r}")
        self.group, self.device, self.backend = group, torch.device(device), backend
        self.cp, self.rank = group_size(group), group_rank(group)
        self.max_bytes = max(1, int(max_bytes))
        self.calls = 0
        self._parity = 0
        self._peers: dict[tuple[int, int, int], torch.Tensor] = {}
        self._buf = None
        if backend == "symm_mem" and self.cp > 1:
            self._buf = self._allocate()

    def _allocate(self):
        from dtkv.materialize._symm import SymmBuffers, symm_mem_module

        if self.device.type != "cuda" or symm_mem_module() is None:
            raise ValueError(
                f"comm='symm_mem' needs CUDA tensors and torch.distributed._symmetric_memory, got device "
                f"{self.device} (symmetric memory {'missing' if symm_mem_module() is None else 'present'}); "
                "use comm='nccl'"
            )
        self._region = -(-self.max_bytes // _ALIGN) * _ALIGN
        return SymmBuffers.get(self.group, self.device).acquire(2 * self._region)  # collective, fails together

    @property
    def active(self) -> bool:
        """True when all-gathers move bytes (more than one rank)."""
        return self.cp > 1

    def begin_step(self) -> None:
        """Start a step's sequence of all-gathers (``symm_mem``: one barrier, parity 0; nothing for ``nccl``)."""
        if self._buf is not None:
            self._barrier()
            self._parity = 0

    def _barrier(self) -> None:
        from dtkv.materialize._symm import BARRIER_TIMEOUT_MS

        assert self._buf is not None, "symm_mem barrier without a buffer"
        self._buf.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """Rank-major all-gather of ``inp`` (any dtype, contiguous) into ``out`` (``[C * inp.numel()]`` elements of
        ``inp``'s dtype, contiguous); returns ``out``. Stream-ordered, no host synchronization."""
        if not self.active:
            out.copy_(inp.reshape(out.shape))
            return out
        self.calls += 1
        src, dst = as_bytes(inp.contiguous()).reshape(-1), as_bytes(out).reshape(self.cp, -1)
        n = src.numel()
        if n > self.max_bytes:
            raise ValueError(f"a message of {n} bytes exceeds the exchange's max_bytes={self.max_bytes}")
        if self._buf is None:
            assert self.group is not None, "an active exchange has a group"
            all_gather_into(dst.reshape(-1), src, self.group)
            return out
        p = self._parity
        self._parity ^= 1
        base = p * self._region
        self._buf.tensor[base : base + n].copy_(src)
        self._barrier()
        for c in range(self.cp):
            if c == self.rank:
                dst[c].copy_(src)
                continue
            key = (c, p, n)
            peer = self._peers.get(key)
            if peer is None:
                peer = self._buf.handle.get_buffer(c, (n,), torch.uint8, base)
                self._peers[key] = peer
            dst[c].copy_(peer, non_blocking=True)
        return out
