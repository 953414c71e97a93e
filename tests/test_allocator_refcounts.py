"""PageAllocator reference counts: a page is free only when its last holder lets go; every call is all or nothing.

The property test drives random (valid and invalid) ``alloc`` / ``alloc_balanced`` / ``retain`` / ``release`` /
``free`` calls against an independent model (a dict page -> references) and checks after every call that the
allocator agrees with it: no leak (a page with no holder is free, and every page comes back at the end), no double
free (releasing a free page raises), and a rejected call changes nothing (same digest, same counts).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dtkv import AllocationError, PageAllocator, PageOwnership


def test_retain_and_release_share_a_page_until_its_last_holder_goes():
    alloc = PageAllocator(PageOwnership(2, 6))
    page = int(alloc.alloc([1])[0])
    assert alloc.refcount(page) == 1 and alloc.num_allocated() == 1
    alloc.retain([page])
    alloc.retain(torch.tensor([page, -1]))  # -1 padding is ignored
    assert alloc.refcount(page) == 3 and alloc.num_allocated() == 1  # one page, three holders: counted once
    alloc.free([page])  # free drops one reference, like release
    alloc.release([page])
    assert alloc.refcount(page) == 1 and not alloc.is_free(page) and alloc.num_free(1) == 2
    alloc.release([page])
    assert alloc.refcount(page) == 0 and alloc.is_free(page) and alloc.num_free(1) == 3
    assert alloc.alloc([1]).tolist() == [page]  # back on its owner's free list, lowest first


REJECTED = [
    ("retain free page", lambda a: a.retain([3]), "retain(pages) got page 3, which is not allocated "
     "(allocate a page before sharing it); nothing was retained"),
    ("retain repeated", lambda a: a.retain([0, 0]), "retain(pages) got page 0 twice "
     "(one reference per page and call); nothing was retained"),
    ("retain outside", lambda a: a.retain([0, 6]), "retain(pages) got page 6, outside the pool's pages [0, 6); "
     "nothing was retained"),
    ("retain reserved", lambda a: a.retain([5]), "retain(pages) got page 5, which is reserved (never allocated); "
     "nothing was retained"),
    ("release free page", lambda a: a.release([0, 3]), "release(pages) got page 3, which is not allocated "
     "(double free); nothing was released"),
    ("release repeated", lambda a: a.release([1, 1]), "release(pages) got page 1 twice (double free); "
     "nothing was released"),
    ("free repeated", lambda a: a.free([1, 1]), "free(pages) got page 1 twice (double free); nothing was freed"),
    ("refcount range", lambda a: a.refcount(6), "page must be in [0, 6), got page=6"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "call", "msg"), REJECTED, ids=[r[0] for r in REJECTED])
def test_rejects_bad_pages_naming_them_and_changes_nothing(what, call, msg):
    alloc = PageAllocator(PageOwnership(2, 6), reserved=[5])
    alloc.alloc([0, 1])  # pages 0 and 1
    alloc.retain([1])
    before = (alloc.digest(), [alloc.refcount(p) for p in range(6)], alloc.num_free())
    with pytest.raises(ValueError) as e:
        call(alloc)
    assert str(e.value) == msg
    assert (alloc.digest(), [alloc.refcount(p) for p in range(6)], alloc.num_free()) == before


def test_digest_follows_references_not_only_the_free_state():
    a, b = PageAllocator(PageOwnership(2, 4)), PageAllocator(PageOwnership(2, 4))
    for x in (a, b):
        x.alloc([0])
    assert a.digest() == b.digest()
    a.retain([0])
    assert a.digest() != b.digest()  # same free pages, different holders: ranks must not look equal
    a.release([0])
    assert a.digest() == b.digest()


class RefcountMachine(RuleBasedStateMachine):
    """Random calls against the model ``refs`` (page -> references; absent = free)."""

    @initialize(
        cp=st.sampled_from([1, 2, 3, 4]),
        num_pages=st.integers(1, 24),
        scheme=st.sampled_from(["interleave", "block"]),
        reserve=st.booleans(),
    )
    def setup(self, cp, num_pages, scheme, reserve):
        self.own = PageOwnership(cp, num_pages, scheme)
        self.reserved = {num_pages - 1} if reserve and num_pages > 1 else set()
        self.alloc = PageAllocator(self.own, reserved=sorted(self.reserved))
        self.refs: dict[int, int] = {}
        self.usable = num_pages - len(self.reserved)

    def _snapshot(self):
        return self.alloc.digest(), [self.alloc.num_free(r) for r in range(self.own.cp_size)]

    def _expect_rejected(self, call, exc):
        before = self._snapshot()
        with pytest.raises(exc):
            call()
        assert self._snapshot() == before, "a rejected call changed the allocator"

    @rule(data=st.data())
    def alloc_owners(self, data):
        owners = data.draw(st.lists(st.integers(0, self.own.cp_size - 1), max_size=6))
        free = [len([p for p in self._free_pages() if self.own.owner(p) == r]) for r in range(self.own.cp_size)]
        if any(owners.count(r) > free[r] for r in range(self.own.cp_size)):
            self._expect_rejected(lambda: self.alloc.alloc(owners), AllocationError)
            return
        pages = self.alloc.alloc(owners).tolist()
        assert [self.own.owner(p) for p in pages] == owners
        for p in pages:
            assert p not in self.refs and p not in self.reserved, f"page {p} handed out while held or reserved"
            self.refs[p] = 1

    @rule(n=st.integers(0, 8))
    def alloc_balanced(self, n):
        if n > len(self._free_pages()):
            self._expect_rejected(lambda: self.alloc.alloc_balanced(n), AllocationError)
            return
        for p in self.alloc.alloc_balanced(n).tolist():
            assert p not in self.refs and p not in self.reserved
            self.refs[p] = 1

    @rule(data=st.data(), which=st.sampled_from(["retain", "release", "free"]))
    def change_references(self, data, which):
        pages = data.draw(st.lists(st.integers(-1, self.own.num_pages), max_size=5))
        real = [p for p in pages if p != -1]
        bad = len(set(real)) < len(real) or any(
            not 0 <= p < self.own.num_pages or p in self.reserved or p not in self.refs for p in real
        )
        call = getattr(self.alloc, which)
        if bad:
            self._expect_rejected(lambda: call(pages), ValueError)
            return
        call(pages)
        for p in real:
            self.refs[p] += 1 if which == "retain" else -1
            if self.refs[p] == 0:
                del self.refs[p]

    @precondition(lambda self: bool(getattr(self, "refs", None)))
    @rule(data=st.data())
    def release_a_held_page(self, data):
        p = data.draw(st.sampled_from(sorted(self.refs)))
        self.alloc.release([p])
        self.refs[p] -= 1
        if not self.refs[p]:
            del self.refs[p]

    def _free_pages(self):
        return [p for p in range(self.own.num_pages) if p not in self.refs and p not in self.reserved]

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "alloc"):
            return
        for p in range(self.own.num_pages):
            assert self.alloc.refcount(p) == self.refs.get(p, 0), p
            assert self.alloc.is_free(p) == (p not in self.refs and p not in self.reserved), p
        assert self.alloc.num_free() == len(self._free_pages())
        assert self.alloc.num_allocated() == len(self.refs)

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for p, n in list(self.refs.items()):  # every holder lets go: every usable page is free again (no leak)
            for _ in range(n):
                self.alloc.release([p])
        assert self.alloc.num_free() == self.usable and self.alloc.num_allocated() == 0


TestRefcountMachine = RefcountMachine.TestCase
TestRefcountMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
