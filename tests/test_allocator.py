"""PageAllocator: owner-classed, all-or-nothing, deterministic (SPMD)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_utils import TestCase

from dtkv import AllocationError, PageAllocator, PageOwnership


@pytest.mark.parametrize("layout", ["interleave", "block"])
@pytest.mark.parametrize("cp,num_pages", [(1, 1), (2, 7), (3, 13), (4, 10)])
def test_alloc_returns_pages_of_the_requested_owner(cp, num_pages, layout):
    own = PageOwnership(cp, num_pages, layout)
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
