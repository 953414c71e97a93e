"""Owner-aware SPMD page allocator over logical pages.

Every rank of a CP group holds an identical :class:`PageAllocator` and feeds it the same calls in the same
order, so every rank makes the same decisions without communication (the scheduler runs SPMD on logical pages).
The free pages are kept in one min-heap per owner class, so a caller can ask for "a page stored on rank r" --
the basis of compute-owner direct writes (``dtkv.split.allocate_for_split``).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Sequence

import torch

from dtkv._checks import check_int
from dtkv.ownership import PageOwnership

__all__ = ["AllocationError", "PageAllocator"]


class AllocationError(RuntimeError):
    """A request for pages cannot be met; nothing was allocated."""


def _as_int_list(name: str, values: Sequence[int] | torch.Tensor | Iterable[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {name}.dtype={values.dtype}")
        return [int(v) for v in values.flatten().tolist()]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {v!r} ({type(v).__name__})")
        out.append(v)
    return out


class PageAllocator:
    """SPMD allocator: one free list per owner rank of ``ownership``.

    Pages are handed out lowest-first within an owner class (deterministic, and it keeps runs contiguous,
    which helps transfer coalescing).

    Args:
        ownership: the page-ownership map of the pool being allocated.
        reserved: logical pages never handed out (e.g. a padding page).
    """

    def __init__(self, ownership: PageOwnership, *, reserved: Sequence[int] = ()) -> None:
        if not isinstance(ownership, PageOwnership):
            raise TypeError(f"ownership must be a PageOwnership, got {type(ownership).__name__}")
        self.ownership = ownership
        cp = ownership.cp_size
        reserved_set = set(_as_int_list("reserved", reserved))
        for p in reserved_set:
            if not 0 <= p < ownership.num_pages:
                raise ValueError(f"reserved must hold pages in [0, {ownership.num_pages}), got {p}")
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
        return bool(self._is_free[page])

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
        wanted = _as_int_list("owners", owners)
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

        Owners with no free page are skipped, so the request succeeds whenever ``n <= num_free()``.

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
            ValueError: a page is outside the pool, not allocated (double free) or repeated; nothing is freed.
        """
        plist = [p for p in _as_int_list("pages", pages) if p != -1]
        seen = set()
        for p in plist:
            if not 0 <= p < self.ownership.num_pages:
                raise ValueError(
                    f"free(pages) got page {p}, outside the pool's pages [0, {self.ownership.num_pages}); "
                    "nothing was freed"
                )
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
