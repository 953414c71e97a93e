"""Page ownership: which CP rank stores each logical KV page, as a DTensor placement tag.

A logical page ``p`` of a pool of ``num_pages`` pages lives on exactly one of ``cp_size`` ranks:

============  ==========================  ===============================  =========================
layout        owner(p)                    local_index(p)                   num_local_pages(r)
============  ==========================  ===============================  =========================
interleave    ``p % cp``                  ``p // cp``                      ``ceil((P - r) / cp)``
block         ``p // chunk``              ``p - owner * chunk``            ``clamp(P - r*chunk, 0, chunk)``
============  ==========================  ===============================  =========================

with ``chunk = ceil(P / cp)`` (``torch.chunk`` sizes, as ``Shard(0)`` uses). ``-1`` is the padding sentinel of
page tables and maps to ``-1`` everywhere. For ``cp=4, P=10``::

    rank        0        1        2      3
    interleave  0 4 8    1 5 9    2 6    3 7
    block       0 1 2    3 4 5    6 7 8  9

The map is pure arithmetic: no directory, every rank computes it, and it is inverted by :meth:`global_page`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, TypeVar, overload

import torch
from torch.distributed.tensor.placement_types import Placement

from dtkv._checks import check_int

__all__ = ["Layout", "OwnershipSpec", "PageOwnership", "ownership_spec"]

Layout = Literal["interleave", "block"]
_LAYOUTS = ("interleave", "block")
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


class PageOwnership(Placement):
    """DTensor placement tag for a pool whose dim 0 is logical pages, each stored once on its owner rank.

    It is an opaque tag: ``is_shard()``, ``is_replicate()`` and ``is_partial()`` are all False, so DTensor never
    computes with it (it must not pretend to be ``Shard``: DTensor would then redistribute with the wrong page
    order). Build DTensors with ``DTensor.from_local(local, mesh, [ownership], shape=..., stride=...)``
    (:meth:`dtkv.ShardedKVPool.dtensor` does) and gather with :meth:`dtkv.ShardedKVPool.gather_full`.

    Contract:
        1. ``__eq__``/``__hash__`` cover ``(cp_size, num_pages, layout)``; two tags are equal iff every rank maps
           every page identically.
        2. ``__reduce__`` makes it picklable (compile pickles DTensor input metadata).
        3. ``owner``/``local_index``/``global_page`` are branch-free tensor arithmetic: they trace under
           ``torch.compile(fullgraph=True)`` and never synchronize with the host. They do not range-check;
           :meth:`check_pages` does, in eager.

    Args:
        cp_size: number of ranks sharing the pool (>= 1).
        num_pages: logical pages in the pool (>= 1).
        layout: ``"interleave"`` or ``"block"`` (see the module table).
    """

    __slots__ = ("_cp_size", "_num_pages", "_layout", "_chunk")

    def __init__(self, cp_size: int, num_pages: int, layout: Layout = "interleave") -> None:
        super().__init__()  # the pybind base must be initialised, or is_shard() segfaults
        check_int("cp_size", cp_size, min_value=1)
        check_int("num_pages", num_pages, min_value=1)
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got layout={layout!r}")
        object.__setattr__(self, "_cp_size", cp_size)
        object.__setattr__(self, "_num_pages", num_pages)
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_chunk", -(-num_pages // cp_size))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"PageOwnership is immutable; cannot set {name}")

    # ----------------------------------------------------------------------------------------- identity
    @property
    def cp_size(self) -> int:
        return self._cp_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def layout(self) -> Layout:
        return self._layout

    def _key(self) -> tuple[int, int, str]:
        return (self._cp_size, self._num_pages, self._layout)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._key())

    def __repr__(self) -> str:
        return f"PageOwnership(cp_size={self._cp_size}, num_pages={self._num_pages}, layout={self._layout!r})"

    def __str__(self) -> str:
        return f"PO({self._layout[0]},{self._cp_size})"

    def __reduce__(self):  # contract 2
        return (type(self), self._key())

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return repr(self), {type(self).__name__: type(self)}

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    # ----------------------------------------------------------------------------------------- the map
    @overload
    def owner(self, pages: int) -> int: ...
    @overload
    def owner(self, pages: torch.Tensor) -> torch.Tensor: ...
    def owner(self, pages):
        """Owner rank of each logical page.

        Args:
            pages: an int, or an integer tensor of any shape (``-1`` entries are padding).

        Returns:
            Same type and shape (and dtype) as ``pages``; ``-1`` where ``pages`` is ``-1``.
        """
        return _owner(pages, self._cp_size, self._chunk, self._layout)

    @overload
    def local_index(self, pages: int) -> int: ...
    @overload
    def local_index(self, pages: torch.Tensor) -> torch.Tensor: ...
    def local_index(self, pages):
        """Index of each logical page inside its owner's local pool (same type/shape as ``pages``; -1 kept)."""
        return _local_index(pages, self._cp_size, self._chunk, self._layout)

    @overload
    def global_page(self, rank: int | torch.Tensor, local_index: int) -> int: ...
    @overload
    def global_page(self, rank: int | torch.Tensor, local_index: torch.Tensor) -> torch.Tensor: ...
    def global_page(self, rank, local_index):
        """Inverse map: the logical page stored at ``local_index`` on ``rank`` (-1 local indices kept)."""
        return _global_page(rank, local_index, self._cp_size, self._chunk, self._layout)

    def num_local_pages(self, rank: int) -> int:
        """Number of logical pages stored on ``rank``."""
        check_int("rank", rank, min_value=0)
        if rank >= self._cp_size:
            raise ValueError(f"rank must be < cp_size={self._cp_size}, got rank={rank}")
        if self._layout == "interleave":
            return -(-(self._num_pages - rank) // self._cp_size)
        return max(0, min(self._chunk, self._num_pages - rank * self._chunk))

    @property
    def max_local_pages(self) -> int:
        """Largest per-rank page count (the padded size of owner-major all-gathers)."""
        return self.num_local_pages(0)

    def local_pages(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Logical pages stored on ``rank``, in local order: int64 ``[num_local_pages(rank)]``."""
        idx = torch.arange(self.num_local_pages(rank), dtype=torch.int64, device=device)
        return self.global_page(rank, idx)

    def check_pages(self, name: str, pages: torch.Tensor, *, allow_padding: bool = True) -> None:
        """Eager range check (synchronizes): every entry is in ``[0, num_pages)`` (or ``-1`` if allowed).

        Raises:
            ValueError: naming ``name``, the first bad value and the valid range.
        """
        if pages.numel() == 0:
            return
        lo = -1 if allow_padding else 0
        bad = (pages < lo) | (pages >= self._num_pages)
        if bool(bad.any()):
            value = int(pages[bad].flatten()[0])
            rule = f"[{lo}, {self._num_pages})" + (" (-1 is padding)" if allow_padding else "")
            raise ValueError(f"{name} must hold logical pages in {rule}, got {name} containing {value}")

    @property
    def spec(self) -> OwnershipSpec:
        """The same map as a plain :class:`OwnershipSpec` (what compiled code should capture on torch < 2.13)."""
        return OwnershipSpec(self._cp_size, self._num_pages, self._layout)

    def to_standard(self) -> Placement:
        """The equivalent upstream placement, for cross-checks in tests only (eager, never on hot paths).

        ``block`` is exactly ``Shard(0)``; ``interleave`` is exactly ``_StridedShard(0, split_factor=P // cp)``
        when ``cp`` divides ``P`` (a private, version-dependent class).

        Raises:
            ValueError: for ``interleave`` when ``num_pages % cp_size != 0``.
        """
        from torch.distributed.tensor import Shard

        if self._layout == "block" or self._cp_size == 1:
            return Shard(0)
        if self._num_pages % self._cp_size:
            raise ValueError(
                "to_standard() for layout='interleave' needs num_pages % cp_size == 0, "
                f"got num_pages={self._num_pages}, cp_size={self._cp_size}"
            )
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(0, split_factor=self._num_pages // self._cp_size)


class OwnershipSpec(NamedTuple):
    """A :class:`PageOwnership` as a plain named tuple, with the same ``owner``/``local_index``/``global_page``.

    Every ``torch.compile`` version traces it. Compiled code on torch < 2.13 must capture this instead of the
    placement: Dynamo 2.11 treats any ``Placement`` subclass as an opaque constant and can neither call its
    methods nor guard on it. Every op wrapper accepts either. Build it with ``ownership.spec``.
    """

    cp_size: int
    num_pages: int
    layout: str  # "interleave" | "block"

    @property
    def chunk(self) -> int:
        return -(-self.num_pages // self.cp_size)

    def owner(self, pages):
        """As :meth:`PageOwnership.owner`."""
        return _owner(pages, self.cp_size, self.chunk, self.layout)

    def local_index(self, pages):
        """As :meth:`PageOwnership.local_index`."""
        return _local_index(pages, self.cp_size, self.chunk, self.layout)

    def global_page(self, rank, local_index):
        """As :meth:`PageOwnership.global_page`."""
        return _global_page(rank, local_index, self.cp_size, self.chunk, self.layout)


def ownership_spec(ownership: PageOwnership | OwnershipSpec) -> OwnershipSpec:
    """The :class:`OwnershipSpec` of a ``PageOwnership`` (eager; returns a spec unchanged)."""
    if isinstance(ownership, OwnershipSpec):
        return ownership
    if not isinstance(ownership, PageOwnership):
        raise TypeError(f"ownership must be a dtkv.PageOwnership or OwnershipSpec, got {type(ownership).__name__}")
    return ownership.spec


def _owner(pages, cp: int, chunk: int, layout: str):
    return _keep_sentinel(pages, pages % cp if layout == "interleave" else pages // chunk)


def _local_index(pages, cp: int, chunk: int, layout: str):
    return _keep_sentinel(pages, pages // cp if layout == "interleave" else pages % chunk)


def _global_page(rank, local_index, cp: int, chunk: int, layout: str):
    out = local_index * cp + rank if layout == "interleave" else rank * chunk + local_index
    return _keep_sentinel(local_index, out)


def _keep_sentinel(pages, out):
    if isinstance(pages, torch.Tensor):
        return torch.where(pages < 0, torch.full_like(out, -1), out)
    if isinstance(out, torch.Tensor):  # int pages, tensor rank
        return out if pages >= 0 else torch.full_like(out, -1)
    return -1 if pages < 0 else out
