"""Runtime input rules under CP (gloo, 2 and 3 ranks, both model adapters): every rank refuses together.

A rank that refuses its input must never leave the others waiting in the step's first collective: the checks'
verdict is exchanged first (:func:`dtkv.runtime._batch.agreed_step`), so a bad batch raises on every rank, also when only
one rank got it (a broken SPMD contract, injected here), and the runtime is exactly as before on every rank (its
snapshot: requests, allocator, stats, every pool byte). Afterwards the same runtimes prefill and decode as usual.
"""

from __future__ import annotations

import pytest
import torch

from tests._runtime import ADAPTERS, make_runtime, refused, snapshot, unchanged

# per call: the exception type every rank must raise and a phrase of its rule
EXPECTED = {
    "twice": ("ValueError", "reqs must hold each request once per step"),
    "zero": ("ValueError", "got 0 at extend_lens[0]"),
    "past": ("ValueError", "got 9 at extend_lens[0] for request 0 (2 of 6 tokens computed)"),
    "empty": ("ValueError", "reqs must hold at least one request, got an empty batch"),
    "empty_decode": ("ValueError", "reqs must hold at least one request, got an empty batch"),
    "float": ("TypeError", "extend_lens must hold ints, got 1.5 (float)"),
    "exhausted": ("AllocationError", "new pages, the pool has"),
    "kv_bytes": ("ValueError", "rid must name a request in [0, 3), got rid=-1"),
    "one_rank_empty": ("ValueError", "failed on 1 of"),
    "ranks_differ": ("ConfigMismatchError", "field 'extend_lens[0]' differs"),
}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _refusals(rank, world, adapter):
    import torch.distributed as dist

    with make_runtime(adapter, group=dist.group.WORLD, num_pages=8 * world) as rt:
        a, b = rt.add_request(_prompt(6)), rt.add_request(_prompt(5, 1))
        c = rt.add_request(_prompt(32 * world, 2))  # fits the pool alone, not beside a's page
        rt.step([a], [2])
        before = snapshot(rt)
        calls = {
            "twice": lambda: rt.step([a, a], [2, 2]),
            "zero": lambda: rt.step([a, b], [0, 5]),
            "past": lambda: rt.step([a], [9]),
            "empty": lambda: rt.step([], []),
            "empty_decode": lambda: rt.decode_step([]),
            "float": lambda: rt.step([a], [1.5]),
            "exhausted": lambda: rt.step([c], [len(c.prompt)]),
            "kv_bytes": lambda: rt.kv_bytes(-1),
            "one_rank_empty": lambda: rt.step([] if rank == 0 else [a], [] if rank == 0 else [1]),
            "ranks_differ": lambda: rt.step([a], [1 + rank]),
        }
        results = {name: refused(call) for name, call in calls.items()}
        same = unchanged(rt, before)
        rt.finish_request(c.rid)
        rt.prefill(3)
        outputs = rt.decode(2)
        rt.finish_request(a.rid)
        after_free = refused(rt.step, [a], [1])
        return {"refused": results, "unchanged": same, "outputs": outputs, "after_free": after_free}


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_every_rank_refuses_a_bad_step_together_and_nothing_changes(request, world, adapter):
    results = request.getfixturevalue(f"ranks{world}").run(_refusals, adapter)
    for res in results:
        assert res["unchanged"], "a refused call changed the runtime"
        for name, (kind, phrase) in EXPECTED.items():
            got_kind, message = res["refused"][name]
            assert got_kind == kind and phrase in message, (name, got_kind, message)
        assert res["after_free"][0] == "ValueError" and "finished" in res["after_free"][1]
        assert res["outputs"] == results[0]["outputs"] and all(len(o) == 3 for o in res["outputs"][:2])
