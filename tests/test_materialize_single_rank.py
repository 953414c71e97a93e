"""Full-view materialization on one rank (``cp_size=1``, no process group): the eager double-buffered
:class:`~dtkv.materialize.Materializer` and :func:`~dtkv.materialize.gather_view` against the pool's own pages,
layer by layer, with and without prefetch; the debug check names the first wrong page. The collective paths are
covered at world sizes 2 and 4 by ``tests/test_materialize.py``."""

from __future__ import annotations

import pytest
import torch

import dtkv
from dtkv import IndexerFp8Layout, MLALatentLayout, PageOwnership, ShardedKVPool
from dtkv.materialize import MaterializeError, Materializer, check_view, gather_view, plan_materialize

LAYOUTS = {
    "kv": MLALatentLayout(page_size=3, kv_lora_rank=10, rope_dim=2),
    "index": IndexerFp8Layout(page_size=3, head_dim=4),
}
NUM_PAGES, NUM_LAYERS = 13, 3


def _pool(seed: int = 0) -> ShardedKVPool:
    pool = ShardedKVPool(LAYOUTS, PageOwnership(1, NUM_PAGES), num_layers=NUM_LAYERS)
    g = torch.Generator().manual_seed(seed)
    for name in LAYOUTS:
        buf = pool.buffer(name).view(torch.uint8)
        buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))
    return pool


def _want(pool: ShardedKVPool, plan, name: str, layer: int) -> torch.Tensor:
    """Row ``page_map[p]`` of the view is logical page ``p``; on one rank local page ``p`` is logical page ``p``."""
    out = torch.zeros((plan.num_view_pages, *LAYOUTS[name].page_shape), dtype=LAYOUTS[name].dtype)
    for p in range(NUM_PAGES):
        row = int(plan.page_map[p])
        if row >= 0:
            out[row] = pool.local(name, layer)[p]
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


HISTORY, CURRENT = [7, 2, -1, 11, 2, 5], [5, 0, 12, -1]  # page 5 is in both groups: it counts as current


def test_plan_on_one_rank_orders_history_then_current_in_first_use_order():
    plan = plan_materialize(HISTORY, CURRENT, PageOwnership(1, NUM_PAGES), 0)
    assert plan.pages.tolist() == [7, 2, 11, 5, 0, 12]
    assert plan.num_history_rows == 3 and plan.num_view_pages == 6
    assert [int(plan.page_map[p]) for p in (7, 2, 11, 5, 0, 12)] == [0, 1, 2, 3, 4, 5]
    assert sorted(int(plan.page_map[p]) for p in range(NUM_PAGES)).count(-1) == NUM_PAGES - 6
    assert plan.scratch_pages == 6 + 3 + 3


@pytest.mark.parametrize("prefetch", [True, False])
def test_views_hold_each_layers_pages_and_both_buffers_stay_valid(prefetch):
    """With prefetch, ``prefetch(l + 1)`` fills the other buffer before ``view(l)``: layer ``l``'s history rows
    must survive it. Without, two consecutive layers' views are valid together."""
    pool = _pool()
    plan = plan_materialize(HISTORY, CURRENT, pool.ownership, 0)
    mat = Materializer(pool, plan)
    assert mat.names == ("index", "kv")
    per_page = sum(lay.page_bytes for lay in LAYOUTS.values())
    # double-buffered views plus double-buffered send buffers of each group (the pages are not in pool order)
    send_rows = plan.history.rows_per_rank + plan.current.rows_per_rank
    assert mat.scratch_bytes() == 2 * (plan.num_view_pages + send_rows) * per_page
    if prefetch:
        mat.prefetch(0)
        mat.prefetch(0)  # a second prefetch of the same layer is a no-op
    views = []
    for layer in range(NUM_LAYERS):
        if prefetch:
            mat.prefetch(layer + 1)  # the last one is past the pool: a no-op
        views.append(mat.view(layer))
        for name in LAYOUTS:
            want = _want(pool, plan, name, layer)
            assert _same(views[layer][name], want), (layer, name)
            assert _same(gather_view(pool.local(name, layer), plan, None), want), (layer, name)
        if layer and not prefetch:  # the previous layer's views live in the other buffer and are still intact
            for name in LAYOUTS:
                assert _same(views[layer - 1][name], _want(pool, plan, name, layer - 1)), (layer - 1, name)


def test_materializer_of_a_subset_of_layouts():
    pool = _pool(1)
    plan = plan_materialize([], [4, 1], pool.ownership, 0)
    mat = Materializer(pool, plan, names=["kv"])
    views = mat.view(2)
    assert list(views) == ["kv"]
    assert _same(views["kv"], _want(pool, plan, "kv", 2))


def test_materializer_rejects_a_plan_of_another_pool():
    pool = _pool()
    plan = plan_materialize([1], [2], PageOwnership(1, NUM_PAGES + 1), 0)
    with pytest.raises(ValueError) as e:
        Materializer(pool, plan)
    assert str(e.value) == (
        "plan was built for PageOwnership(cp_size=1, num_pages=14, scheme='interleave') rank 0, "
        "but pool has PageOwnership(cp_size=1, num_pages=13, scheme='interleave') rank 0"
    )


def test_debug_check_names_the_first_wrong_page():
    pool = _pool(2)
    plan = plan_materialize(HISTORY, CURRENT, pool.ownership, 0)
    with dtkv.debug_mode():
        views = Materializer(pool, plan).view(1)  # the check runs inside view() and passes
    check_view(pool, 1, plan, views)
    bad = {name: v.clone() for name, v in views.items()}
    bad["kv"].view(torch.uint8)[int(plan.page_map[11]), 0, 0] ^= 1  # one bit of logical page 11
    with pytest.raises(MaterializeError) as e:
        check_view(pool, 1, plan, bad)
    row = int(plan.page_map[11])
    assert str(e.value) == (
        f"materialized view of layer 1 layout 'kv' differs from the owner's bytes at logical page 11 "
        f"(owner rank 0, view row {row})"
    )


def test_scratch_bytes_vs_formula():
    """Per layout ``(cp * M + M) * page_bytes`` with ``M = ceil(max_pages / cp) + slack`` (default slack ``cp``),
    doubled with prefetch; an int, exact."""
    from dtkv.materialize import scratch_bytes

    for max_pages, cp in [(1, 1), (10, 2), (11, 2), (13, 4), (5, 8)]:
        for slack_pages in (None, 0, 3):
            for prefetch in (True, False):
                m = -(-max_pages // cp) + (cp if slack_pages is None else slack_pages)
                want = sum((cp + 1) * m * lay.page_bytes for lay in LAYOUTS.values()) * (2 if prefetch else 1)
                got = scratch_bytes(LAYOUTS, max_pages=max_pages, cp=cp, prefetch=prefetch, slack_pages=slack_pages)
                assert type(got) is int and got == want, (max_pages, cp, slack_pages, prefetch)
