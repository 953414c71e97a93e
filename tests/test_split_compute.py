"""Compute owners, the direct-write check and owner-aware allocation of ``dtkv.split``."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase
from hypothesis import given, settings
from hypothesis import strategies as st

from dtkv import AllocationError, PageAllocator, PageOwnership
from dtkv.split import (
    MULTIPLE_COMPUTE_OWNERS,
    allocate_for_split,
    compute_owners,
    compute_pages,
    handoff_pages,
    local_locs,
    plan_cp_split,
    verify_direct_write,
)
from tests.test_split_reference import ref_split


def _prefix_table(allocator: PageAllocator, prefix_lens: list[int], page_size: int) -> torch.Tensor:
    """A page table whose prefix slots hold pages from ``alloc_balanced`` (what earlier steps would leave)."""
    have = [-(-p // page_size) for p in prefix_lens]
    table = torch.full((len(prefix_lens), max(have, default=0)), -1, dtype=torch.int64)
    for i, k in enumerate(have):
        table[i, :k] = allocator.alloc_balanced(k)
    return table


@pytest.mark.parametrize("scheme", ["interleave", "block"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_aligned_batch_without_prefix_writes_directly(cp, scheme):
    ps = 4
    split = plan_cp_split([0, 0, 0], [64, 8 * cp + 3, 41], cp_size=cp, page_size=ps)
    assert split.all_page_aligned
    ownership = PageOwnership(cp, 128, scheme)
    alloc = allocate_for_split(PageAllocator(ownership), split)
    owners = compute_owners(split, alloc.req_pages.shape[1])
    touched = owners >= 0
    assert ownership.owner(alloc.req_pages)[touched].equal(owners[touched])  # storage owner = compute owner
    for r in range(cp):
        assert alloc.verify_direct_write(r)
        assert alloc.handoff_pages(r).numel() == 0
        locs = alloc.local_locs(r)
        assert (ownership.owner(locs // ps) == r).all()


def test_partial_first_page_is_a_handoff_page_of_rank_0():
    """prefix 5 on page 4: slot 1 holds tokens 4..7, 4 of them prefix; segment 0 (rank 0) computes 5..11."""
    ownership = PageOwnership(2, 32)
    split = plan_cp_split([5], [23], cp_size=2, page_size=4)
    for partial_owner, want in [(1, [False, True]), (0, [True, True])]:
        allocator = PageAllocator(ownership)
        table = torch.full((1, 2), -1, dtype=torch.int64)
        table[0] = allocator.alloc([0, partial_owner])
        alloc = allocate_for_split(allocator, split, table)
        partial_page = int(table[0, 1])
        assert alloc.req_pages[0, :2].equal(table[0])
        assert partial_page not in alloc.new_pages[0].tolist()
        assert alloc.new_pages[0].numel() == 5  # slots 2..6
        assert [alloc.verify_direct_write(r) for r in range(2)] == want
        assert alloc.handoff_pages(0).tolist() == ([partial_page] if partial_owner == 1 else [])
        assert alloc.handoff_pages(1).numel() == 0
        # the handoff rows are exactly the rank-0 rows on that page
        locs = alloc.local_locs(0)
        foreign = ownership.owner(locs // 4) != 0
        assert (locs[foreign] // 4 == partial_page).all() and foreign.sum() == (3 if partial_owner == 1 else 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prefix=[2], extend=[7], page_aligned=True, mode="zigzag"),  # fallback (3 < 4 pages)
        dict(prefix=[0], extend=[40], page_aligned=False, mode="zigzag"),  # token-balanced by request
        dict(prefix=[0], extend=[40], page_aligned=True, mode="round_robin"),
    ],
    ids=["fallback", "balanced", "round_robin"],
)
def test_direct_write_never_verified_without_page_alignment(kwargs):
    """Even when every page happens to be stored on the rank computing its tokens (page size 1 or boundaries
    that fall on edges by chance), an unaligned split is never verified."""
    ps = 1 if kwargs["mode"] == "round_robin" else 4
    split = plan_cp_split(
        kwargs["prefix"],
        kwargs["extend"],
        cp_size=2,
        page_size=ps,
        mode=kwargs["mode"],
        page_aligned=kwargs["page_aligned"],
    )
    ownership = PageOwnership(2, 128)
    allocator = PageAllocator(ownership)
    owners = compute_owners(split)
    table = torch.full_like(owners, -1)
    single, multi = owners >= 0, owners == MULTIPLE_COMPUTE_OWNERS
    table[single] = allocator.alloc(owners[single])  # every single-owner page stored on its computing rank
    table[multi] = allocator.alloc_balanced(int(multi.sum()))
    if kwargs["mode"] == "round_robin":
        assert single.all()  # page size 1: each page is computed by one rank, yet not "aligned"
    assert not split.page_aligned.any()
    for r in range(2):
        assert not verify_direct_write(split, r, table, ownership)
        assert not verify_direct_write(split, r, table, ownership, req_idx=0)


def test_foreign_page_fails_verification():
    ownership = PageOwnership(4, 64)
    allocator = PageAllocator(ownership)
    split = plan_cp_split([0, 0], [64, 37], cp_size=4, page_size=4)
    alloc = allocate_for_split(allocator, split)
    table = alloc.req_pages.clone()
    assert all(verify_direct_write(split, r, table, ownership) for r in range(4))
    slot = int((compute_owners(split)[1] == 2).nonzero()[0])  # a page rank 2 computes in request 1
    table[1, slot] = allocator.alloc([3])[0]
    assert not verify_direct_write(split, 2, table, ownership)
    assert not verify_direct_write(split, 2, table, ownership, req_idx=1)
    assert verify_direct_write(split, 2, table, ownership, req_idx=0)
    assert handoff_pages(split, 2, table, ownership).tolist() == [int(table[1, slot])]
    assert all(verify_direct_write(split, r, table, ownership) for r in (0, 1, 3))


@settings(max_examples=40, deadline=None)
@given(
    cp=st.integers(1, 4),
    ps=st.sampled_from([1, 3, 4, 8]),
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 90)), min_size=1, max_size=5),
    scheme=st.sampled_from(["interleave", "block"]),
)
def test_allocation_properties(cp, ps, reqs, scheme):
    """Aligned requests: new pages stored on their compute owner, handoff only the partly filled first page.
    Fallback requests: pages from alloc_balanced. Locations and computed pages agree with a per-token reference."""
    prefix, extend = [p for p, _ in reqs], [n for _, n in reqs]
    ownership = PageOwnership(cp, 1024, scheme)
    allocator = PageAllocator(ownership)
    table = _prefix_table(allocator, prefix, ps)
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps)
    free_before = allocator.num_free()
    alloc = allocate_for_split(allocator, split, table)
    assert free_before - allocator.num_free() == sum(t.numel() for t in alloc.new_pages)
    owners = compute_owners(split, alloc.req_pages.shape[1])
    ref = ref_split(prefix, extend, cp, ps)
    for i, (p, n) in enumerate(reqs):
        have, need = -(-p // ps), -(-(p + n) // ps)
        row = alloc.req_pages[i]
        assert row[:have].equal(table[i, :have])
        assert alloc.new_pages[i].equal(row[have:need]) and (row[have:need] >= 0).all()
        assert (row[max(have, need) :] == -1).all()
        if split.page_aligned[i]:
            assert ownership.owner(row[have:need]).equal(owners[i, have:need])
            partial = [int(row[p // ps])] if p % ps else []
            handoff = {int(x) for r in range(cp) for x in alloc.handoff_pages(r, req_idx=i)}
            assert handoff <= set(partial)
            for r in range(cp):
                assert alloc.verify_direct_write(r, req_idx=i) == (alloc.handoff_pages(r, req_idx=i).numel() == 0)
        else:
            assert all(not alloc.verify_direct_write(r, req_idx=i) for r in range(cp))
    for r in range(cp):
        want_locs = [
            int(alloc.req_pages[req, pos // ps]) * ps + pos % ps for req, pos in zip(ref.req_of[r], ref.positions[r])
        ]
        assert alloc.local_locs(r).tolist() == want_locs
        want_pages = []
        for req, pos in zip(ref.req_of[r], ref.positions[r]):
            page = int(alloc.req_pages[req, pos // ps])
            if (req, page) not in {(q, x) for q, x in want_pages}:
                want_pages.append((req, page))
        got = compute_pages(split, r, alloc.req_pages).tolist()
        assert sorted(got) == sorted(x for _, x in want_pages)


def test_allocation_failure_leaves_allocator_unchanged():
    allocator = PageAllocator(PageOwnership(2, 10))
    prefix_page = allocator.alloc([0])
    digest = allocator.digest()
    # 8 pages from their compute owners (4 a rank: fits), then 2 balanced pages (only 1 left: fails)
    split = plan_cp_split([0, 2], [16, 3], cp_size=2, page_size=2)
    assert split.page_aligned.tolist() == [True, False]
    with pytest.raises(AllocationError):
        allocate_for_split(allocator, split, torch.tensor([[-1], [int(prefix_page[0])]]))
    assert allocator.digest() == digest
    with pytest.raises(AllocationError):  # the owned step alone fails
        allocate_for_split(allocator, plan_cp_split([0], [20], cp_size=2, page_size=2))
    assert allocator.digest() == digest


@pytest.mark.parametrize(
    "cp,num_pages,scheme,taken,prefix,extend,page_size",
    [
        (8, 49, "block", 0, [0], [64], 4),  # rank 7 stores no page; 16 aligned pages, two computed by rank 7
        (4, 9, "block", 0, [0], [8], 1),  # rank 3 stores no page (pages_per_rank 3)
        (4, 64, "interleave", 12, [0, 0], [64, 64], 4),  # rank 0 has 4 of its 16 pages left for 8 slots
    ],
    ids=["cp8-49-pages", "cp4-9-pages", "exhausted-owner"],
)
def test_allocation_with_a_short_compute_owner_falls_back_to_balanced_pages(
    cp, num_pages, scheme, taken, prefix, extend, page_size
):
    """A compute owner that stores no page (or has none left) gets its slots' pages from alloc_balanced: they
    become its handoff pages, every other rank still writes directly, and nothing fails while pages are free."""
    ownership = PageOwnership(cp, num_pages, scheme)
    allocator = PageAllocator(ownership)
    allocator.alloc([0] * taken)
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=page_size)
    assert split.all_page_aligned
    free_before = [allocator.num_free(r) for r in range(cp)]
    total_free = allocator.num_free()
    alloc = allocate_for_split(allocator, split)
    new = torch.cat(alloc.new_pages)
    assert new.numel() == len(set(new.tolist())) == total_free - allocator.num_free()
    owners = compute_owners(split, alloc.req_pages.shape[1])
    on_owner = ownership.owner(alloc.req_pages) == owners
    valid = owners >= 0
    for r in range(cp):
        short = valid & (owners == r) & ~on_owner  # rank r's slots placed elsewhere
        wanted = int((valid & (owners == r)).sum())
        assert int(short.sum()) == max(0, wanted - free_before[r])  # only beyond the owner's free pages
        assert sorted(alloc.handoff_pages(r).tolist()) == sorted(alloc.req_pages[short].tolist())
        assert alloc.verify_direct_write(r) == (int(short.sum()) == 0)
    assert any(not alloc.verify_direct_write(r) for r in range(cp))  # the case really has a short owner
    # the handoff rows of a short owner are exactly its local rows on foreign pages
    for r in range(cp):
        locs = alloc.local_locs(r)
        foreign = ownership.owner(locs // page_size) != r
        assert set((locs[foreign] // page_size).tolist()) == set(alloc.handoff_pages(r).tolist())


def test_local_locs_on_other_dtypes_and_debug_check():
    from dtkv import debug_mode

    split = plan_cp_split([0], [8], cp_size=2, page_size=4)
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    assert local_locs(split, 0, table).tolist() == [20, 21, 10, 11]
    with debug_mode(), pytest.raises(ValueError, match=r"req_pages\[0, 1\]=-1"):
        local_locs(split, 0, torch.tensor([[5, -1]]))


class TestRejects(TestCase):
    def _msg(self, exc_type, fn, *args, **kwargs) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception)

    def test_rejects_bad_page_tables(self):
        split = plan_cp_split([5, 0], [23, 4], cp_size=2, page_size=4)
        own = PageOwnership(2, 64)
        self.assertExpectedInline(
            self._msg(TypeError, compute_pages, split, 0, torch.zeros(2, 6)),
            """req_pages must have dtype [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8], got req_pages.dtype=torch.float32""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, compute_pages, split, 0, torch.zeros(2, 6, dtype=torch.int64)),
            """req_pages must have a column for every slot the extend touches, got req_pages.shape=[2, 6] but request 0 touches slot 6""",
        )
        bad = torch.arange(14).reshape(2, 7)
        bad[1, 0] = -1
        self.assertExpectedInline(
            self._msg(ValueError, compute_pages, split, 0, bad),
            """req_pages must hold a page for every slot the extend touches, got req_pages[1, 0]=-1""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, compute_pages, split, 0, torch.zeros(3, 7, dtype=torch.int64)),
            """req_pages must have one row per request ([num_reqs=2, max_pages]), got req_pages.shape=[3, 7]""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, compute_owners, split, 6),
            """max_pages must cover every touched slot, got max_pages=6 but request 0 touches slots up to 6 (prefix_len=5, extend_len=23, page_size=4)""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, verify_direct_write, split, 0, bad, PageOwnership(4, 64)),
            """ownership.cp_size must equal split.cp_size, got 4 and 2""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, handoff_pages, split, 0, bad, "interleave"),
            """ownership must be a PageOwnership, got str""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, verify_direct_write, split, 0, bad, own, req_idx=2),
            """req_idx must be < num_reqs=2, got req_idx=2""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, local_locs, split, 0, torch.zeros(1, 7, dtype=torch.int64)),
            """req_pages must have one row per request ([num_reqs=2, max_pages]), got req_pages.shape=[1, 7]""",
        )

    def test_rejects_bad_allocation_inputs(self):
        split = plan_cp_split([5, 0], [23, 4], cp_size=2, page_size=4)
        allocator = PageAllocator(PageOwnership(2, 64))
        self.assertExpectedInline(
            self._msg(ValueError, allocate_for_split, allocator, split),
            """req_pages must be given when a request has a prefix, got req_pages=None and prefix_lens[0]=5""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, allocate_for_split, allocator, split, torch.tensor([[3, -1], [-1, -1]])),
            """req_pages must hold a page in every prefix slot, got req_pages[0, 1]=-1""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, allocate_for_split, allocator, split, torch.tensor([[3, 4, 9], [-1, -1, -1]])),
            """req_pages must be -1 in every slot the extend allocates, got req_pages[0, 2]=9""",
        )
        self.assertExpectedInline(
            self._msg(
                ValueError,
                allocate_for_split,
                PageAllocator(PageOwnership(4, 64)),
                split,
                torch.tensor([[3, 4], [-1, -1]]),
            ),
            """allocator.ownership.cp_size must equal split.cp_size, got 4 and 2""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, allocate_for_split, "allocator", split),
            """allocator must be a PageAllocator, got str""",
        )
