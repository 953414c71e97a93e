"""Full-view materialization: plans match a brute-force reference; views hold the owners' bytes; prefetch and the
compilable path agree byte for byte; scratch is counted."""

from __future__ import annotations

import pytest
import torch

from dtkv import IndexerFp8Layout, MLALatentLayout, PageOwnership, ShardedKVPool
from dtkv.materialize import plan_materialize, scratch_bytes

LAYOUTS = {
    "kv": MLALatentLayout(page_size=4, kv_lora_rank=12, rope_dim=4),
    "index": IndexerFp8Layout(page_size=4, head_dim=8),
}


def _reference_rows(history, current, own):
    """Brute force: per group, pages in first-use order, dealt to owner-major slots."""
    cur = list(dict.fromkeys(p for p in current if p >= 0))
    hist = [p for p in dict.fromkeys(p for p in history if p >= 0) if p not in cur]
    rows, base = {}, 0
    for group in (hist, cur):
        per_owner = {r: [p for p in group if own.owner(p) == r] for r in range(own.cp_size)}
        m = max((len(v) for v in per_owner.values()), default=0)
        for r, ps in per_owner.items():
            for j, p in enumerate(ps):
                rows[p] = base + r * m + j
        base += own.cp_size * m
    return rows, base


@pytest.mark.parametrize("cp,layout", [(1, "interleave"), (2, "interleave"), (3, "block"), (4, "interleave")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_matches_brute_force(cp, layout, seed):
    own = PageOwnership(cp, 37, layout)
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(-1, 37, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)
    current = torch.randint(-1, 37, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
    want, num_rows = _reference_rows(history.tolist(), current.tolist(), own)
    for rank in range(cp):
        plan = plan_materialize(history, current, own, rank)
        assert plan.num_view_pages == num_rows
        got = {p: int(plan.page_map[p]) for p in range(37) if int(plan.page_map[p]) >= 0}
        assert got == want
        # this rank's send lists are exactly its pages of each group, in order
        for gp, group in ((plan.history, "history"), (plan.current, "current")):
            sent = gp.send_local_idx[rank]
            pages = own.global_page(rank, sent[sent >= 0])
            rows = plan.page_map[pages].tolist()
            assert rows == sorted(rows), group


def test_plan_rejects_pages_outside_the_pool():
    with pytest.raises(ValueError, match="history_pages must hold logical pages in"):
        plan_materialize([0, 40], [], PageOwnership(2, 40), 0)


def test_scratch_bytes_formula():
    lay = {"kv": MLALatentLayout(page_size=4)}
    m = -(-10 // 2) + 2
    assert scratch_bytes(lay, max_pages=10, cp=2, prefetch=False) == (2 * m + m) * lay["kv"].page_bytes
    assert scratch_bytes(lay, max_pages=10, cp=2) == 2 * scratch_bytes(lay, max_pages=10, cp=2, prefetch=False)


def _views(rank, world, seed):
    import torch.distributed as dist

    import dtkv
    from dtkv.materialize import Materializer, gather_view

    own = PageOwnership(world, 29)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=3, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(seed)
    ref = {}
    for name, lay in LAYOUTS.items():
        shape = (3, 29, *lay.page_shape[:-1], lay.page_shape[-1] * lay.dtype.itemsize)
        full = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(lay.dtype)
        ref[name] = full
        pool.buffer(name).copy_(full[:, own.local_pages(rank)])
    history = torch.randperm(29, generator=g)[:17]
    current = torch.cat((history[-2:], torch.randperm(29, generator=g)[:5]))  # overlaps: those count as current
    plan = plan_materialize(history, current, own, rank)
    mat = Materializer(pool, plan)
    out = {"ok": True, "scratch": mat.scratch_bytes(), "view_pages": plan.num_view_pages}
    mat.prefetch(0)
    with dtkv.debug_mode():  # the synchronizing check runs inside view()
        for layer in range(3):
            mat.prefetch(layer + 1)
            views = mat.view(layer)
            for name in LAYOUTS:
                direct = gather_view(pool.local(name, layer), plan, dist.group.WORLD)
                pages = plan.pages
                rows = plan.page_map[pages].long()
                out["ok"] &= torch.equal(views[name].view(torch.uint8), direct.view(torch.uint8))
                out["ok"] &= torch.equal(views[name][rows].view(torch.uint8), ref[name][layer, pages].view(torch.uint8))
    return out


@pytest.mark.multirank
def test_views_hold_the_owners_bytes_with_and_without_prefetch(ranks):
    for res in ranks.run(_views, 3):
        assert res["ok"]
        per_page = sum(lay.page_bytes for lay in LAYOUTS.values())
        assert res["scratch"] == 2 * res["view_pages"] * per_page  # double-buffered views, counted
