"""PageAllocator: owner-classed, all-or-nothing, deterministic (SPMD)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_utils import TestCase

from dtkv import AllocationError, PageAllocator, PageOwnership


@pytest.mark.parametrize("scheme", ["interleave", "block"])
@pytest.mark.parametrize("cp,num_pages", [(1, 1), (2, 7), (3, 13), (4, 10)])
def test_alloc_returns_pages_of_the_requested_owner(cp, num_pages, scheme):
    own = PageOwnership(cp, num_pages, scheme)
    alloc = PageAllocator(own)
    owners = [r for r in range(cp) for _ in range(own.num_local_pages(r))]
    pages = alloc.alloc(owners)
    assert torch.equal(own.owner(pages), torch.tensor(owners))
    assert sorted(pages.tolist()) == list(range(num_pages))
    assert alloc.num_free() == 0


def test_alloc_is_all_or_nothing():
    own = PageOwnership(2, 5)  # rank 0 owns 0, 2, 4; rank 1 owns 1, 3
    alloc = PageAllocator(own)
    before = alloc.digest()
    with pytest.raises(AllocationError, match="owned by rank 1"):
        alloc.alloc([0, 1, 1, 1])
    assert alloc.digest() == before and alloc.num_free() == 5
    assert alloc.alloc([1, 1]).tolist() == [1, 3]
    with pytest.raises(AllocationError):
        alloc.alloc_balanced(4)
    assert alloc.num_free() == 3


def test_free_rejects_double_foreign_and_repeated_pages_atomically():
    alloc = PageAllocator(PageOwnership(2, 6))
    pages = alloc.alloc([0, 1, 0])
    alloc.free(pages[:1])
    snapshot = alloc.digest()
    with pytest.raises(ValueError, match="double free"):
        alloc.free([int(pages[1]), int(pages[0])])
    with pytest.raises(ValueError, match="outside the pool"):
        alloc.free([int(pages[1]), 6])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([int(pages[1]), int(pages[1])])
    assert alloc.digest() == snapshot
    alloc.free(torch.tensor([-1, int(pages[1])]))  # -1 padding is ignored
    assert alloc.num_free() == 5


@settings(max_examples=40, deadline=None)
@given(cp=st.sampled_from([1, 2, 3, 4, 8]), num_pages=st.integers(1, 200), data=st.data())
def test_balanced_alloc_spreads_pages_and_is_deterministic(cp, num_pages, data):
    own = PageOwnership(cp, num_pages)
    a, b = PageAllocator(own), PageAllocator(own)
    n = data.draw(st.integers(0, num_pages))
    pa, pb = a.alloc_balanced(n), b.alloc_balanced(n)
    assert torch.equal(pa, pb) and a.digest() == b.digest()  # SPMD: same calls, same state
    counts = torch.bincount(own.owner(pa), minlength=cp) if n else torch.zeros(cp, dtype=torch.int64)
    assert int(counts.max() - counts.min()) <= 1
    assert len(set(pa.tolist())) == n


def test_reserved_pages_are_never_handed_out():
    alloc = PageAllocator(PageOwnership(2, 4), reserved=[0])
    assert sorted(alloc.alloc_balanced(3).tolist()) == [1, 2, 3]


class TestAllocatorErrors(TestCase):
    def test_error_text(self):
        alloc = PageAllocator(PageOwnership(2, 4))
        with self.assertRaises(AllocationError) as e:
            alloc.alloc([0, 0, 0])
        self.assertExpectedInline(
            str(e.exception),
            """alloc(owners) asked for 3 pages owned by rank 0, but only 2 are free (free per owner: [2, 2]); nothing was allocated""",
        )
        with self.assertRaises(ValueError) as e:
            alloc.alloc([2])
        self.assertExpectedInline(str(e.exception), """owners must hold ranks in [0, 2), got 2""")
        with self.assertRaises(ValueError) as e:
            alloc.free([1])
        self.assertExpectedInline(
            str(e.exception),
            """free(pages) got page 1, which is not allocated (double free); nothing was freed""",
        )


# ----------------------------------------------------------------------------------------- reserved pages
@pytest.mark.parametrize("scheme", ["interleave", "block"])
def test_free_rejects_a_reserved_page_and_never_hands_it_out(scheme):
    """A reserved page is not allocated: freeing it is an error, and it must not enter a free list (it used to,
    and was then handed out)."""
    own = PageOwnership(2, 6, scheme)
    alloc = PageAllocator(own, reserved=[0, 5])
    assert alloc.num_free() == 4
    pages = alloc.alloc_balanced(4)
    snapshot = alloc.digest()
    for bad in ([0], torch.tensor([int(pages[0]), 5])):
        with pytest.raises(ValueError, match="which is reserved"):
            alloc.free(bad)
        assert alloc.digest() == snapshot and alloc.num_free() == 0  # nothing freed
    alloc.free(pages)
    assert sorted(alloc.alloc_balanced(4).tolist()) == [1, 2, 3, 4]
    assert not alloc.is_free(0) and not alloc.is_free(5)
    assert alloc.reserved == frozenset({0, 5})


def test_is_free_checks_the_page_range():
    alloc = PageAllocator(PageOwnership(2, 4))
    with pytest.raises(ValueError, match=r"page must be in \[0, 4\), got page=-1"):
        alloc.is_free(-1)  # used to read the last page's flag
    with pytest.raises(ValueError, match="got page=4"):
        alloc.is_free(4)


# ----------------------------------------------------------------------------------------- both schemes
@pytest.mark.parametrize("scheme", ["interleave", "block"])
@pytest.mark.parametrize("cp,num_pages", [(2, 7), (3, 4), (3, 13), (4, 10), (8, 49)])
def test_per_owner_free_counts_after_alloc_free_and_realloc(cp, num_pages, scheme):
    """Owner-classed accounting under both schemes, including ranks that store no page (block 3/4, 8/49)."""
    own = PageOwnership(cp, num_pages, scheme)
    alloc = PageAllocator(own)
    capacity = [own.num_local_pages(r) for r in range(cp)]
    assert [alloc.num_free(r) for r in range(cp)] == capacity
    # take every page of every owner, in owner order, then give back every other one
    owners = [r for r in range(cp) for _ in range(capacity[r])]
    pages = alloc.alloc(owners)
    assert [alloc.num_free(r) for r in range(cp)] == [0] * cp
    back = pages[::2]
    alloc.free(back)
    freed_per_owner = torch.bincount(own.owner(back), minlength=cp).tolist()
    assert [alloc.num_free(r) for r in range(cp)] == freed_per_owner
    assert all(alloc.is_free(int(p)) for p in back) and not any(alloc.is_free(int(p)) for p in pages[1::2])
    # re-alloc from each owner gives back exactly its freed pages, lowest first
    for r in range(cp):
        got = alloc.alloc([r] * freed_per_owner[r])
        assert got.tolist() == sorted(p for p in back.tolist() if own.owner(p) == r)
        assert alloc.num_free(r) == 0
    empty = [r for r in range(cp) if capacity[r] == 0]
    for r in empty:  # a rank that stores no page is an empty owner class, not an error of the allocator
        with pytest.raises(AllocationError, match=f"owned by rank {r}, but only 0 are free"):
            alloc.alloc([r])
    alloc.free(pages)
    assert alloc.num_free() == num_pages
    assert sorted(alloc.alloc_balanced(num_pages).tolist()) == list(range(num_pages))


@settings(max_examples=60, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    num_pages=st.integers(1, 120),
    scheme=st.sampled_from(["interleave", "block"]),
    sizes=st.lists(st.integers(0, 17), max_size=40),
)
def test_repeated_balanced_allocs_keep_owner_counts_within_one(cp, num_pages, scheme, sizes):
    """Whatever the sizes of successive alloc_balanced calls, the pages handed out per owner stay within one of
    each other among owners that still have free pages (the cursor carries over between calls); an exhausted
    owner has handed out all it has. Two allocators fed the same calls agree (SPMD)."""
    own = PageOwnership(cp, num_pages, scheme)
    a, b = PageAllocator(own), PageAllocator(own)
    capacity = [own.num_local_pages(r) for r in range(cp)]
    given_out = [0] * cp
    for n in [*sizes, num_pages]:  # the last call takes whatever is left
        n = min(n, a.num_free())
        pa = a.alloc_balanced(n)
        assert torch.equal(pa, b.alloc_balanced(n))
        for r, c in enumerate(torch.bincount(own.owner(pa), minlength=cp).tolist() if n else [0] * cp):
            given_out[r] += c
        open_owners = [given_out[r] for r in range(cp) if given_out[r] < capacity[r]]
        if open_owners:
            assert max(open_owners) - min(open_owners) <= 1, (given_out, capacity)
            assert all(g <= min(open_owners) + 1 for g in given_out)  # no owner ran ahead of an open one
        assert [a.num_free(r) for r in range(cp)] == [capacity[r] - given_out[r] for r in range(cp)]
    assert a.digest() == b.digest() and given_out == capacity
