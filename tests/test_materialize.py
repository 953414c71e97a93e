"""Full-view materialization: plans match a brute-force reference and are checked across ranks; every view path
(Materializer with and without prefetch, either pack kernel, and gather_view) puts the owners' bytes in every row a
page maps to, on 2, 3 and 4 ranks, with empty ranks and empty page groups; per layer and group at most one pack and
one collective are issued, none for an empty group and no pack where the pool already holds the pages in order."""

from __future__ import annotations

import pytest
import torch

from dtkv import IndexerFp8Layout, MLALatentLayout, PageOwnership, ShardedKVPool
from dtkv.materialize import MaterializeError, plan_materialize, scratch_bytes
from tests._multirank import RankGroup

LAYOUTS = {
    "kv": MLALatentLayout(page_size=4, kv_lora_rank=12, rope_dim=4),
    "index": IndexerFp8Layout(page_size=4, head_dim=8),
}
NUM_LAYERS = 3


@pytest.fixture(scope="module")
def local_ranks3():
    group = RankGroup(3)
    yield group
    group.close()


@pytest.fixture(params=[2, 3, 4], ids=["world2", "world3", "world4"])
def any_ranks(request, ranks2, ranks4):
    """World sizes 2, 3 and 4 (three ranks from the session's ``ranks3`` fixture where conftest has one)."""
    if request.param != 3:
        return ranks2 if request.param == 2 else ranks4
    try:
        return request.getfixturevalue("ranks3")
    except pytest.FixtureLookupError:
        return request.getfixturevalue("local_ranks3")


def _reference_rows(history, current, own, write_current=False):
    """Brute force: per group, pages in first-use order, dealt to owner-major slots."""
    cur = list(dict.fromkeys(p for p in current if p >= 0))
    hist = [p for p in dict.fromkeys(p for p in history if p >= 0) if p not in cur]
    if write_current:
        hist, cur = hist + cur, []
    rows, base = {}, 0
    for group in (hist, cur):
        per_owner = {r: [p for p in group if own.owner(p) == r] for r in range(own.cp_size)}
        m = max((len(v) for v in per_owner.values()), default=0)
        for r, ps in per_owner.items():
            for j, p in enumerate(ps):
                rows[p] = base + r * m + j
        base += own.cp_size * m
    return rows, base


# ------------------------------------------------------------------------------------------- plan (one process)
@pytest.mark.parametrize("cp,layout", [(1, "interleave"), (2, "interleave"), (3, "block"), (4, "interleave")])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("write_current", [False, True], ids=["gather-current", "write-current"])
def test_plan_matches_brute_force(cp, layout, seed, write_current):
    own = PageOwnership(cp, 37, layout)
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(-1, 37, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)
    current = torch.randint(-1, 37, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
    want, num_rows = _reference_rows(history.tolist(), current.tolist(), own, write_current)
    digests = set()
    for rank in range(cp):
        plan = plan_materialize(history, current, own, rank, write_current=write_current)
        digests.add(plan.digest)
        assert plan.num_view_pages == num_rows
        got = {p: int(plan.page_map[p]) for p in range(37) if int(plan.page_map[p]) >= 0}
        assert got == want
        if write_current:
            assert plan.current_rows_per_rank == 0
            assert set(plan.write_pages.tolist()) == {p for p in current.tolist() if p >= 0}
        # this rank's send lists are exactly its pages of each group, in order
        for gp, group in ((plan.history, "history"), (plan.current, "current")):
            sent = gp.send_local_idx[rank]
            pages = own.global_page(rank, sent[sent >= 0])
            rows = plan.page_map[pages].tolist()
            assert rows == sorted(rows), group
    assert len(digests) == 1  # the digest names the batch, not the rank


def test_plan_digest_changes_with_the_pages_and_the_ownership():
    own = PageOwnership(2, 16)
    base = plan_materialize([0, 1, 2], [3], own, 0).digest
    assert plan_materialize([0, 1, 2], [3], own, 1).digest == base
    assert plan_materialize([0, 2, 1], [3], own, 0).digest != base  # order matters: it sets the view rows
    assert plan_materialize([0, 1, 2], [3, 4], own, 0).digest != base
    assert plan_materialize([0, 1, 2], [3], PageOwnership(2, 16, "block"), 0).digest != base
    assert plan_materialize([0, 1, 2], [3], own, 0, write_current=True).digest != base


def test_plan_rejects_pages_outside_the_pool():
    with pytest.raises(ValueError, match="history_pages must hold logical pages in"):
        plan_materialize([0, 40], [], PageOwnership(2, 40), 0)


@pytest.mark.parametrize(
    "rank,error,message",
    [
        (-1, ValueError, "rank must be in [0, cp_size=2), got rank=-1"),
        (2, ValueError, "rank must be in [0, cp_size=2), got rank=2"),
        (True, TypeError, "rank must be an int, got rank=True (bool)"),
        ("0", TypeError, "rank must be an int, got rank='0' (str)"),
    ],
)
def test_plan_rejects_a_rank_outside_the_group(rank, error, message):
    with pytest.raises(error) as info:
        plan_materialize([0, 1], [2], PageOwnership(2, 8), rank)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "cp,num_pages,scheme,history,want",
    [
        pytest.param(2, 16, "interleave", list(range(12)), [0, 0], id="interleave-in-order"),
        pytest.param(2, 16, "interleave", [1, 3, 5, 7], [0, 0], id="rank0-empty-group-sends-pool-pages"),
        pytest.param(2, 16, "interleave", [2, 0, 4], [None, 0], id="out-of-order"),
        pytest.param(3, 10, "block", [4, 5, 6, 7, 8, 9], [0, 0, None], id="block-padding-past-the-pool"),
        pytest.param(3, 4, "block", [0, 1, 2, 3], [0, 0, None], id="block-empty-rank"),
    ],
)
def test_send_slices_where_the_pool_holds_the_pages_in_order(cp, num_pages, scheme, history, want):
    own = PageOwnership(cp, num_pages, scheme)
    assert [plan_materialize(history, [], own, r).history_slice for r in range(cp)] == want


def test_scratch_bytes_formula():
    lay = {"kv": MLALatentLayout(page_size=4)}
    m = -(-10 // 2) + 2
    assert scratch_bytes(lay, max_pages=10, cp=2, prefetch=False) == (2 * m + m) * lay["kv"].page_bytes
    assert scratch_bytes(lay, max_pages=10, cp=2) == 2 * scratch_bytes(lay, max_pages=10, cp=2, prefetch=False)


# ------------------------------------------------------------------------------------------- single process
def test_local_views_and_errors_without_a_group():
    from dtkv.materialize import Materializer, gather_view

    own = PageOwnership(1, 9)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=2)
    for name in LAYOUTS:
        pool.buffer(name).view(torch.uint8).copy_(torch.randint(0, 256, pool.buffer(name).view(torch.uint8).shape))
    plan = plan_materialize([5, 2, 7], [1], own, 0)
    mat = Materializer(pool, plan, backend="copy_engine")
    assert mat.backend == "local"
    rows = plan.page_map[plan.pages].long()
    for layer in range(2):
        views = mat.view(layer)
        for name in LAYOUTS:
            want = pool.local(name, layer)[plan.pages]
            assert torch.equal(views[name][rows].view(torch.uint8), want.view(torch.uint8))
            assert torch.equal(gather_view(pool.local(name, layer), plan, None)[rows].view(torch.uint8),
                               want.view(torch.uint8))  # fmt: skip
    with pytest.raises(RuntimeError, match="capture\\(\\) records CUDA graphs; this pool is on cpu"):
        mat.capture()
    with pytest.raises(IndexError, match="layer must be an int in \\[0, 2\\), got layer=2"):
        mat.view(2)
    with pytest.raises(ValueError, match="backend must be one of"):
        Materializer(pool, plan, backend="nccl")
    with pytest.raises(ValueError, match="names must be a non-empty subset of"):
        Materializer(pool, plan, names=["kv", "missing"])


def test_prefetching_over_a_pending_layer_of_the_same_parity_raises():
    from dtkv.materialize import Materializer

    own = PageOwnership(1, 9)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=4)
    mat = Materializer(pool, plan_materialize([1, 2], [3], own, 0))
    mat.prefetch(0)
    mat.prefetch(1)
    mat.prefetch(1)  # already in flight: ignored
    mat.prefetch(4)  # past the last layer: ignored
    with pytest.raises(RuntimeError, match="prefetch\\(layer=2\\) would overwrite the view buffers of layer 0"):
        mat.prefetch(2)
    mat.view(0)
    mat.prefetch(2)


def test_agreement_records_round_trip_and_survive_malformed_bytes():
    from dtkv.materialize._exchange import PAYLOAD_BYTES, Vote

    v = Vote(digest=bytes(range(16)), ok=False, summary="s" * 100, message="é" * 500)
    raw = v.encode()
    assert len(raw) == PAYLOAD_BYTES
    back = Vote.decode(raw)
    assert back.digest == v.digest and not back.ok and back.summary == "s" * 64 and back.message.startswith("é")
    junk = Vote.decode(bytes([255]) * PAYLOAD_BYTES)  # lengths past the bounds are clipped, bad UTF-8 replaced
    assert junk.ok and len(junk.summary) <= 64


# ------------------------------------------------------------------------------------------- multi-rank
def _fill(pool, own, rank, seed):
    """Every layout and layer of the logical pool from a seeded generator (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ref = {}
    for name, lay in LAYOUTS.items():
        shape = (NUM_LAYERS, own.num_pages, *lay.page_shape[:-1], lay.page_shape[-1] * lay.dtype.itemsize)
        full = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(lay.dtype)
        ref[name] = full
        pool.buffer(name).copy_(full[:, own.local_pages(rank)])
    return ref


CASES = {
    # name: (scheme, num_pages(world), history(world, g), current(world, g), write_current)
    "random": ("interleave", lambda w: 29, lambda w, g: torch.randperm(29, generator=g)[:17],
               lambda w, g: torch.randperm(29, generator=g)[:5], False),
    "in-order": ("interleave", lambda w: 31, lambda w, g: torch.arange(25), lambda w, g: torch.arange(25, 29), False),
    "empty-rank-block": ("block", lambda w: 1 if w == 2 else w + 1, lambda w, g: torch.arange(0 if w == 2 else w - 1),
                         lambda w, g: torch.arange(0 if w == 2 else w - 1, 1 if w == 2 else w + 1), False),
    "empty-history": ("interleave", lambda w: 13, lambda w, g: torch.tensor([], dtype=torch.int64),
                      lambda w, g: torch.tensor([3, 1, 12]), False),
    "empty-current": ("block", lambda w: 23, lambda w, g: torch.randperm(23, generator=g)[:9],
                      lambda w, g: torch.tensor([-1]), False),
    "nothing": ("interleave", lambda w: 8, lambda w, g: torch.tensor([-1]), lambda w, g: torch.tensor([]), False),
    "write-current": ("interleave", lambda w: 29, lambda w, g: torch.randperm(29, generator=g)[:11],
                      lambda w, g: torch.arange(24, 29), True),
}  # fmt: skip


def case_setup(case: str, rank: int, world: int, seed: int):
    """Case ``case`` of :data:`CASES` on ``rank``: its ownership, an empty pool, the page lists drawn from ``seed``
    and their plan (collective): ``(own, pool, plan, history, current)``."""
    import torch.distributed as dist

    scheme, num_pages, hist_fn, cur_fn, write_current = CASES[case]
    own = PageOwnership(world, num_pages(world), scheme)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=NUM_LAYERS, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(seed)
    history, current = hist_fn(world, g), cur_fn(world, g)
    plan = plan_materialize(history, current, own, rank, group=dist.group.WORLD, write_current=write_current)
    return own, pool, plan, history, current


def _views(rank, world, case, seed, pack):
    import torch.distributed as dist

    import dtkv
    from dtkv.materialize import Materializer, gather_view

    own, pool, plan, history, current = case_setup(case, rank, world, seed + 1)
    ref = _fill(pool, own, rank, seed)
    pages = plan.pages
    rows = plan.page_map[pages].long()
    out = {"ok": [], "num_local": own.num_local_pages(rank), "view_pages": plan.num_view_pages}
    for prefetch in (False, True):
        mat = Materializer(pool, plan, pack=pack)
        out["backend"] = mat.backend
        out["scratch"] = mat.scratch_bytes()
        if prefetch:
            mat.prefetch(0)
        with dtkv.debug_mode():  # the synchronizing check runs inside view() too
            for layer in range(NUM_LAYERS):
                if prefetch:
                    mat.prefetch(layer + 1)
                views = mat.view(layer)
                for name in LAYOUTS:
                    want = ref[name][layer, pages].view(torch.uint8)
                    out["ok"].append(torch.equal(views[name][rows].view(torch.uint8), want))
                    if not prefetch:
                        direct = gather_view(pool.local(name, layer), plan, dist.group.WORLD)
                        out["ok"].append(torch.equal(direct[rows].view(torch.uint8), want))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_views_hold_the_owners_bytes(any_ranks, case):
    results = any_ranks.run(_views, case, 7, "torch")
    for res in results:
        assert res["ok"] and all(res["ok"]), res
        assert res["backend"] == "all_gather"
    if case == "empty-rank-block":
        assert any(r["num_local"] == 0 for r in results)  # the case really has a rank without pages


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["random", "empty-rank-block"])
def test_views_with_the_triton_pack(ranks2, case):
    """The one-launch pack kernel (interpreted on CPU) in the eager path."""
    for res in ranks2.run(_views, case, 3, "triton"):
        assert all(res["ok"]), res


def _count_launches(rank, world, case):

    from dtkv.materialize import Materializer, _gather

    own, pool, plan, _, _ = case_setup(case, rank, world, 5)
    calls = {"pack": 0, "collective": 0}
    real_packer, real_gather = _gather.make_packer, _gather._all_gather_many

    def counting_packer(impl):
        inner = real_packer(impl)

        def pack(*args):
            calls["pack"] += 1
            return inner(*args)

        pack.clear = inner.clear
        return pack

    def counting_gather(*args, **kwargs):
        calls["collective"] += 1
        return real_gather(*args, **kwargs)

    _gather.make_packer, _gather._all_gather_many = counting_packer, counting_gather
    try:
        mat = Materializer(pool, plan)
        mat.prefetch(0)
        for layer in range(NUM_LAYERS):
            mat.prefetch(layer + 1)
            mat.view(layer)
    finally:
        _gather.make_packer, _gather._all_gather_many = real_packer, real_gather
    groups = int(plan.history_rows_per_rank > 0) + int(plan.current_rows_per_rank > 0)
    return {**calls, "groups": groups, "slices": (plan.history_slice, plan.current_slice), "scratch": mat.scratch_bytes(),
            "views": 2 * plan.num_view_pages * sum(lay.page_bytes for lay in LAYOUTS.values())}  # fmt: skip


def _resolve_on_cpu(rank, world):
    import warnings

    import torch.distributed as dist

    from dtkv.materialize._gather import resolve_gather_backend

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forced = resolve_gather_backend("copy_engine", dist.group.WORLD, torch.device("cpu"), 1 << 30)
    return {
        "auto": resolve_gather_backend("auto", dist.group.WORLD, torch.device("cpu"), 1 << 30),
        "forced": forced,
        "warned": any("falling back to 'all_gather'" in str(w.message) for w in caught),
        "none": resolve_gather_backend("auto", None, torch.device("cpu"), 1 << 30),
    }


@pytest.mark.multirank
def test_cpu_groups_always_take_the_all_gather_path(ranks2):
    for res in ranks2.run(_resolve_on_cpu):
        assert res == {"auto": "all_gather", "forced": "all_gather", "warned": True, "none": "local"}


@pytest.mark.multirank
def test_one_collective_per_group_no_pack_for_pages_in_order_and_nothing_for_empty_groups(ranks2):
    for res in ranks2.run(_count_launches, "in-order"):
        assert None not in res["slices"]  # both groups are slices of the pool on both ranks
        assert res == {**res, "pack": 0, "collective": 2 * NUM_LAYERS, "groups": 2}
        assert res["scratch"] == res["views"]  # no send buffer: scratch is exactly two layers of view
    for res in ranks2.run(_count_launches, "empty-history"):
        assert res["groups"] == 1 and res["collective"] == NUM_LAYERS and res["pack"] <= NUM_LAYERS
    for res in ranks2.run(_count_launches, "nothing"):
        assert res == {**res, "pack": 0, "collective": 0, "groups": 0}
    for res in ranks2.run(_count_launches, "random"):  # one pack for both layouts, per group and layer
        assert res["collective"] == 2 * NUM_LAYERS and res["pack"] <= 2 * NUM_LAYERS


# ------------------------------------------------------------------------------------------- fail together
def _diverged(rank, world, how):
    import torch.distributed as dist

    from dtkv.materialize import Materializer, gather_view

    own = PageOwnership(world, 16)
    pool = ShardedKVPool(LAYOUTS, own, num_layers=1, group=dist.group.WORLD)
    history = [0, 1, 2, 3] + ([4, 5] if rank == world - 1 else [])  # the last rank reads two more pages
    try:
        if how == "plan":
            plan_materialize(history, [6], own, rank, group=dist.group.WORLD)
        elif how == "materializer":
            Materializer(pool, plan_materialize(history, [6], own, rank)).view(0)
        elif how == "gather_view":
            gather_view(pool.local("kv", 0), plan_materialize(history, [6], own, rank), dist.group.WORLD)
        elif how == "same-sizes":  # equal counts, different pages: only the digest tells
            plan_materialize([0, 1, 2 + rank % 2], [6], own, rank, group=dist.group.WORLD)
        elif how == "bad-rank":
            plan_materialize([0, 1], [2], own, -1 if rank == 1 else rank, group=dist.group.WORLD)
        elif how == "bad-page":
            plan_materialize([0, 1] + ([99] if rank == 0 else []), [2], own, rank, group=dist.group.WORLD)
    except (MaterializeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["plan", "materializer", "gather_view"])
def test_diverged_plans_raise_the_same_error_on_every_rank(ranks, how):
    messages = ranks.run(_diverged, how)
    assert len(set(messages)) == 1 and messages[0] is not None, messages
    others = ", ".join(f"rank {r}: 4" for r in range(ranks.world_size - 1))
    assert messages[0] == (
        "MaterializeError: CP ranks disagree on the materialization plan configuration: field 'history_pages' "
        f"differs ({others}, rank {ranks.world_size - 1}: 6)"
    )


@pytest.mark.multirank
def test_plans_of_equal_sizes_differ_by_their_digest(ranks2):
    messages = ranks2.run(_diverged, "same-sizes")
    assert len(set(messages)) == 1 and "field '~digest' differs" in messages[0], messages


@pytest.mark.multirank
def test_one_rank_s_bad_input_raises_on_every_rank(ranks):
    messages = ranks.run(_diverged, "bad-rank")
    assert len(set(messages)) == 1, messages
    assert messages[0] == (
        f"ValueError: materialization plan failed on 1 of {ranks.world_size} ranks; rank 1: ValueError: rank must be "
        f"in [0, cp_size={ranks.world_size}), got rank=-1"
    )
    messages = ranks.run(_diverged, "bad-page")
    assert len(set(messages)) == 1 and "failed on 1 of" in messages[0] and "rank 0: ValueError" in messages[0]
    assert (
        "history_pages must hold logical pages in [-1, 16) (-1 is padding), got history_pages containing 99"
        in (messages[0])
    )
