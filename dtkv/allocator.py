"""Owner-aware SPMD page allocator over logical pages.

Every rank of a CP group holds an identical :class:`PageAllocator` and feeds it the same calls in the same
order, so every rank makes the same decisions without communication (the scheduler runs SPMD on logical pages).
The free pages are kept in one min-heap per owner class, so a caller can ask for "a page stored on rank r" --
the basis of compute-owner direct writes (``dtkv.split.allocate_for_split``). An owner that stores no page
(``block`` scheme with ``cp=3`` and 4 pages, or fewer pages than ranks) simply has an empty class.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence

import torch

from dtkv._agree import register_error
from dtkv._checks import check_int
from dtkv._util import as_int_list
from dtkv.ownership import PageOwnership

__all__ = ["AllocationError", "PageAllocator"]


@register_error
class AllocationError(RuntimeError):
    """A request for pages cannot be met; nothing was allocated."""


class PageAllocator:
    """SPMD allocator: one free list per owner rank of ``ownership``.

    Pages are handed out lowest-first within an owner class (deterministic, and it keeps runs contiguous,
    which helps transfer coalescing).

    Args:
        ownership: the page-ownership map of the pool being allocated.
        reserved: logical pages never handed out (e.g. a padding page); ``free`` rejects them.
    """

    def __init__(self, ownership: PageOwnership, *, reserved: Sequence[int] = ()) -> None:
        if not isinstance(ownership, PageOwnership):
            raise TypeError(f"ownership must be a PageOwnership, got {type(ownership).__name__}")
        self.ownership = ownership
        cp = ownership.cp_size
        reserved_set = set(as_int_list("reserved", reserved))
        for p in sorted(reserved_set):
            if not 0 <= p < ownership.num_pages:
                raise ValueError(f"reserved must hold pages in [0, {ownership.num_pages}), got {p}")
        self._reserved = frozenset(reserved_set)
        self._free: list[list[int]] = []
        for r in range(cp):
            pages = [int(p) for p in ownership.local_pages(r).tolist() if int(p) not in reserved_set]
            heapq.heapify(pages)
            self._free.append(pages)
        self._is_free = bytearray(ownership.num_pages)
        for heap in self._free:
            for p in heap:
                self._is_free[p] = 1
        self._cursor = 0

    # ------------------------------------------------------------------------------------------ queries
    def num_free(self, owner: int | None = None) -> int:
        """Free pages in total, or stored on ``owner``."""
        if owner is None:
            return sum(len(h) for h in self._free)
        self._check_owner("owner", owner)
        return len(self._free[owner])

    def is_free(self, page: int) -> bool:
        """Whether logical ``page`` is free (reserved pages never are)."""
        check_int("page", page)
        if not 0 <= page < self.ownership.num_pages:
            raise ValueError(f"page must be in [0, {self.ownership.num_pages}), got page={page}")
        return bool(self._is_free[page])

    @property
    def reserved(self) -> frozenset[int]:
        """The pages never handed out."""
        return self._reserved

    def digest(self) -> str:
        """A hash of the free state; equal on every rank while the SPMD contract holds (debug checks)."""
        return hashlib.sha256(bytes(self._is_free)).hexdigest()[:16]

    # ------------------------------------------------------------------------------------------ alloc
    def alloc(self, owners: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """For each requested owner rank, a free page stored on that rank.

        Args:
            owners: int ranks in ``[0, cp_size)``, any length (``[n]``).

        Returns:
            int64 CPU tensor ``[n]`` of logical pages; ``pages[i]`` is owned by ``owners[i]``.

        Raises:
            AllocationError: some owner has fewer free pages than requested; nothing is allocated.
        """
        wanted = as_int_list("owners", owners)
        counts = [0] * self.ownership.cp_size
        for o in wanted:
            self._check_owner("owners", o)
            counts[o] += 1
        short = [(r, c, len(self._free[r])) for r, c in enumerate(counts) if c > len(self._free[r])]
        if short:
            r, c, have = short[0]
            raise AllocationError(
                f"alloc(owners) asked for {c} pages owned by rank {r}, but only {have} are free "
                f"(free per owner: {[len(h) for h in self._free]}); nothing was allocated"
            )
        out = [heapq.heappop(self._free[o]) for o in wanted]
        for p in out:
            self._is_free[p] = 0
        return torch.tensor(out, dtype=torch.int64)

    def alloc_balanced(self, n: int) -> torch.Tensor:
        """``n`` free pages spread across owners round-robin from a rotating cursor (no owner preference).

        Owners with no free page are skipped, so the request succeeds whenever ``n <= num_free()``. The cursor
        carries over between calls, so repeated calls keep the pages handed out per owner within one of each
        other (among owners that still have free pages), whatever the sizes of the calls.

        Returns:
            int64 CPU tensor ``[n]`` of logical pages.

        Raises:
            AllocationError: ``n > num_free()``; nothing is allocated.
        """
        check_int("n", n, min_value=0)
        if n > self.num_free():
            raise AllocationError(
                f"alloc_balanced(n={n}) needs {n} free pages, only {self.num_free()} are free; nothing was allocated"
            )
        cp = self.ownership.cp_size
        remaining = [len(h) for h in self._free]
        owners = []
        r = self._cursor
        while len(owners) < n:
            if remaining[r]:
                owners.append(r)
                remaining[r] -= 1
            r = (r + 1) % cp
        self._cursor = r
        return self.alloc(owners)

    def free(self, pages: Sequence[int] | torch.Tensor) -> None:
        """Return pages to their owners' free lists; ``-1`` entries are ignored.

        Raises:
            ValueError: a page is outside the pool, reserved, not allocated (double free) or repeated; nothing
                is freed.
        """
        plist = [p for p in as_int_list("pages", pages) if p != -1]
        seen = set()
        for p in plist:
            if not 0 <= p < self.ownership.num_pages:
                raise ValueError(
                    f"free(pages) got page {p}, outside the pool's pages [0, {self.ownership.num_pages}); "
                    "nothing was freed"
                )
            if p in self._reserved:
                raise ValueError(f"free(pages) got page {p}, which is reserved (never allocated); nothing was freed")
            if self._is_free[p] or p in seen:
                raise ValueError(f"free(pages) got page {p}, which is not allocated (double free); nothing was freed")
            seen.add(p)
        for p in plist:
            heapq.heappush(self._free[self.ownership.owner(p)], p)
            self._is_free[p] = 1

    def _check_owner(self, name: str, owner: int) -> None:
        check_int(name, owner)
        if not 0 <= owner < self.ownership.cp_size:
            raise ValueError(f"{name} must hold ranks in [0, {self.ownership.cp_size}), got {owner}")
