"""The runtime itself: the adapter contract, the plan's key table, the configuration agreement across ranks, the
progress hooks, and the batch-invariant products that bitwise prefix-cache parity of float32 models rests on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import ModelSpec, Runtime, batch_invariant
from dtkv.runtime._invariant import BLOCK_M, invariant_grouped_mm

CFG = ModelConfig(page_size=4, num_layers=1)


def test_rejects_what_is_not_an_adapter_and_specs_that_break_a_rule():
    with pytest.raises(TypeError, match=r"adapter must be a dtkv.runtime.ModelAdapter \(it has no 'spec'\)"):
        Runtime(object(), num_pages=8)
    with pytest.raises(
        ValueError, match=r"mode must be one of \('single', 'replicated', 'sharded', 'sharded_direct'\)"
    ):
        Runtime(ReferenceAdapter(CFG), num_pages=8, mode="shared")
    with pytest.raises(ValueError, match="decode_mode='sharded' needs a page-sharded pool .* got mode='replicated'"):
        Runtime(ReferenceAdapter(CFG), num_pages=8, mode="replicated", decode_mode="sharded")
    lay = CFG.layouts
    kw = dict(num_layers=1, vocab_size=10, index_topk=4, num_heads=2, kv_lora_rank=64, rope_dim=16)
    with pytest.raises(ValueError, match=r"layouts must name the pools \['index', 'kv'\], got \['kv'\]"):
        ModelSpec(layouts={"kv": lay["kv"]}, **kw)
    other = ModelConfig(page_size=8).layouts
    with pytest.raises(ValueError, match=r"layouts must share one page_size, got \[4, 8\]"):
        ModelSpec(layouts={"kv": lay["kv"], "index": other["index"]}, **kw)
    with pytest.raises(ValueError, match="num_heads must be >= 1, got num_heads=0"):
        ModelSpec(layouts=lay, **{**kw, "num_heads": 0})


def test_the_key_table_lists_every_readable_position_of_each_request_in_order():
    rt = Runtime(ReferenceAdapter(CFG), num_pages=32)
    a, b = rt.add_request(list(range(11))), rt.add_request(list(range(20, 27)))
    rt.step([a, b], [6, 7])
    plan = rt.plan_step([a], [5])
    assert plan.key_indptr == (0, 11) and plan.key_pos.tolist() == list(range(11))
    pages = torch.tensor(a.pages)
    pos = torch.arange(11)
    assert torch.equal(plan.key_locs, pages[pos // 4] * 4 + pos % 4)
    assert torch.equal(plan.key_slots, plan.key_locs)  # a whole pool is its own view
    rows = [r for _, lo, hi, _ in plan.groups for r in range(lo, hi)]
    assert rows == list(range(5))  # the segments tile this rank's rows ...
    assert all(kv == int(plan.positions[hi - 1]) + 1 for _, _, hi, kv in plan.groups)  # ... each reads up to its last


def test_each_row_reads_its_request_up_to_its_position():
    """``key_start``/``key_end``: row ``r`` reads exactly the key-table entries of its request at positions up to its
    own (what :func:`dtkv.ops.indexer_logits` and :func:`dtkv.ops.logits_topk` take), here for two requests with
    history and one without, in a sharded pool's plan too."""
    for mode in ("single", "sharded"):
        rt = Runtime(ReferenceAdapter(CFG), num_pages=48, mode=mode)
        a, b, c = rt.add_request(list(range(13))), rt.add_request(list(range(20, 29))), rt.add_request([5, 6, 7])
        rt.step([a, b], [6, 4])
        plan = rt.plan_step([a, b, c], [7, 5, 3])
        cols = torch.arange(plan.key_slots.shape[0])
        sees = (cols[None, :] >= plan.key_start[:, None]) & (cols[None, :] < plan.key_end[:, None])
        want = (plan.key_req[None, :] == plan.req_idx[:, None]) & (plan.key_pos[None, :] <= plan.positions[:, None])
        assert plan.key_start.dtype == plan.key_end.dtype == torch.int64 and torch.equal(sees, want), mode
        rt.close()


@pytest.mark.parametrize("adapter", ["reference", "transformers"])
@pytest.mark.parametrize("mode", ["single", "sharded", "sharded_direct"])
def test_extend_steps_write_without_a_host_check(monkeypatch, adapter, mode):
    """A step's KV writes skip the write ops' host validation (one synchronization each on a GPU, two a layer): the
    plan's locations are valid by construction. ``DTKV_DEBUG`` (``debug_mode``) validates them again; the stored
    bytes and the logits are the same either way."""
    import dtkv.ops._row_write as row_write
    from dtkv import _env
    from tests._runtime import make_runtime

    calls = []
    real = row_write.validate_locs
    monkeypatch.setattr(row_write, "validate_locs", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = []
    for debug in (False, True):
        with _env.debug_mode(debug), make_runtime(adapter, num_pages=24, mode=mode) as rt:
            req = rt.add_request(list(range(3, 14)))
            _, logits = rt.prefill(4, return_logits=True)
            out.append((logits[0], rt.kv_bytes(req.rid)))
        if not debug:
            assert calls == [], f"{len(calls)} validated writes"
    assert len(calls) >= 2 * 3  # two pools, three steps
    assert torch.equal(out[0][0], out[1][0]) and all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


def _two_ranks_disagree(rank, world, field, **kwargs):
    """A runtime whose ``field`` is ``True`` on rank 1 only: each rank's ConfigMismatchError message (None: none)."""
    import torch.distributed as dist

    from dtkv import ConfigMismatchError

    try:
        Runtime(ReferenceAdapter(CFG), num_pages=16, group=dist.group.WORLD, **{field: rank == 1}, **kwargs)
    except ConfigMismatchError as e:
        return str(e)
    return None


@pytest.mark.multirank
def test_ranks_that_disagree_on_the_configuration_fail_together(ranks2):
    for msg in ranks2.run(_two_ranks_disagree, "batch_invariant"):
        assert msg is not None and "field 'batch_invariant' differs (rank 0: False, rank 1: True)" in msg, msg


@pytest.mark.multirank
def test_ranks_that_disagree_on_the_pool_layout_fail_together(ranks2):
    # replicated: the pool agrees on nothing across ranks, the runtime's configuration does
    for msg in ranks2.run(_two_ranks_disagree, "page_major", mode="replicated"):
        assert msg is not None and "field 'page_major' differs (rank 0: False, rank 1: True)" in msg, msg


@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
def test_a_page_major_pool_gives_the_layer_major_results_bitwise(decode_mode):
    """The ops write and read a page-major pool through per-layer views with a page stride of ``num_layers`` pages:
    logits, tokens and stored KV equal the layer-major pool's."""
    cfg = ModelConfig(page_size=4, num_layers=3)
    out = {}
    for page_major in (False, True):
        rt = Runtime(ReferenceAdapter(cfg), num_pages=24, decode_mode=decode_mode, page_major=page_major)
        assert rt.pool.page_major is page_major
        assert rt.pool.storage("kv").shape[:2] == ((24, 3) if page_major else (3, 24))
        reqs = [rt.add_request(list(range(3, 14))), rt.add_request(list(range(7)))]
        _, logits = rt.prefill(4, return_logits=True)
        tokens = rt.decode(3)
        out[page_major] = (logits, tokens, [rt.kv_bytes(r.rid) for r in reqs])
        rt.close()
    (la, ta, ka), (lb, tb, kb) = out[False], out[True]
    assert ta == tb and all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ka, kb) for k in a)


def test_prefill_and_decode_report_their_progress():
    rt = Runtime(ReferenceAdapter(CFG), num_pages=32)
    rt.add_request(list(range(10)))
    rt.add_request(list(range(3)))
    seen = []
    rt.prefill(4, progress=lambda k, n: seen.append(("prefill", k, n)))
    rt.decode(2, progress=lambda k, n: seen.append(("decode", k, n)))
    assert seen == [("prefill", 1, 3), ("prefill", 2, 3), ("prefill", 3, 3), ("decode", 1, 2), ("decode", 2, 2)]


# ----------------------------------------------------------------------------------------- batch invariance
def test_matrix_products_do_not_depend_on_the_rows_sharing_a_call():
    """Inside ``batch_invariant()`` a row's result is the same bits whatever else is in the call (rows, columns of
    a product with activations, batch entries, expert groups), on shapes around the blocking (1, 15-17, 63-65)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g)
    x = torch.randn(70, 40, generator=g)
    keys = torch.randn(70, 40, generator=g)
    with batch_invariant():
        full = F.linear(x, w)
        scores = x @ keys.T
        for lo, hi in ((0, 1), (3, 18), (15, 16), (5, 70), (63, 65)):
            assert torch.equal(F.linear(x[lo:hi], w), full[lo:hi])
            assert torch.equal(torch.nn.functional.linear(x[lo:hi], w), full[lo:hi])
            for k in (1, 17, 64, 65, 70):
                assert torch.equal(x[lo:hi] @ keys[:k].T, scores[lo:hi, :k])
        a, b = torch.randn(40, 1, 8, generator=g), torch.randn(40, 8, 70, generator=g)
        batched = torch.matmul(a, b)
        for n in (1, 7, 9, 40):
            assert torch.equal(torch.bmm(a[:n], b[:n, :, :33]), batched[:n, :, :33])
        offs = torch.tensor([5, 5, 21, 30], dtype=torch.int32)  # an empty group, then groups around BLOCK_M
        experts = torch.randn(4, 40, 24, generator=g)
        grouped = invariant_grouped_mm(x[:30], experts, offs=offs)
        for e, (lo, hi) in enumerate(((0, 5), (5, 5), (5, 21), (21, 30))):
            assert torch.equal(grouped[lo:hi], x[lo:hi] @ experts[e])
        v = torch.randn(1000, generator=g) * 10
        for fn in (F.silu, torch.sigmoid, torch.exp, torch.rsqrt):
            whole = fn(v.abs() + 0.1)
            for n in (1, 13, 100, 999):
                assert torch.equal(fn(v[:n].abs() + 0.1), whole[:n]), fn
        with pytest.raises(RuntimeError, match="cannot make einsum batch-invariant: write the contraction with"):
            torch.einsum("ij,jk->ik", x, w.T)
    assert BLOCK_M == 16


def test_batch_invariant_products_equal_the_plain_ones_to_rounding():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 64, generator=g, dtype=torch.float64), torch.randn(48, 64, generator=g, dtype=torch.float64)
    with batch_invariant():
        got = F.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("adapter", ["reference", "transformers"])
@pytest.mark.parametrize("how", ["close", "with"])
def test_a_closed_runtime_refuses_every_step_naming_close(adapter, how):
    """After ``close()`` (or its with-block) the adapter is unbound (a transformers model runs its own attention
    again, which failed with ``TypeError: 'NoneType' object is not subscriptable`` deep inside transformers):
    every call that would run the model or take pages refuses, naming close(), with nothing allocated;
    ``finish_request`` and ``kv_bytes`` still work."""
    from tests._runtime import make_runtime, snapshot, unchanged

    with make_runtime(adapter, num_pages=16) as rt:
        a = rt.add_request([1, 2, 3, 4, 5])
        rt.prefill(2)
        plan_reqs = [rt.add_request([6, 7])]
        plan = rt.plan_step(plan_reqs, [1])  # planned while open, rt after
        if how == "close":
            rt.close()
    assert rt.closed
    rt.close()  # idempotent
    before = snapshot(rt)
    calls = {
        "add_request": lambda: rt.add_request([1]),
        "step": lambda: rt.step(plan_reqs, [1]),
        "plan_step": lambda: rt.plan_step(plan_reqs, [1]),
        "forward": lambda: rt.forward(plan),
        "prefill": lambda: rt.prefill(4),
        "decode": lambda: rt.decode(1),
        "decode_step": lambda: rt.decode_step([a]),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"Runtime\.{name}\(\) on a closed runtime: close\(\) ran"):
            call()
    assert unchanged(rt, before)
    assert rt.kv_bytes(a.rid)["kv"].shape[1] == 5
    rt.finish_request(a.rid)
    assert a.finished and not a.pages
