"""Page ownership: which CP rank stores each logical KV page, as a DTensor placement tag.

A logical page ``p`` of a pool of ``num_pages`` (``P``) pages lives on exactly one of ``cp_size`` (``cp``) ranks;
the **ownership scheme** says which (the byte format of a stored page is its *layout*, :mod:`dtkv.layouts`):

============  ==========================  ===============================  ========================================
scheme        owner(p)                    local_index(p)                   num_local_pages(r)
============  ==========================  ===============================  ========================================
interleave    ``p % cp``                  ``p // cp``                      ``ceil((P - r) / cp)``
block         ``p // ppr``                ``p - owner * ppr``              ``clamp(P - r * ppr, 0, ppr)``
============  ==========================  ===============================  ========================================

with ``ppr = pages_per_rank = ceil(P / cp)`` (``torch.chunk`` sizes, as ``Shard(0)`` uses). A rank may store no
page at all (``block`` with ``cp=3, P=4``, or any scheme with ``P < cp``): that is a normal case everywhere.
``-1`` is the padding sentinel of page tables and maps to ``-1`` everywhere. For ``cp=4, P=10``::

    rank        0        1        2      3
    interleave  0 4 8    1 5 9    2 6    3 7
    block       0 1 2    3 4 5    6 7 8  9

The map is pure arithmetic: no directory, every rank computes it, and it is inverted by :meth:`global_page`.
This module is the one home of that arithmetic: :func:`owner_and_local` and :func:`pages_per_rank` serve code
that holds plain ints (the ops), :class:`PageOwnership` and :class:`OwnershipSpec` wrap them.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, TypeVar, overload

import torch
from torch.distributed.tensor.placement_types import Placement

from dtkv._checks import check_int
from dtkv._util import cdiv

__all__ = [
    "SCHEMES",
    "SCHEME_CODES",
    "OwnershipScheme",
    "OwnershipSpec",
    "PageOwnership",
    "owner_and_local",
    "ownership_spec",
    "pages_per_rank",
]

OwnershipScheme = Literal["interleave", "block"]
"""Which rank stores each page: ``"interleave"`` (``p % cp``) or ``"block"`` (contiguous ranges)."""
SCHEMES: tuple[str, ...] = ("interleave", "block")
SCHEME_CODES: dict[str, int] = {"interleave": 0, "block": 1}
"""The integer code of each scheme, as registered ops take it (0 = interleave, 1 = block)."""
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def _check_scheme(scheme: object) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got scheme={scheme!r}")
    return scheme  # type: ignore[return-value]


def pages_per_rank(cp_size: int, num_pages: int) -> int:
    """Pages each rank stores under the ``block`` scheme (the last owning rank may store fewer, later ones
    none): ``ceil(num_pages / cp_size)``; also the largest per-rank count of either scheme."""
    return cdiv(num_pages, cp_size)


def owner_and_local(pages, cp_size: int, num_pages: int, scheme: str | int):
    """Owner rank and local page index of non-negative ``pages`` (int or integer tensor, any shape).

    The raw arithmetic of the module table, for callers holding plain ints (``scheme`` may be a name or its
    :data:`SCHEME_CODES` code). It does not keep the ``-1`` sentinel: :meth:`PageOwnership.owner` and
    :meth:`PageOwnership.local_index` do.

    Returns:
        ``(owner, local_index)``, each of the type and shape of ``pages``.
    """
    return _owner_raw(pages, cp_size, num_pages, scheme), _local_raw(pages, cp_size, num_pages, scheme)


def _owner_raw(pages, cp_size: int, num_pages: int, scheme: str | int):
    if scheme in ("interleave", 0):
        return pages % cp_size
    return pages // pages_per_rank(cp_size, num_pages)


def _local_raw(pages, cp_size: int, num_pages: int, scheme: str | int):
    if scheme in ("interleave", 0):
        return pages // cp_size
    return pages % pages_per_rank(cp_size, num_pages)


class PageOwnership(Placement):
    """DTensor placement tag for a pool whose dim 0 is logical pages, each stored once on its owner rank.

    It is an opaque tag: ``is_shard()``, ``is_replicate()`` and ``is_partial()`` are all False, so DTensor never
    computes with it (it must not pretend to be ``Shard``: DTensor would then redistribute with the wrong page
    order). Build DTensors with ``DTensor.from_local(local, mesh, [ownership], shape=..., stride=...)``
    (:meth:`dtkv.ShardedKVPool.dtensor` does) and gather with :meth:`dtkv.ShardedKVPool.gather_full`.

    Contract:
        1. ``__eq__``/``__hash__`` cover ``(cp_size, num_pages, scheme)``; two tags are equal iff every rank maps
           every page identically.
        2. ``__reduce__`` makes it picklable (compile pickles DTensor input metadata).
        3. ``owner``/``local_index``/``global_page`` are branch-free tensor arithmetic: they trace under
           ``torch.compile(fullgraph=True)`` and never synchronize with the host. They do not range-check;
           :meth:`check_pages` does, in eager.

    Args:
        cp_size: number of ranks sharing the pool (>= 1).
        num_pages: logical pages in the pool (>= 1).
        scheme: the ownership scheme, ``"interleave"`` or ``"block"`` (see the module table).
    """

    __slots__ = ("_cp_size", "_num_pages", "_scheme", "_pages_per_rank")

    def __init__(self, cp_size: int, num_pages: int, scheme: OwnershipScheme = "interleave") -> None:
        super().__init__()  # the pybind base must be initialised, or is_shard() segfaults
        check_int("cp_size", cp_size, min_value=1)
        check_int("num_pages", num_pages, min_value=1)
        _check_scheme(scheme)
        object.__setattr__(self, "_cp_size", cp_size)
        object.__setattr__(self, "_num_pages", num_pages)
        object.__setattr__(self, "_scheme", scheme)
        object.__setattr__(self, "_pages_per_rank", pages_per_rank(cp_size, num_pages))

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
    def scheme(self) -> OwnershipScheme:
        """The ownership scheme, ``"interleave"`` or ``"block"``."""
        return self._scheme  # type: ignore[return-value]

    @property
    def pages_per_rank(self) -> int:
        """``ceil(num_pages / cp_size)``: pages per rank of the ``block`` scheme (see :func:`pages_per_rank`)."""
        return self._pages_per_rank

    def _key(self) -> tuple[int, int, str]:
        return (self._cp_size, self._num_pages, self._scheme)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._key())

    def __repr__(self) -> str:
        return f"PageOwnership(cp_size={self._cp_size}, num_pages={self._num_pages}, scheme={self._scheme!r})"

    def __str__(self) -> str:
        return f"PO({self._scheme[0]},{self._cp_size})"

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
        return _owner(pages, self._cp_size, self._num_pages, self._scheme)

    @overload
    def local_index(self, pages: int) -> int: ...
    @overload
    def local_index(self, pages: torch.Tensor) -> torch.Tensor: ...
    def local_index(self, pages):
        """Index of each logical page inside its owner's local pool (same type/shape as ``pages``; -1 kept)."""
        return _local_index(pages, self._cp_size, self._num_pages, self._scheme)

    @overload
    def global_page(self, rank: int | torch.Tensor, local_index: int) -> int: ...
    @overload
    def global_page(self, rank: int | torch.Tensor, local_index: torch.Tensor) -> torch.Tensor: ...
    def global_page(self, rank, local_index):
        """Inverse map: the logical page stored at ``local_index`` on ``rank`` (-1 local indices kept)."""
        return _global_page(rank, local_index, self._cp_size, self._num_pages, self._scheme)

    def num_local_pages(self, rank: int) -> int:
        """Number of logical pages stored on ``rank``."""
        check_int("rank", rank, min_value=0)
        if rank >= self._cp_size:
            raise ValueError(f"rank must be < cp_size={self._cp_size}, got rank={rank}")
        if self._scheme == "interleave":
            return cdiv(self._num_pages - rank, self._cp_size)
        ppr = self._pages_per_rank
        return max(0, min(ppr, self._num_pages - rank * ppr))

    @property
    def max_local_pages(self) -> int:
        """Largest per-rank page count (the padded size of owner-major all-gathers); rank 0 always has it."""
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
        return OwnershipSpec(self._cp_size, self._num_pages, self._scheme)

    def to_standard(self) -> Placement:
        """The equivalent upstream placement, for cross-checks in tests only (eager, never on hot paths).

        ``block`` is exactly ``Shard(0)``; ``interleave`` is exactly ``_StridedShard(0, split_factor=P // cp)``
        when ``cp`` divides ``P`` (a private, version-dependent class).

        Raises:
            ValueError: for ``interleave`` when ``num_pages % cp_size != 0``.
        """
        from torch.distributed.tensor import Shard

        if self._scheme == "block" or self._cp_size == 1:
            return Shard(0)
        if self._num_pages % self._cp_size:
            raise ValueError(
                "to_standard() for scheme='interleave' needs num_pages % cp_size == 0, "
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
    scheme: str  # "interleave" | "block"

    @property
    def pages_per_rank(self) -> int:
        """As :attr:`PageOwnership.pages_per_rank`."""
        return pages_per_rank(self.cp_size, self.num_pages)

    def owner(self, pages):
        """As :meth:`PageOwnership.owner`."""
        return _owner(pages, self.cp_size, self.num_pages, self.scheme)

    def local_index(self, pages):
        """As :meth:`PageOwnership.local_index`."""
        return _local_index(pages, self.cp_size, self.num_pages, self.scheme)

    def global_page(self, rank, local_index):
        """As :meth:`PageOwnership.global_page`."""
        return _global_page(rank, local_index, self.cp_size, self.num_pages, self.scheme)


def ownership_spec(ownership: PageOwnership | OwnershipSpec) -> OwnershipSpec:
    """The :class:`OwnershipSpec` of a ``PageOwnership`` (eager; returns a spec unchanged)."""
    if isinstance(ownership, OwnershipSpec):
        return ownership
    if not isinstance(ownership, PageOwnership):
        raise TypeError(f"ownership must be a dtkv.PageOwnership or OwnershipSpec, got {type(ownership).__name__}")
    return ownership.spec


def _owner(pages, cp_size: int, num_pages: int, scheme: str):
    return _keep_sentinel(pages, _owner_raw(pages, cp_size, num_pages, scheme))


def _local_index(pages, cp_size: int, num_pages: int, scheme: str):
    return _keep_sentinel(pages, _local_raw(pages, cp_size, num_pages, scheme))


def _global_page(rank, local_index, cp_size: int, num_pages: int, scheme: str):
    if scheme == "interleave":
        out = local_index * cp_size + rank
    else:
        out = rank * pages_per_rank(cp_size, num_pages) + local_index
    return _keep_sentinel(local_index, out)


def _keep_sentinel(pages, out):
    if isinstance(pages, torch.Tensor):
        return torch.where(pages < 0, torch.full_like(out, -1), out)
    if isinstance(out, torch.Tensor):  # int pages, tensor rank
        return out if pages >= 0 else torch.full_like(out, -1)
    return -1 if pages < 0 else out
