"""Sharded decode planning: owned pages per request vs a brute-force loop, owner-balanced decode pages, bad input
rejected with nothing planned or allocated, and the traffic formulas against the numbers the docs quote."""

from __future__ import annotations

import pytest
import torch

from dtkv import AllocationError, PageAllocator, PageOwnership
from dtkv._util import cdiv
from dtkv.decode import alloc_decode_pages, full_view_comm_bytes, plan_decode, sharded_decode_comm_bytes


def _brute_force(tables, lens, own, rank, ps):
    """Per request: the owned page slots in order, their local pages, and slot -> local page or -1."""
    out = []
    for pages, n in zip(tables, lens):
        need = cdiv(n, ps)
        slots = [j for j in range(need) if own.owner(pages[j]) == rank]
        local = [own.local_index(pages[j]) for j in slots]
        slot_map = [own.local_index(pages[j]) if j in slots else -1 for j in range(need)]
        loc = pages[(n - 1) // ps] * ps + (n - 1) % ps
        out.append((slots, local, slot_map, loc))
    return out


@pytest.mark.parametrize(
    "cp,scheme,ps", [(1, "interleave", 4), (2, "interleave", 1), (3, "block", 3), (4, "interleave", 5)]
)
def test_plan_decode_vs_brute_force(cp, scheme, ps):
    own = PageOwnership(cp, 60, scheme)
    g = torch.Generator().manual_seed(cp * 7 + ps)
    lens = [1, ps, ps + 1, 3 * ps - 1, 11 * ps]  # one token, a full page, a partial page, ...
    tables = [torch.randperm(60, generator=g)[: cdiv(n, ps) + (i % 2)].tolist() for i, n in enumerate(lens)]
    for rank in range(cp):
        plan = plan_decode(tables, lens, own, rank, page_size=ps, topk=8)
        assert plan.query_pos.tolist() == [n - 1 for n in lens]
        width = plan.owned_slots.shape[1]
        for b, (slots, local, slot_map, loc) in enumerate(_brute_force(tables, lens, own, rank, ps)):
            assert plan.owned_slots[b].tolist() == slots + [-1] * (width - len(slots))
            assert plan.owned_local_pages[b].tolist() == local + [-1] * (width - len(local))
            m = len(slot_map)
            assert plan.slot_local_page[b, :m].tolist() == slot_map
            assert bool((plan.slot_local_page[b, m:] == -1).all())
            assert int(plan.new_locs[b]) == loc
        assert width == max(1, max(len(s) for s, *_ in _brute_force(tables, lens, own, rank, ps)))


def test_plan_decode_accepts_a_padded_tensor_table():
    own = PageOwnership(2, 16)
    a = plan_decode([[3, 4], [7]], [5, 2], own, 1, page_size=4, topk=4)
    b = plan_decode(torch.tensor([[3, 4], [7, -1]], dtype=torch.int32), [5, 2], own, 1, page_size=4, topk=4)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("owned_slots", "owned_local_pages", "new_locs"))


@pytest.mark.parametrize(
    "tables,lens,kwargs,error,match",
    [
        ([[1]], [5], {}, ValueError, r"page_tables\[0\] must hold ceil\(seq_lens\[0\] / page_size\) = 2 pages"),
        (torch.tensor([[1, -1, 4]]), [5], {}, ValueError, r"= 2 pages \(no -1 among them\) for seq_lens\[0\]=5, got 1"),
        ([[1, 40]], [5], {}, ValueError, r"page_tables must hold logical pages in \[-1, 32\).*40"),
        ([[1, 1]], [5], {}, ValueError, r"page_tables\[0\] must not repeat a page, got \[1, 1\]"),
        ([[1]], [0], {}, ValueError, r"seq_lens\[0\] must be >= 1, got seq_lens\[0\]=0"),
        ([[1]], [1, 2], {}, ValueError, "seq_lens must have one entry per request"),
        ([[1]], [1], {"rank": 2}, ValueError, "rank must be < ownership.cp_size=2, got rank=2"),
        ([[1]], [1], {"topk": 0}, ValueError, "topk must be >= 1, got topk=0"),
        ([[1]], [1], {"page_size": 0}, ValueError, "page_size must be >= 1, got page_size=0"),
        ([[1.0]], [1], {}, TypeError, r"page_tables\[0\] must hold ints, got 1.0"),
    ],
)
def test_plan_decode_rejects_bad_input(tables, lens, kwargs, error, match):
    args = {"rank": 0, "page_size": 4, "topk": 4, **kwargs}
    rank = args.pop("rank")
    with pytest.raises(error, match=match):
        plan_decode(tables, lens, PageOwnership(2, 32), rank, **args)


class TestAllocDecodePages:
    def test_a_long_decode_spreads_each_request_over_the_ranks(self):
        own = PageOwnership(3, 120)
        alloc = PageAllocator(own)
        pinned = alloc.alloc([2, 2, 2, 2]).tolist()  # a prompt whose pages all sit on rank 2
        balanced = alloc.alloc_balanced(3).tolist()
        reqs = [pinned, balanced]
        for _ in range(12):
            for r, new in zip(reqs, alloc_decode_pages(alloc, reqs, [1, 1])):
                r.extend(new)
        counts = [[sum(own.owner(p) == k for p in r) for k in range(3)] for r in reqs]
        assert counts[0] == [5, 5, 6]  # ranks 0 and 1 first catch up with rank 2 (4 each), then the three alternate
        assert max(counts[1]) - min(counts[1]) <= 1
        assert all(own.owner(p) != 2 for p in pinned[4:12])  # the first 8 new pages avoid the loaded rank

    def test_spmd_identical_and_all_or_nothing(self):
        own = PageOwnership(2, 6)
        a, b = PageAllocator(own), PageAllocator(own)
        pages = [[0], [1]]
        assert alloc_decode_pages(a, pages, [2, 1]) == alloc_decode_pages(b, pages, [2, 1])
        before = a.digest()
        with pytest.raises(AllocationError, match="needs 4 free pages, the pool has 3; nothing was allocated"):
            alloc_decode_pages(a, [[0], [1]], [2, 2])
        assert a.digest() == before
        with pytest.raises(ValueError, match=r"needs\[0\] must be >= 0"):
            alloc_decode_pages(a, [[0]], [-1])
        with pytest.raises(ValueError, match="one entry per request"):
            alloc_decode_pages(a, [[0]], [1, 1])

    def test_a_full_owner_class_is_skipped(self):
        own = PageOwnership(2, 4)
        alloc = PageAllocator(own)
        alloc.alloc([0, 0])  # rank 0 has no free page left
        assert [own.owner(p) for p in alloc_decode_pages(alloc, [[1]], [2])[0]] == [1, 1]


def test_comm_bytes_match_the_documented_deepseek_numbers():
    q = sharded_decode_comm_bytes(num_queries=1, topk=2048, num_heads=128, kv_lora_rank=512, cp_size=2)
    assert q.sent == 2048 * 8 + 128 * 513 * 4 == 16384 + 262656 and q.received == q.sent and q.num_collectives == 2
    view = full_view_comm_bytes(max_pages_per_rank=131072 // 64 // 2, page_bytes=41984 + 8448, cp_size=2)
    assert view.sent == 51_642_368 and round(view.sent / q.sent) == 185
    four = sharded_decode_comm_bytes(num_queries=3, topk=16, num_heads=2, kv_lora_rank=8, cp_size=4, partial_itemsize=8)
    assert four.received == 3 * four.sent and four.scaled(5).sent == 5 * four.sent
    assert sharded_decode_comm_bytes(num_queries=4, topk=8, num_heads=2, kv_lora_rank=8, cp_size=1).sent == 0
    with pytest.raises(ValueError, match="cp_size must be >= 1, got cp_size=0"):
        sharded_decode_comm_bytes(num_queries=1, topk=1, num_heads=1, kv_lora_rank=1, cp_size=0)
