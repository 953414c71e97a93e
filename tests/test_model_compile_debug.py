"""The runtime's run phase compiles with fullgraph (zero graph breaks); DTKV_DEBUG catches injected faults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtkv.model import ModelConfig
from tests._runtime import reference_runtime


def _runtime(mode, group, kv_dtype="fp8", num_layers=2):
    cfg = ModelConfig(page_size=4, num_layers=num_layers, kv_dtype=kv_dtype)
    rt = reference_runtime(cfg, mode=mode, group=group, num_pages=64)
    rt.add_request(list(range(50)))
    rt.add_request(list(range(30, 61)))
    rt.step(rt.requests, [21, 20])  # a first chunk eagerly, so the compiled chunk reads history pages
    return rt


def _eager_then_compiled(rt, counter):
    """The second chunk's step eagerly, then (pools restored) compiled with fullgraph through ``counter``:
    ``(counter, compiled logits, eager logits, the pools after the eager step)``."""
    torch._dynamo.reset()
    plan = rt.plan_step(rt.requests, [29, 11])
    names = rt.adapter.cfg.layouts
    before = {n: rt.pool.buffer(n).clone() for n in names}
    eager = rt.forward(plan)
    eager_pool = {n: rt.pool.buffer(n).clone() for n in names}
    for n in names:
        rt.pool.buffer(n).copy_(before[n])
    compiled = torch.compile(rt.forward, backend=counter, fullgraph=True)(plan)
    return counter, compiled, eager, eager_pool


def _compiled_vs_eager(rank, world, mode, backend):
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    rt = _runtime(mode, dist.group.WORLD)
    counter, compiled, eager, eager_pool = _eager_then_compiled(rt, CompileCounterWithBackend(backend))
    return {
        "frames": counter.frame_count,
        "logits_equal": torch.equal(compiled, eager),
        "logits_close": torch.allclose(compiled, eager, rtol=1e-9, atol=1e-9),
        "pool_equal": all(torch.equal(rt.pool.buffer(n), eager_pool[n]) for n in rt.adapter.cfg.layouts),
    }


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharded", "sharded_direct"])
def test_forward_compiles_fullgraph_with_collectives_and_custom_ops(ranks2, mode):
    """aot_eager keeps eager kernels, so compiled and eager results must agree bit for bit."""
    for res in ranks2.run(_compiled_vs_eager, mode, "aot_eager"):
        assert res["frames"] == 1, res  # one graph: no graph break anywhere in the step
        assert res["logits_equal"] and res["pool_equal"], res


@pytest.mark.slow
def test_forward_compiles_with_inductor_single_process():
    """Inductor may fuse float64 reductions in another order: logits agree to 1e-9, stored KV bytes exactly
    (KV rows are rounded to bf16/fp8 from identical float64 projections)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    rt = _runtime("single", None, num_layers=1)  # a second layer only adds C++ builds (the aot_eager tests have 2)
    counter, compiled, eager, eager_pool = _eager_then_compiled(rt, CompileCounterWithBackend("inductor"))
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled, eager, rtol=1e-9, atol=1e-9)
    assert all(torch.equal(rt.pool.buffer(n), eager_pool[n]) for n in rt.adapter.cfg.layouts)


def _inject_wrong_owner_write(rank, world):
    import torch.distributed as dist

    import dtkv
    from dtkv.debug import OwnershipError

    rt = _runtime("sharded_direct", dist.group.WORLD, kv_dtype="bf16")
    plan = rt.plan_step(rt.requests, [29, 11])
    # The bug: treat every local row as directly writable, including rows whose page another rank stores.
    all_rows = torch.arange(plan.locs.numel())
    bad = dataclasses.replace(plan, direct_rows=all_rows, handoff_rows=all_rows[:0])
    foreign = bool((rt.ownership.owner(plan.locs // rt.adapter.cfg.page_size) != rank).any())
    snapshot = {n: rt.pool.buffer(n).clone() for n in rt.adapter.cfg.layouts}
    with dtkv.debug_mode():
        try:
            rt.forward(bad)
        except OwnershipError as e:
            message = str(e)
        else:
            message = None
    untouched = all(torch.equal(rt.pool.buffer(n)[0], snapshot[n][0]) for n in rt.adapter.cfg.layouts)
    return {"foreign": foreign, "message": message, "layer0_untouched": untouched}


@pytest.mark.multirank
def test_debug_mode_catches_a_wrong_owner_write(ranks2):
    results = ranks2.run(_inject_wrong_owner_write)
    assert any(r["foreign"] for r in results)  # the injected plan really writes a foreign page somewhere
    # Every rank raises the same message (the check is collective: no rank is left waiting in a collective),
    # before the layer's write: layer 0's pools are untouched everywhere.
    assert len({r["message"] for r in results}) == 1, results
    assert "DTKV_DEBUG: direct write of 'kv', layer 0: rank" in results[0]["message"]
    assert "which is owned by rank" in results[0]["message"]
    assert all(r["layer0_untouched"] for r in results)


def _inject_bad_view(rank, world):
    import torch.distributed as dist

    import dtkv
    from dtkv.materialize import MaterializeError

    rt = _runtime("sharded", dist.group.WORLD)
    plan = rt.plan_step(rt.requests, [29, 11])
    mp = plan.mat_plan
    # The bug: a page table that swaps the view rows of two pages.
    pages = mp.pages.to(torch.int64)
    page_map = mp.page_map.clone()
    page_map[pages[0]], page_map[pages[1]] = mp.page_map[pages[1]], mp.page_map[pages[0]]
    bad = dataclasses.replace(plan, mat_plan=dataclasses.replace(mp, page_map=page_map))
    with dtkv.debug_mode():
        try:
            rt.forward(bad)
        except MaterializeError as e:
            return str(e)
    return None


@pytest.mark.multirank
def test_debug_mode_checks_views_against_the_owners_bytes(ranks2):
    for message in ranks2.run(_inject_bad_view):
        assert message is not None and "differs from the owner's bytes at logical page" in message
