"""Owner-aware SPMD page allocator over logical pages.

Every rank of a CP group holds an identical :class:`PageAllocator` and feeds it the same calls in the same
order, so every rank makes the same decisions without communication (the scheduler runs SPMD on logical pages).
The free pages are kept in one min-heap per owner class, so a caller can ask for "a page stored on rank r" --
the basis of compute-owner direct writes (``dtkv.split.allocate_for_split``). An owner that stores no page
(``block`` scheme with ``cp=3`` and 4 pages, or fewer pages than ranks) simply has an empty class.

Pages are reference counted, so a page can be shared (a prefix cache entry and the requests reading it,
:class:`dtkv.PrefixCache`): ``alloc`` hands a page out with one reference, ``retain`` adds one, ``release`` (and
its older name ``free``) drops one, and a page returns to its owner's free list only when its last reference
goes. Every call validates all its pages before it changes anything (all or nothing).

While a :class:`dtkv._journal.Journal` is attached (:attr:`PageAllocator.journal`), every change records its undo,
so a failed step can put the allocator back exactly (free lists, reference counts, the cursor).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from dtkv._agree import register_error
from dtkv._checks import check_int
from dtkv._util import as_int_list
from dtkv.ownership import PageOwnership

if TYPE_CHECKING:
    from dtkv._journal import Journal

__all__ = ["AllocationError", "PageAllocator"]


@register_error
class AllocationError(RuntimeError):
    """A request for pages cannot be met; nothing was allocated."""


class PageAllocator:
    """SPMD allocator: one free list per owner rank of ``ownership``.

    Pages are handed out lowest-first within an owner class (deterministic, and it keeps runs contiguous,
    which helps transfer coalescing). Each allocated page carries a reference count (module docstring).

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
        self._refs = np.zeros(ownership.num_pages, dtype=np.int64)  # 0: free or reserved
        self._cursor = 0
        self.journal: Journal | None = None
        """While set, every change records its undo here (:mod:`dtkv._journal`; the runtime's steps)."""

    # ------------------------------------------------------------------------------------------ queries
    def num_free(self, owner: int | None = None) -> int:
        """Free pages in total, or stored on ``owner``."""
        if owner is None:
            return sum(len(h) for h in self._free)
        self._check_owner("owner", owner)
        return len(self._free[owner])

    def is_free(self, page: int) -> bool:
        """Whether logical ``page`` is free (reserved pages never are)."""
        self._check_page("page", page)
        return bool(self._is_free[page])

    @property
    def reserved(self) -> frozenset[int]:
        """The pages never handed out."""
        return self._reserved

    def refcount(self, page: int) -> int:
        """References held on logical ``page`` (0: free or reserved)."""
        self._check_page("page", page)
        return int(self._refs[page])

    def num_allocated(self) -> int:
        """Distinct pages held by at least one reference: a page shared by many holders counts once."""
        return int(np.count_nonzero(self._refs))

    def digest(self) -> str:
        """A hash of the state (free pages, reference counts, balanced-allocation cursor); equal on every rank
        while the SPMD contract holds (debug checks)."""
        h = hashlib.sha256(bytes(self._is_free))
        h.update(self._refs.tobytes())
        h.update(self._cursor.to_bytes(8, "little"))
        return h.hexdigest()[:16]

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
            self._refs[p] = 1
        if self.journal is not None:
            self.journal.record(lambda: self._unalloc(out))
        return torch.tensor(out, dtype=torch.int64)

    def _unalloc(self, pages: list[int]) -> None:
        """Undo of :meth:`alloc`: the pages are free again (their one reference gone)."""
        for p in pages:
            assert self._refs[p] == 1, f"undo of alloc: page {p} holds {self._refs[p]} references, expected 1"
            self._refs[p] = 0
            self._is_free[p] = 1
            heapq.heappush(self._free[self.ownership.owner(p)], p)

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
        if self.journal is not None:
            before = self._cursor
            self.journal.record(lambda: setattr(self, "_cursor", before))
        self._cursor = r
        return self.alloc(owners)

    def retain(self, pages: Sequence[int] | torch.Tensor) -> None:
        """Add one reference to each allocated page (a new holder shares it); ``-1`` entries are ignored.

        Raises:
            ValueError: a page is outside the pool, reserved, free (allocate it instead) or repeated; nothing
                changes.
        """
        plist = self._check_held("retain", pages, "retained")
        for p in plist:
            self._refs[p] += 1
        if self.journal is not None and plist:
            self.journal.record(lambda: self._unretain(plist))

    def _unretain(self, pages: list[int]) -> None:
        """Undo of :meth:`retain` (every page keeps at least the reference it had before)."""
        for p in pages:
            self._refs[p] -= 1

    def release(self, pages: Sequence[int] | torch.Tensor) -> None:
        """Drop one reference from each page; a page whose last reference goes returns to its owner's free list.
        ``-1`` entries are ignored.

        Raises:
            ValueError: a page is outside the pool, reserved, not allocated (double free) or repeated; nothing
                changes.
        """
        self._release("release", pages, "released")

    def free(self, pages: Sequence[int] | torch.Tensor) -> None:
        """Release the caller's reference to each page (:meth:`release`); a page not shared is free afterwards.

        Raises:
            ValueError: a page is outside the pool, reserved, not allocated (double free) or repeated; nothing
                is freed.
        """
        self._release("free", pages, "freed")

    def _release(self, what: str, pages: Sequence[int] | torch.Tensor, done: str) -> None:
        plist = self._check_held(what, pages, done)
        for p in plist:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free[self.ownership.owner(p)], p)
                self._is_free[p] = 1
        if self.journal is not None and plist:
            self.journal.record(lambda: self._unrelease(plist))

    def _unrelease(self, pages: list[int]) -> None:
        """Undo of a release: each page gets its reference back; a page it had freed leaves the free list."""
        taken: dict[int, set[int]] = {}
        for p in pages:
            if self._refs[p] == 0:
                taken.setdefault(self.ownership.owner(p), set()).add(p)
                self._is_free[p] = 0
            self._refs[p] += 1
        for owner, gone in taken.items():  # rare (a rollback): rebuild the owner's heap without them
            heap = self._free[owner]
            heap[:] = [p for p in heap if p not in gone]
            heapq.heapify(heap)

    def _check_held(self, what: str, pages: Sequence[int] | torch.Tensor, done: str) -> list[int]:
        """Validate every page of a ``retain``/``release``/``free`` call before any changes (all or nothing)."""
        plist = [p for p in as_int_list("pages", pages) if p != -1]
        seen = set()
        for p in plist:
            if not 0 <= p < self.ownership.num_pages:
                raise ValueError(
                    f"{what}(pages) got page {p}, outside the pool's pages [0, {self.ownership.num_pages}); "
                    f"nothing was {done}"
                )
            if p in self._reserved:
                raise ValueError(f"{what}(pages) got page {p}, which is reserved (never allocated); nothing was {done}")
            if self._is_free[p]:
                rule = "allocate a page before sharing it" if what == "retain" else "double free"
                raise ValueError(f"{what}(pages) got page {p}, which is not allocated ({rule}); nothing was {done}")
            if p in seen:
                rule = "one reference per page and call" if what == "retain" else "double free"
                raise ValueError(f"{what}(pages) got page {p} twice ({rule}); nothing was {done}")
            seen.add(p)
        return plist

    def _check_page(self, name: str, page: int) -> None:
        check_int(name, page)
        if not 0 <= page < self.ownership.num_pages:
            raise ValueError(f"{name} must be in [0, {self.ownership.num_pages}), got {name}={page}")

    def _check_owner(self, name: str, owner: int) -> None:
        check_int(name, owner)
        if not 0 <= owner < self.ownership.cp_size:
            raise ValueError(f"{name} must hold ranks in [0, {self.ownership.cp_size}), got {owner}")
