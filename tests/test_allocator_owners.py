"""PageAllocator per owner class, under both ownership layouts and across many calls on one allocator.

Every check compares with a brute-force model built only from the module table of :mod:`dtkv.ownership` (no
code shared with the allocator): one set of free pages per owner rank, lowest page first. Under ``interleave``
``page % cp`` is the owner, so a ``free()`` that files a page by ``page % cp`` is only caught under ``block``;
every test here runs both layouts, with empty ranks (``block``, ``cp=4``, 9 pages) and partial last chunks.
"""

from __future__ import annotations

import pytest
import torch

from dtkv import AllocationError, PageAllocator, PageOwnership

LAYOUTS = ["interleave", "block"]
# (cp, num_pages): cp=1, primes, a partial last chunk, an empty rank under block (4, 9), more ranks than pages.
SIZES = [(1, 5), (2, 7), (3, 13), (4, 9), (4, 10), (3, 2)]


def _ref_owner(page: int, cp: int, num_pages: int, layout: str) -> int:
    """The module table, written out: ``p % cp`` or ``p // ceil(P / cp)``."""
    return page % cp if layout == "interleave" else page // -(-num_pages // cp)


class _RefFree:
    """Brute-force free lists: a set of free pages per owner rank; allocation takes the lowest page."""

    def __init__(self, cp: int, num_pages: int, layout: str) -> None:
        self.cp, self.num_pages, self.layout = cp, num_pages, layout
        self.free = [{p for p in range(num_pages) if _ref_owner(p, cp, num_pages, layout) == r} for r in range(cp)]

    def owner(self, page: int) -> int:
        return _ref_owner(page, self.cp, self.num_pages, self.layout)

    def alloc(self, owners: list[int]) -> list[int]:
        out = []
        for o in owners:
            page = min(self.free[o])
            self.free[o].remove(page)
            out.append(page)
        return out

    def take(self, pages: list[int]) -> None:
        for p in pages:
            self.free[self.owner(p)].remove(p)

    def give_back(self, pages: list[int]) -> None:
        for p in pages:
            self.free[self.owner(p)].add(p)


def _assert_same_state(alloc: PageAllocator, ref: _RefFree) -> None:
    got = [alloc.num_free(r) for r in range(ref.cp)]
    assert got == [len(s) for s in ref.free], f"free pages per owner {got}, reference {[len(s) for s in ref.free]}"
    free_pages = {p for s in ref.free for p in s}
    assert [alloc.is_free(p) for p in range(ref.num_pages)] == [p in free_pages for p in range(ref.num_pages)]
    assert alloc.num_free() == len(free_pages)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp,num_pages", SIZES)
def test_free_returns_each_page_to_its_owners_list(cp, num_pages, layout):
    """Free a scattered subset, then ask each owner for exactly its freed pages: they come back, and only they."""
    own = PageOwnership(cp, num_pages, layout)
    alloc, ref = PageAllocator(own), _RefFree(cp, num_pages, layout)
    owners = [r for r in range(cp) for _ in range(len(ref.free[r]))]
    pages = alloc.alloc(owners).tolist()
    assert pages == ref.alloc(owners)
    _assert_same_state(alloc, ref)

    freed = [p for p in pages if p % 3 != 1] or pages[:1]  # every owner class loses some pages, not all
    alloc.free(freed)
    ref.give_back(freed)
    _assert_same_state(alloc, ref)

    again = [ref.owner(p) for p in sorted(freed, reverse=True)]  # requested in an order unlike the free order
    got = alloc.alloc(again).tolist()
    assert [ref.owner(p) for p in got] == again, "alloc(owners) handed out a page another rank owns"
    assert got == ref.alloc(again)
    assert sorted(got) == sorted(freed)
    _assert_same_state(alloc, ref)
    with pytest.raises(AllocationError):
        alloc.alloc([again[0]])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp,num_pages", [(2, 11), (3, 13), (4, 9), (4, 23)])
@pytest.mark.parametrize("seed", [0, 1])
def test_alloc_free_sequence_matches_the_reference_model(cp, num_pages, layout, seed):
    """A seeded mix of ``alloc(owners)``, ``alloc_balanced`` and ``free``; the state is compared after each call."""
    own = PageOwnership(cp, num_pages, layout)
    alloc, ref = PageAllocator(own), _RefFree(cp, num_pages, layout)
    g = torch.Generator().manual_seed(seed)
    live: list[int] = []
    for _ in range(40):
        op = int(torch.randint(0, 3, (1,), generator=g))
        if op == 0:  # alloc(owners) for owners that still have pages
            avail = [r for r in range(cp) for _ in range(len(ref.free[r]))]
            if not avail:
                continue
            pick = torch.randperm(len(avail), generator=g)[: int(torch.randint(1, 4, (1,), generator=g))]
            owners = [avail[i] for i in pick.tolist()]
            got = alloc.alloc(torch.tensor(owners)).tolist()
            assert got == ref.alloc(owners)
            live += got
        elif op == 1:  # alloc_balanced: distinct pages that were free
            n = int(torch.randint(0, min(4, alloc.num_free()) + 1, (1,), generator=g))
            got = alloc.alloc_balanced(n).tolist()
            assert len(set(got)) == n and all(p in ref.free[ref.owner(p)] for p in got)
            ref.take(got)
            live += got
        elif live:  # free a random part of the live pages, -1 padding mixed in
            pick = torch.randperm(len(live), generator=g)[: int(torch.randint(1, len(live) + 1, (1,), generator=g))]
            freed = [live[i] for i in pick.tolist()]
            alloc.free(freed + [-1])
            ref.give_back(freed)
            live = [p for p in live if p not in freed]
        _assert_same_state(alloc, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize(
    "sizes", [[1] * 4, [5] * 4, [1, 2, 3, 5, 7], [3] * 7, [0, 1, 0, 1, 1]], ids=["1x4", "5x4", "mixed", "3x7", "zeros"]
)
def test_balanced_alloc_stays_balanced_across_calls(cp, layout, sizes):
    """Per-owner totals over repeated calls on ONE allocator differ by at most one (the rotation carries over)."""
    num_pages = cp * 11 + 1  # enough for every sequence below: no owner runs out
    own = PageOwnership(cp, num_pages, layout)
    alloc = PageAllocator(own)
    counts, seen = [0] * cp, set()
    for n in sizes:
        pages = alloc.alloc_balanced(n).tolist()
        assert len(pages) == n and not seen & set(pages)
        seen |= set(pages)
        for p in pages:
            counts[_ref_owner(p, cp, num_pages, layout)] += 1
        assert max(counts) - min(counts) <= 1, f"per-owner totals {counts} after calls {sizes}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp,num_pages", [(4, 9), (3, 7), (4, 10), (2, 3)])
def test_balanced_alloc_skips_exhausted_owners_and_stays_balanced_among_the_rest(cp, num_pages, layout):
    """One page per call until the pool is empty: an owner that still has free pages is never more than one page
    behind the busiest owner (empty ranks and short last chunks are skipped, not waited for)."""
    own = PageOwnership(cp, num_pages, layout)
    alloc = PageAllocator(own)
    counts = [0] * cp
    for _ in range(num_pages):
        (page,) = alloc.alloc_balanced(1).tolist()
        counts[_ref_owner(page, cp, num_pages, layout)] += 1
        for r in range(cp):
            if alloc.num_free(r):
                assert counts[r] >= max(counts) - 1, f"owner {r} fell behind: {counts}"
    assert alloc.num_free() == 0
    with pytest.raises(AllocationError):
        alloc.alloc_balanced(1)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_balanced_alloc_on_a_fresh_interleave_pool_hands_out_consecutive_pages(cp):
    """The rotation runs upward (0, 1, ..., cp-1, 0, ...), so under ``interleave`` successive balanced requests get
    consecutive logical pages: a request's pages form one run, the case transfer coalescing merges best."""
    alloc = PageAllocator(PageOwnership(cp, 40))
    got = [alloc.alloc_balanced(n).tolist() for n in (3, 5, 1, 7)]
    assert got == [[0, 1, 2], [3, 4, 5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15]]
