"""``dtkv.split`` over real gloo ranks (2 and 4): gather round trips and direct / owner-filtered KV writes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtkv import PageAllocator, PageOwnership
from dtkv._collectives import all_gather_rows
from dtkv.pool import gather_pages
from dtkv.split import (
    allocate_for_split,
    merge_prev_next,
    pad_local,
    plan_cp_split,
    restore_natural,
    split_prev_next,
    take_local,
)

pytestmark = pytest.mark.multirank

MODES = [("zigzag", True), ("zigzag", False), ("round_robin", True)]
# (prefix_lens, extend_lens, page_size): mid-page prefixes, an empty extend, short (fallback) and prime lengths
BATCHES = [
    ([5], [23], 4),
    ([0, 3, 7, 0], [61, 1, 0, 40], 4),
    ([2, 13, 64], [7, 97, 33], 8),
    ([0], [3], 16),
]


def _roundtrip_worker(rank: int, world: int) -> list[tuple[int, str, bool]]:
    """split -> (prev/next split and merge) -> pad -> all-gather -> restore, for every batch and mode."""
    out = []
    for b, (prefix, extend, page_size) in enumerate(BATCHES):
        for mode, aligned in MODES:
            split = plan_cp_split(prefix, extend, cp_size=world, page_size=page_size, mode=mode, page_aligned=aligned)
            x = torch.randn(split.total_tokens, 3, 2, generator=torch.Generator().manual_seed(b))  # same on all ranks
            local = take_local(x, split, rank)
            prev, nxt = split_prev_next(local, split, rank)
            local = merge_prev_next(prev.clone(), nxt.clone(), split, rank)
            restored = restore_natural(all_gather_rows(pad_local(local, split), dist.group.WORLD), split)
            pos = restore_natural(
                all_gather_rows(pad_local(split.local(rank).positions, split), dist.group.WORLD), split
            )
            natural_pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, extend)])
            out.append((b, f"{mode}/{aligned}", bool(restored.equal(x)) and bool(pos.equal(natural_pos))))
    return out


def test_gather_restore_is_identity(ranks):
    results = ranks.run(_roundtrip_worker)
    for per_rank in results:
        assert all(ok for _, _, ok in per_rank), [r for r in per_rank if not r[2]]
    assert len(results[0]) == len(BATCHES) * len(MODES)


def _kv_value(req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The KV row of (request, absolute position): [n, 2] float, unique per token."""
    return torch.stack([req.double() * 1000 + pos.double(), -pos.double()], dim=1)


def _write_worker(rank, world, prefix, extend, page_size, mode, page_aligned):
    """Each rank writes the rows of pages it stores; rows of its handoff pages go through an owner-filtered
    all-gather. The assembled pool must hold every token, whatever the split."""
    group = dist.group.WORLD
    ownership = PageOwnership(world, 96)
    allocator = PageAllocator(ownership)  # SPMD: every rank makes the same calls
    have = [-(-p // page_size) for p in prefix]
    table = torch.full((len(prefix), max(have)), -1, dtype=torch.int64)
    for i, k in enumerate(have):
        table[i, :k] = allocator.alloc_balanced(k)
    store = torch.zeros(ownership.num_local_pages(rank), page_size, 2, dtype=torch.float64)

    def write(locs, rows):
        mine = ownership.owner(locs // page_size) == rank
        pages, offs = locs[mine] // page_size, locs[mine] % page_size
        store[ownership.local_index(pages), offs] = rows[mine]

    for i, p in enumerate(prefix):  # the prefix from earlier steps
        pos = torch.arange(p)
        write(table[i, pos // page_size] * page_size + pos % page_size, _kv_value(torch.full((p,), i), pos))

    split = plan_cp_split(prefix, extend, cp_size=world, page_size=page_size, mode=mode, page_aligned=page_aligned)
    alloc = allocate_for_split(allocator, split, table)
    loc = split.local(rank)
    locs = alloc.local_locs(rank)
    rows = _kv_value(loc.req_idx, loc.positions)
    direct = alloc.verify_direct_write(rank)
    handoff = ownership.owner(locs // page_size) != rank
    write(locs, rows)  # direct part
    # owner-filtered exchange of the handoff rows
    counts = all_gather_rows(torch.tensor([int(handoff.sum())]), group)
    m = int(counts.max())
    if m:
        send_locs = torch.full((m,), -1, dtype=torch.int64)
        send_locs[: int(handoff.sum())] = locs[handoff]
        send_rows = torch.zeros(m, 2, dtype=torch.float64)
        send_rows[: int(handoff.sum())] = rows[handoff]
        all_locs, all_rows = all_gather_rows(send_locs, group), all_gather_rows(send_rows, group)
        valid = all_locs >= 0
        write(all_locs[valid], all_rows[valid])
    full = gather_pages(store, ownership, group)
    ok = True
    for i, (p, n) in enumerate(zip(prefix, extend)):
        pos = torch.arange(p + n)
        got = full[alloc.req_pages[i, pos // page_size], pos % page_size]
        ok &= bool(got.equal(_kv_value(torch.full((p + n,), i), pos)))
    return ok, direct, int(handoff.sum()), alloc.handoff_pages(rank, 0).tolist()


@pytest.mark.parametrize(
    "prefix,extend,page_size,mode,page_aligned,expect",
    [
        ([0, 8], [40, 77], 4, "zigzag", True, "direct"),  # page-aligned prefixes: every rank writes directly
        ([5, 8], [40, 77], 4, "zigzag", True, "partial"),  # request 0's partial first page may be a handoff
        ([2, 0], [7, 64], 4, "zigzag", True, "none"),  # request 0 falls back
        ([3, 0], [40, 29], 4, "zigzag", False, "none"),
        ([3, 0], [40, 29], 4, "round_robin", True, "none"),
    ],
    ids=["aligned", "partial-first-page", "fallback", "token-balanced", "round-robin"],
)
def test_direct_and_handoff_writes_fill_the_pool(ranks, prefix, extend, page_size, mode, page_aligned, expect):
    results = ranks.run(_write_worker, prefix, extend, page_size, mode, page_aligned)
    assert all(ok for ok, *_ in results)
    if expect == "direct":
        assert all(direct and n == 0 for _, direct, n, _ in results)
    elif expect == "partial":
        # only rank 0 can hold a handoff page, and only request 0's partial first page (3 rows: positions 5..7)
        assert all(direct and n == 0 for _, direct, n, _ in results[1:])
        _, direct0, n0, pages0 = results[0]
        assert (direct0, n0) in ((True, 0), (False, 3))
        assert len(pages0) == (0 if direct0 else 1)
    else:
        assert not any(direct for _, direct, _, _ in results)
