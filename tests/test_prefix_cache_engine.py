"""The prefix cache in the runtime on 2 and 4 gloo ranks: a multi-turn conversation and requests sharing a
system prompt give, bit for bit, the tokens, logits and stored KV bytes of the same run without the cache, under
both splits and both KV dtypes, also when the pool is too small for every turn and cached pages are evicted.

No tolerance anywhere: a token's results do not depend on how the batch is cut (every stored value is rounded
from float64 row-wise work, and the logits are summed in a fixed order per row: see :mod:`dtkv.model.model`), and
a cached page holds exactly the bytes recomputing it would write.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dtkv.demo.workloads import chat_workload, compare_runs, run_workload
from dtkv.model import ModelConfig
from tests._runtime import reference_runtime

WORKLOAD = {"system_tokens": 13, "turn_tokens": 5, "turns": 3, "questions": 2, "question_tokens": 3, "seed": 1}
# four shared-prompt requests whose own pages nobody reuses: they crowd a small pool until evicted
CROWDED = {**WORKLOAD, "questions": 4, "question_tokens": 8}
CHUNK, DECODE_STEPS, NUM_PAGES = 16, 2, 64


def _cfg(kv_dtype):
    return ModelConfig(page_size=4, num_layers=2, kv_dtype=kv_dtype)


def check_references(engine) -> None:
    """Every page's reference count is the live requests holding it plus one if cached; nothing else is held."""
    holders = Counter(p for r in engine.requests if not r.finished for p in r.pages)
    holders.update(engine.prefix_cache.cached_pages() if engine.prefix_cache is not None else [])
    alloc = engine.allocator
    for p in range(alloc.ownership.num_pages):
        assert alloc.refcount(p) == holders[p], f"page {p}: {alloc.refcount(p)} references, {holders[p]} holders"


def _runs(rank, world, split, kv_dtype, cache_pages, workload, decode_mode="full"):
    """The workload without the cache (a pool of NUM_PAGES) and with it (``cache_pages``): page ids differ, the
    bytes at every position must not."""
    import torch.distributed as dist

    cfg = _cfg(kv_dtype)
    wl = chat_workload(vocab=cfg.vocab_size, **workload)
    mode = "sharded_direct" if split == "zigzag" else "sharded"
    runs = {}
    for cache in (False, True):
        num_pages = cache_pages if cache else NUM_PAGES
        eng = reference_runtime(
            cfg,
            mode=mode,
            split=split,
            group=dist.group.WORLD,
            num_pages=num_pages,
            prefix_cache=cache,
            decode_mode=decode_mode,
        )
        runs[cache] = run_workload(eng, wl, chunk=CHUNK, decode_steps=DECODE_STEPS, after_step=check_references)
        if cache:
            stats = dict(eng.stats)
    base, cached = runs[False], runs[True]
    return {
        **compare_runs(base, cached),
        "logits_max_rel": max(
            float((a - b).abs().max() / b.abs().max())
            for k in base.logits
            for a, b in zip(base.logits[k], cached.logits[k])
        ),
        "outputs": cached.outputs,
        "hit_rate": cached.hit_rate,
        "hit_tokens": cached.hit_tokens,
        "saved": base.prefill_tokens - cached.prefill_tokens,
        "evicted": cached.evicted_pages,
        "shared": (cached.shared_pages_distinct, cached.shared_pages_referenced, base.shared_pages_distinct),
        "peak": (cached.peak_pages_allocated, base.peak_pages_allocated),
        "stats": stats,
        "direct_rows": stats["direct_rows"],
    }


def _check(results, *, evicted: bool):
    for res in results:
        assert res["tokens_equal"] and res["logits_equal"] and res["kv_equal"], res
        assert res["outputs"] == results[0]["outputs"], "ranks disagree"
        assert res["saved"] == res["hit_tokens"] == res["stats"]["prefix_hit_tokens"] > 0
        distinct, referenced, without = res["shared"]
        assert distinct < referenced == without  # the system prompt's pages are stored once and counted once
        assert (res["evicted"] > 0) == evicted, res["evicted"]


@pytest.mark.multirank
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("split", ["zigzag", "round_robin"])
def test_multi_turn_and_shared_prompt_are_bitwise_equal_to_the_run_without_cache(ranks, split, kv_dtype):
    results = ranks.run(_runs, split, kv_dtype, NUM_PAGES, WORKLOAD)
    _check(results, evicted=False)
    res = results[0]
    assert res["hit_rate"] > 0.5, res["hit_rate"]  # the system prompt and every previous turn were reused
    if split == "zigzag" and ranks.world_size == 2:  # 16-token chunks span 2cp pages: page-aligned, direct
        assert sum(r["direct_rows"] for r in results) > 0


@pytest.mark.multirank
@pytest.mark.parametrize(
    "world,split,kv_dtype",
    [(2, "zigzag", "fp8"), (2, "round_robin", "bf16"), (3, "round_robin", "fp8"), (4, "zigzag", "bf16")],
)
def test_eviction_under_pressure_never_touches_a_live_request_and_stays_bitwise_equal(request, world, split, kv_dtype):
    """18 pages hold the live requests but not every finished one (23 pages without pressure): the cache must
    evict (LRU) to admit later turns, never a page a live request holds (reference counts checked after every
    step), and the run stays bitwise equal -- the live shared-prompt request included."""
    results = request.getfixturevalue(f"ranks{world}").run(_runs, split, kv_dtype, 18, CROWDED)
    _check(results, evicted=True)


@pytest.mark.multirank
def test_sharded_decode_with_the_cache_under_pressure_keeps_tokens_and_kv_bytes(ranks2):
    """``decode_mode="sharded"`` attends where the pages are and merges the ranks' partials in rank order, so its
    float64 sums follow the page placement, which the cache changes (cached pages come from earlier requests):
    tokens and stored KV bytes must be equal, the logits within 1e-9 relative (float64 merge-order noise is
    ~1e-14). The cache evicts before sharded decode steps too (reference counts checked after every step)."""
    results = ranks2.run(_runs, "zigzag", "fp8", 18, CROWDED, "sharded")
    for res in results:
        assert res["tokens_equal"] and res["kv_equal"] and res["logits_max_rel"] < 1e-9, res
        assert res["evicted"] > 0 and res["stats"]["sharded_decode_steps"] > 0
        assert res["saved"] == res["hit_tokens"] > 0


def test_single_process_run_is_bitwise_equal_and_finished_requests_are_left_alone():
    cfg = _cfg("fp8")
    wl = chat_workload(vocab=cfg.vocab_size, **WORKLOAD)
    runs = {}
    for cache in (False, True):
        eng = reference_runtime(cfg, mode="single", num_pages=NUM_PAGES, prefix_cache=cache)
        runs[cache] = run_workload(eng, wl, chunk=CHUNK, decode_steps=DECODE_STEPS, after_step=check_references)
    assert compare_runs(runs[False], runs[True])["parity"]
    assert runs[True].hit_rate > 0.5 and runs[False].hit_tokens == 0
    finished = [r for r in eng.requests if r.finished]
    assert finished and all(r.pages == [] for r in finished)
    with pytest.raises(ValueError, match="rid must name a live request, got rid=0, which is finished already"):
        eng.finish_request(0)
    with pytest.raises(ValueError, match=r"rid must name a request in \[0, 5\), got rid=5"):
        eng.finish_request(5)
    with pytest.raises(ValueError, match="request 0 is finished: its pages were released, got rid=0"):
        eng.kv_bytes(0)
    outputs = [list(r.output) for r in eng.requests]
    eng.decode(1)  # only the live request decodes
    assert [len(r.output) - len(o) for r, o in zip(eng.requests, outputs)] == [
        int(not r.finished) for r in eng.requests
    ]


def test_a_full_prompt_hit_still_computes_the_last_page():
    """A prompt whose every page is cached keeps its last page to compute: its logits give the first token."""
    cfg = _cfg("bf16")
    eng = reference_runtime(cfg, mode="single", num_pages=16, prefix_cache=True)
    prompt = list(range(12))  # three full pages
    first = eng.add_request(prompt)
    eng.prefill(CHUNK)
    again = eng.add_request(prompt)
    assert again.cached_tokens == again.num_computed == 8 and again.pages == first.pages[:2]
    eng.prefill(CHUNK)
    assert again.output == first.output
    assert eng.stats["prefix_hit_tokens"] == 8 and eng.stats["prefix_prompt_tokens"] == 24


def _aligned_after_a_hit(rank, world):
    import torch.distributed as dist

    eng = reference_runtime(_cfg("fp8"), mode="sharded_direct", group=dist.group.WORLD, num_pages=32, prefix_cache=True)
    first = eng.add_request(list(range(24)))
    eng.prefill(24)  # 6 pages from 0: page-aligned, every row direct
    eng.finish_request(first.rid)
    second = eng.add_request(list(range(8)) + list(range(50, 66)))  # its first 2 pages are cached
    before = dict(eng.stats)
    eng.prefill(16)
    return {
        "cached": second.cached_tokens,
        "direct": eng.stats["direct_rows"] - before["direct_rows"],
        "handoff": eng.stats["handoff_rows"] - before["handoff_rows"],
    }


@pytest.mark.multirank
def test_a_hit_ends_on_a_page_boundary_so_the_rest_is_split_page_aligned_with_every_row_direct(ranks2):
    """The recomputed tail starts on a page boundary: no handoff page at the start of the extend."""
    results = ranks2.run(_aligned_after_a_hit)
    assert all(r["cached"] == 8 and r["handoff"] == 0 for r in results), results
    assert sum(r["direct"] for r in results) == 16


def test_a_tokens_logits_do_not_depend_on_the_rows_sharing_its_step():
    """The premise of logits parity: a BLAS GEMM rounds a row differently depending on how many rows share the
    call (MKL: rows past the last multiple of 4), so the logits are summed in a fixed order per row."""
    from dtkv.model import TinyDSA

    model = TinyDSA(ModelConfig())
    g = torch.Generator().manual_seed(5)
    h = torch.randn(9, model.cfg.d_model, generator=g).to(torch.float32)
    full = model.logits(h)
    for n in range(1, 10):
        for i in range(0, 10 - n):
            assert torch.equal(model.logits(h[i : i + n]), full[i : i + n]), (i, n)


def _diverge(rank, world):
    import torch.distributed as dist

    import dtkv
    from dtkv import PrefixCacheMismatchError

    eng = reference_runtime(
        _cfg("bf16"), mode="sharded_direct", group=dist.group.WORLD, num_pages=32, prefix_cache=True
    )
    with dtkv.debug_mode():
        req = eng.add_request(list(range(10)))
        eng.prefill(CHUNK)  # checked after every step: every rank holds the same state
        if rank == 1:  # break the SPMD contract on one rank only
            eng.prefix_cache.match(req.prompt)
        try:
            eng.decode(1)
        except PrefixCacheMismatchError as e:
            return str(e)
    return None


@pytest.mark.multirank
def test_debug_mode_fails_every_rank_together_when_one_rank_cache_diverges(ranks2):
    for msg in ranks2.run(_diverge):
        assert msg is not None and msg.startswith("CP ranks disagree on the prefix cache state: digests differ"), msg
