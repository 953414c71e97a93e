"""PageAllocator's inputs and queries: every rejection names the argument, the value and the rule, and leaves
the allocator unchanged; reserved pages stay out of every owner class; ``is_free`` and ``digest`` follow the
free state exactly."""

from __future__ import annotations

import pytest
import torch

from dtkv import AllocationError, PageAllocator, PageOwnership

REJECTED = [
    ("float tensor", lambda a: a.alloc(torch.tensor([0.0])), TypeError,
     "owners must be an integer tensor, got owners.dtype=torch.float32"),
    ("bool tensor", lambda a: a.alloc(torch.tensor([True])), TypeError,
     "owners must be an integer tensor, got owners.dtype=torch.bool"),
    ("bool owner", lambda a: a.alloc([0, True]), TypeError, "owners must hold ints, got True (bool)"),
    ("float owner", lambda a: a.alloc([1.0]), TypeError, "owners must hold ints, got 1.0 (float)"),
    ("owner -1", lambda a: a.alloc([0, -1]), ValueError, "owners must hold ranks in [0, 2), got -1"),
    ("num_free owner", lambda a: a.num_free(2), ValueError, "owner must hold ranks in [0, 2), got 2"),
    ("num_free type", lambda a: a.num_free("0"), TypeError, "owner must be an int, got owner='0' (str)"),
    ("negative n", lambda a: a.alloc_balanced(-1), ValueError, "n must be >= 0, got n=-1"),
    ("float n", lambda a: a.alloc_balanced(1.0), TypeError, "n must be an int, got n=1.0 (float)"),
    ("too many", lambda a: a.alloc_balanced(4), AllocationError,
     "alloc_balanced(n=4) needs 4 free pages, only 3 are free; nothing was allocated"),
    ("free page P", lambda a: a.free([2, 4]), ValueError,
     "free(pages) got page 4, outside the pool's pages [0, 4); nothing was freed"),
    ("free page -2", lambda a: a.free([-2]), ValueError,
     "free(pages) got page -2, outside the pool's pages [0, 4); nothing was freed"),
    ("free float", lambda a: a.free([3.0]), TypeError, "pages must hold ints, got 3.0 (float)"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "call", "exc", "msg"), REJECTED, ids=[r[0] for r in REJECTED])
def test_rejects_bad_input_naming_it_and_leaves_the_allocator_unchanged(what, call, exc, msg):
    alloc = PageAllocator(PageOwnership(2, 4, "block"))  # rank 0 owns 0, 1; rank 1 owns 2, 3
    assert alloc.alloc([1]).tolist() == [2]
    before = (alloc.digest(), [alloc.num_free(r) for r in range(2)])
    with pytest.raises(exc) as e:
        call(alloc)
    assert str(e.value) == msg
    assert (alloc.digest(), [alloc.num_free(r) for r in range(2)]) == before


@pytest.mark.parametrize("reserved", [[4], [-1], [0, 7]])
def test_rejects_reserved_pages_outside_the_pool(reserved):
    with pytest.raises(ValueError) as e:
        PageAllocator(PageOwnership(2, 4), reserved=reserved)
    bad = next(p for p in reserved if not 0 <= p < 4)
    assert str(e.value) == f"reserved must hold pages in [0, 4), got {bad}"


def test_rejects_a_non_ownership():
    with pytest.raises(TypeError) as e:
        PageAllocator(PageOwnership(2, 4).spec)
    assert str(e.value) == "ownership must be a PageOwnership, got OwnershipSpec"


@pytest.mark.parametrize("layout", ["interleave", "block"])
def test_reserved_pages_leave_their_owner_class(layout):
    """Under ``block`` page 0 and page 5 belong to ranks 0 and 1 (3 pages each); neither is ever handed out."""
    own = PageOwnership(2, 6, layout)
    alloc = PageAllocator(own, reserved=torch.tensor([0, 5]))
    assert [alloc.num_free(r) for r in range(2)] == [2, 2]
    assert not alloc.is_free(0) and not alloc.is_free(5) and alloc.is_free(1)
    pages = alloc.alloc([0, 0, 1, 1]).tolist()
    assert sorted(pages) == [1, 2, 3, 4]
    assert [own.owner(p) for p in pages] == [0, 0, 1, 1]
    with pytest.raises(AllocationError):
        alloc.alloc([0])


@pytest.mark.parametrize("layout", ["interleave", "block"])
def test_free_rejects_a_reserved_page(layout):
    alloc = PageAllocator(PageOwnership(2, 6, layout), reserved=[0])
    with pytest.raises(ValueError, match="reserved"):
        alloc.free([0])  # a reserved page was never allocated
    assert 0 not in alloc.alloc_balanced(alloc.num_free()).tolist()


def test_is_free_and_digest_follow_the_free_state():
    own = PageOwnership(3, 7, "block")
    a, b = PageAllocator(own), PageAllocator(own)
    start = a.digest()
    assert len(start) == 16 and int(start, 16) >= 0
    assert [a.is_free(p) for p in range(7)] == [True] * 7
    pages = a.alloc([2, 0]).tolist()
    assert pages == [6, 0]
    assert [a.is_free(p) for p in range(7)] == [p not in pages for p in range(7)]
    assert a.digest() != start
    assert b.alloc(torch.tensor([2, 0], dtype=torch.int32)).tolist() == pages
    assert a.digest() == b.digest()  # same calls, same state
    b.free([6])
    assert a.digest() != b.digest()
    a.free(torch.tensor([6]))
    assert a.digest() == b.digest()
    a.free([0])
    assert a.digest() == start and a.num_free() == 7


def test_empty_requests_allocate_nothing():
    alloc = PageAllocator(PageOwnership(2, 3))
    assert alloc.alloc([]).tolist() == [] and alloc.alloc([]).dtype == torch.int64
    assert alloc.alloc_balanced(0).tolist() == []
    alloc.free([])
    alloc.free([-1, -1])
    assert alloc.num_free() == 3
