"""The prefix cache keeps compute-owner direct writes direct (second review, finding 10; gloo, 2 and 3 ranks).

Under ``sharded_direct`` a page-aligned request asks each rank for the pages it computes. When one owner's free
pages are all cached, the eviction rule of :mod:`dtkv.prefix_cache` evicts that owner's leaves first, even while
the total still fits; before, nothing was evicted, those slots got other owners' pages and their rows went
through the handoff all-gather. Counted: ``rt.stats["handoff_rows"]`` (rows sent through the handoff path) and
``direct_rows``; compared: logits and stored KV bytes, bit for bit, against the same request without a cache.
"""

from __future__ import annotations

import pytest
import torch

PAGE_SIZE = 4


def _run(rank, world):
    import torch.distributed as dist

    from dtkv.model import ModelConfig
    from tests._runtime import reference_runtime

    cfg = ModelConfig(num_layers=2, page_size=PAGE_SIZE)
    # 2cp pages exactly: the zigzag split is page-aligned, every page has one compute owner (2 per rank)
    prompt = torch.randint(0, 96, (2 * world * PAGE_SIZE,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for cache in (False, True):
        eng = reference_runtime(
            cfg, mode="sharded_direct", group=dist.group.WORLD, num_pages=4 * world, prefix_cache=cache
        )
        if cache:  # every page rank 0 stores is cached (only the cache holds them); the other ranks' are free
            alloc = eng.allocator
            pages = alloc.alloc([0] * alloc.num_free(0))
            eng.prefix_cache.insert([96] * (PAGE_SIZE * len(pages)), pages)
            alloc.free(pages)
            assert alloc.num_free(0) == 0 and alloc.num_free() >= len(prompt) // PAGE_SIZE  # the total fits
        req = eng.add_request(prompt)
        logits = eng.step([req], [len(prompt)])
        out[cache] = {
            "logits": logits,
            "kv": eng.kv_bytes(req.rid),
            "direct_rows": eng.stats["direct_rows"],
            "handoff_rows": eng.stats["handoff_rows"],
            "evicted": eng.prefix_cache.stats["evicted_pages"] if cache else 0,
            "owners": [int(eng.ownership.owner(p)) for p in req.pages],
        }
    base, cached = out[False], out[True]
    return {
        "logits_equal": torch.equal(base["logits"], cached["logits"]),
        "kv_equal": all(torch.equal(base["kv"][n], cached["kv"][n]) for n in base["kv"]),
        "rows": {k: (base[k], cached[k]) for k in ("direct_rows", "handoff_rows")},
        "evicted": cached["evicted"],
        "owners": (base["owners"], cached["owners"]),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_an_owner_with_only_cached_free_pages_evicts_its_own_and_writes_directly(request, world):
    results = request.getfixturevalue(f"ranks{world}").run(_run)
    tokens = 2 * world * PAGE_SIZE
    assert sum(r["rows"]["direct_rows"][0] for r in results) == tokens  # the baseline is all direct
    for res in results:
        assert res["logits_equal"] and res["kv_equal"], res
        assert res["rows"]["handoff_rows"] == (0, 0), res["rows"]  # no row through the handoff all-gather
        assert res["evicted"] == 2, res  # rank 0's two pages, nothing more
        assert res["owners"][0] == res["owners"][1]  # the same owners as without the cache
    assert sum(r["rows"]["direct_rows"][1] for r in results) == tokens
