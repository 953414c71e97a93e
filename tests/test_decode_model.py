"""Sharded decode of the reference model (``decode_mode="sharded"``) on 2, 3 and 4 gloo ranks, bf16 and fp8 KV,
against full-view decode, over 32 greedy steps of four requests: a long one, one shorter than top-k that grows past
it, a one-page one, and one whose prompt pages all sit on the last rank.

What must hold, and the tolerances:

- the global top-k equals the full view's top-k *exactly*, in every layer of every step, on every rank
  (``DTKV_DEBUG`` checks each selection against ``TinyDSA.select`` over the gathered full view and counts it);
- greedy tokens equal the full-view decode's for all 32 steps;
- logits within 1e-9 relative of the full-view decode's. Sharded decode changes only float64 summation order
  (the split softmax, GEMMs over other shapes), ~1e-15 relative per layer; the float32 hidden state absorbs most
  of it (we measure 0 in practice). A value within ~1e-16 of a float32 rounding boundary may round the other way,
  changing one hidden element by one float32 ulp (6e-8 relative); 1e-9 allows for the float64 noise with a
  million-fold margin, like the CP-vs-single comparison of ``tests/test_model.py``, and a bug (a missing rank, a
  wrong row) moves logits by 1e-3 or more. Stored KV bytes: >= 99.9% identical (bf16/fp8 rounding of equal values
  is equal; measured 100%).
- memory: per-rank pool bytes are 1/cp of replicated and no full view is built (the materialization entry points
  raise if called); the collectives carry exactly the candidates and the partials, the same bytes for a short and
  a long context.
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

from dtkv._util import cdiv
from dtkv.model import ModelConfig
from tests._runtime import plan_sharded, reference_runtime

PROMPT_LENS = (37, 9, 3, 14)  # long, shorter than top-k (24), one page, pinned to one rank
PINNED = 3
STEPS = 32
CHUNK = 16
NUM_PAGES = 96  # divisible by 2, 3 and 4: per-rank bytes are exactly 1/cp


def _cfg(kv_dtype: str) -> ModelConfig:
    return ModelConfig(kv_dtype=kv_dtype, page_size=4, num_layers=2)


def _prompts(lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]


def _decode(eng, steps):
    logits = []
    for _ in range(steps):
        reqs = [r for r in eng.requests if r.output]
        logits.append(eng.decode_step(reqs))
        for r, row in zip(reqs, logits[-1]):
            r.output.append(int(row.argmax()))
    return logits


@contextlib.contextmanager
def one_thread():
    """Run the tiny in-process model on one thread: two OpenMP threads on a busy 2-core box are 40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def _full_view_reference(kv_dtype: str):
    """Full-view decode in one process (the numerical reference; CP full-view decode matches it, test_model)."""
    with one_thread():
        eng = reference_runtime(_cfg(kv_dtype), mode="single", num_pages=NUM_PAGES)
        for p in _prompts():
            eng.add_request(p)
        eng.prefill(CHUNK)
        logits = _decode(eng, STEPS)
        return logits, [list(r.output) for r in eng.requests], [eng.kv_bytes(r.rid) for r in eng.requests]


def _sharded_rank(rank, world, kv_dtype, mode, scheme):
    import torch.distributed as dist

    import dtkv

    cfg = _cfg(kv_dtype)
    eng = reference_runtime(
        cfg, mode=mode, group=dist.group.WORLD, num_pages=NUM_PAGES, scheme=scheme, decode_mode="sharded"
    )
    for i, p in enumerate(_prompts()):
        req = eng.add_request(p)
        if i == PINNED and mode == "sharded":  # every prompt page on the last rank
            req.pages = eng.allocator.alloc([world - 1] * cdiv(len(p), cfg.page_size)).tolist()
    eng.prefill(CHUNK)
    prompt_pages = [len(r.pages) for r in eng.requests]
    scratch_after_prefill = eng.stats["scratch_bytes"]
    ptrs = {n: eng.pool.buffer(n).data_ptr() for n in cfg.layouts}
    with dtkv.debug_mode():
        logits = _decode(eng, STEPS)
    owners = [[eng.ownership.owner(p) for p in r.pages] for r in eng.requests]
    return {
        "logits": logits,
        "outputs": [list(r.output) for r in eng.requests],
        "kv": [eng.kv_bytes(r.rid) for r in eng.requests],
        "stats": dict(eng.stats),
        "scratch_after_prefill": scratch_after_prefill,
        "owners": owners,
        "prompt_pages": prompt_pages,
        "bytes_per_rank": eng.pool.bytes_per_rank(),
        "replicated_bytes": eng.pool.replicated_bytes(),
        "same_buffers": all(eng.pool.buffer(n).data_ptr() == ptrs[n] for n in cfg.layouts),
    }


_CASES = {2: ("sharded_direct", "interleave"), 3: ("sharded", "block"), 4: ("sharded", "interleave")}


@pytest.mark.multirank
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_sharded_decode_matches_full_view_decode(ranks234, kv_dtype):
    world = ranks234.world_size
    mode, scheme = _CASES[world]
    results = ranks234.run(_sharded_rank, kv_dtype, mode, scheme)
    ref_logits, ref_outputs, ref_kv = _full_view_reference(kv_dtype)
    cfg = _cfg(kv_dtype)
    r0 = results[0]
    for res in results:
        assert res["outputs"] == ref_outputs  # 32 greedy tokens of every request
        assert all(torch.equal(a, b) for a, b in zip(res["logits"], r0["logits"]))  # ranks in lockstep, bitwise
        # the exact top-k was checked against the full view in every layer of every step, on every rank
        assert res["stats"]["topk_checks"] == STEPS * cfg.num_layers
        assert res["stats"]["sharded_decode_steps"] == STEPS and res["stats"]["steps"] > 0
        assert res["stats"]["scratch_bytes"] == res["scratch_after_prefill"]  # decode built no view scratch
        assert res["bytes_per_rank"] * world == res["replicated_bytes"] and res["same_buffers"]
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(r0["logits"], ref_logits))
    assert rel <= 1e-9, rel
    same = sum(int((a[n] == b[n]).sum()) for a, b in zip(r0["kv"], ref_kv) for n in a)
    assert same / sum(a[n].numel() for a in ref_kv for n in a) >= 0.999
    # decode-time pages: each request's next page goes to the rank holding fewest of its pages
    for i, (owners, n_prompt) in enumerate(zip(r0["owners"], r0["prompt_pages"])):
        counts = [owners.count(k) for k in range(world)]
        if i == PINNED and mode == "sharded":
            assert set(owners[:n_prompt]) == {world - 1}
            catch_up = min(len(owners) - n_prompt, n_prompt * (world - 1))
            assert world - 1 not in owners[n_prompt : n_prompt + catch_up]
        else:
            prompt_counts = [owners[:n_prompt].count(k) for k in range(world)]
            assert max(counts) - min(counts) <= max(1, max(prompt_counts) - min(prompt_counts))


def _layer_vs_attend(rank, world, kv_dtype):
    """One layer of one decode step: decode_layer on the shards vs TinyDSA.attend over the gathered full view."""
    import torch.distributed as dist

    from dtkv.decode import DecodeQueries, decode_layer
    from dtkv.kvio import read_rows, write_rows

    cfg = _cfg(kv_dtype)
    eng = reference_runtime(cfg, mode="sharded", group=dist.group.WORLD, num_pages=NUM_PAGES, decode_mode="sharded")
    for p in _prompts():
        eng.add_request(p)
    eng.prefill(CHUNK)
    reqs = eng.requests
    plan = plan_sharded(eng, reqs)
    ids = torch.tensor([r.tokens[r.num_computed] for r in reqs])
    q = eng.adapter.model.project(0, eng.adapter.model.embed_tokens(ids), plan.query_pos)
    for name, rows in (("kv", q["kv"]), ("index", q["index_k"])):
        write_rows(eng.pool.local(name, 0), cfg.layouts[name], rows, plan.new_locs, eng.ownership_spec, rank)
    res = decode_layer(
        eng.pool.local("kv", 0),
        eng.pool.local("index", 0),
        cfg.kv_layout,
        cfg.index_layout,
        plan,
        DecodeQueries(q["iq"], q["iw"], q["q_nope"], q["q_rope"]),
        softmax_scale=1 / math.sqrt(cfg.kv_lora_rank + cfg.rope_dim),
        group=dist.group.WORLD,
    )
    keys = read_rows(eng.pool.gather_full(0, "kv"), cfg.kv_layout, torch.float64)
    index_keys = read_rows(eng.pool.gather_full(0, "index"), cfg.index_layout, torch.float64)
    worst, same_sel = 0.0, True
    for b, r in enumerate(reqs):
        pos = torch.arange(int(plan.query_pos[b]) + 1)
        rows = torch.tensor(r.pages)[pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
        qb = {k: v[b : b + 1] for k, v in q.items()}
        want = eng.adapter.model.attend(qb, pos[-1:], keys[rows], index_keys[rows]).view(cfg.num_heads, -1)
        worst = max(worst, float((res.out[b] - want).abs().max() / want.abs().max()))
        idx, valid = eng.adapter.model.select(qb, pos[-1:], index_keys[rows])
        got = res.positions[b]
        same_sel &= torch.equal(got[: idx.shape[1]], torch.where(valid[0], idx[0], -1)) and bool(
            (got[idx.shape[1] :] == -1).all()
        )
    return worst, same_sel


@pytest.mark.multirank
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_decode_layer_matches_full_view_attention(ranks234, kv_dtype):
    """Same KV bytes on both sides, one layer: only float64 summation order differs (split softmax over at most
    24 rows: ~24 * 2**-53 = 3e-15 relative); we allow 1e-12."""
    for worst, same_sel in ranks234.run(_layer_vs_attend, kv_dtype):
        assert same_sel and worst < 1e-12, worst


def _no_view_and_comm_bytes(rank, world, lens):
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import dtkv.materialize
    import dtkv.pool
    import dtkv.runtime._plan as plan_mod
    import dtkv.runtime.context as context_mod
    from dtkv.decode import sharded_decode_comm_bytes

    cfg = _cfg("fp8")
    eng = reference_runtime(cfg, mode="sharded_direct", group=dist.group.WORLD, num_pages=192, decode_mode="sharded")
    for p in _prompts(lens):
        eng.add_request(p)
    eng.prefill(64)

    def forbidden(*args, **kwargs):
        raise AssertionError("sharded decode must not build or gather a full view")

    class Count(TorchDispatchMode):
        sent = 0
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "all_gather" in name or "allgather" in name:
                sent = args[1] if "_allgather_base" in name else args[0]  # c10d's (output, input) or funcol's input
                Count.sent += sent.numel() * sent.element_size()
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    from dtkv.decode._exchange import Exchange

    sent_by_step = {"bytes": 0, "calls": 0}
    honest_gather = Exchange.all_gather

    def counted(self, out, inp):
        if self.active:
            sent_by_step["bytes"] += inp.numel() * inp.element_size()
            sent_by_step["calls"] += 1
        return honest_gather(self, out, inp)

    saved = {(Exchange, "all_gather"): honest_gather}
    Exchange.all_gather = counted
    targets = [
        (plan_mod, "plan_materialize"),
        (context_mod, "gather_view"),
        (context_mod, "Materializer"),
        (dtkv.materialize, "gather_view"),
        (dtkv.pool, "gather_pages"),
        (dtkv.pool.ShardedKVPool, "gather_full"),
    ]
    for obj, name in targets:
        saved[(obj, name)] = getattr(obj, name)
        setattr(obj, name, forbidden)
    try:
        with Count():
            eng.decode(3)
    finally:
        for (obj, name), v in saved.items():
            setattr(obj, name, v)
    want = sharded_decode_comm_bytes(
        num_queries=len(lens), topk=cfg.index_topk, num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank,
        cp_size=world, partial_itemsize=8,
    )  # fmt: skip
    return {"sent": sent_by_step["bytes"], "calls": sent_by_step["calls"], "all_sent": Count.sent,
            "all_calls": Count.calls, "want": want.sent * cfg.num_layers * 3, "stats": eng.stats}  # fmt: skip


@pytest.mark.multirank
def test_sharded_decode_builds_no_view_and_sends_only_candidates_and_partials(ranks3):
    short = ranks3.run(_no_view_and_comm_bytes, (5, 30))
    long = ranks3.run(_no_view_and_comm_bytes, (400, 250))  # 50x the context, same traffic
    for res in short + long:
        assert res["sent"] == res["want"] and res["calls"] == 2 * 2 * 3  # 2 exchanges x 2 layers x 3 steps
        assert res["stats"]["decode_comm_bytes"] == res["sent"]
        # every other collective is the runtime's per-step agreement on its inputs and its outcome vote (two per
        # step): a few bytes, never KV
        assert res["all_calls"] - res["calls"] <= 2 * 3 and 0 <= res["all_sent"] - res["sent"] <= 2 * 3 * 256
    assert short[0]["sent"] == long[0]["sent"]


def test_decode_mode_is_validated():
    cfg = _cfg("bf16")
    with pytest.raises(ValueError, match=r"decode_mode must be one of \('full', 'sharded'\), got decode_mode='shard'"):
        reference_runtime(cfg, mode="single", num_pages=8, decode_mode="shard")
    with pytest.raises(ValueError, match="decode_mode='sharded' needs a page-sharded pool .* got mode='replicated'"):
        reference_runtime(cfg, mode="replicated", num_pages=8, decode_mode="sharded")


def test_rejects_a_request_with_nothing_to_decode_and_a_mismatched_plan():
    from dtkv.decode import DecodeQueries, decode_layer, plan_decode

    cfg = _cfg("fp8")
    eng = reference_runtime(cfg, mode="single", num_pages=8, decode_mode="sharded")
    req = eng.add_request([1, 2, 3])
    req.num_computed = 3  # prefilled, but no first token appended
    with pytest.raises(ValueError, match="request 0 has no token to decode"):
        eng.decode_step([req])
    plan = plan_decode([[0]], [2], eng.ownership, 0, page_size=2, topk=4)
    q = DecodeQueries(torch.zeros(1, 2, 32), torch.zeros(1, 2), torch.zeros(1, 2, 64), torch.zeros(1, 2, 16))
    kv, index = eng.pool.local("kv", 0), eng.pool.local("index", 0)
    with pytest.raises(ValueError, match="plan.page_size must equal the layouts' page_size, got plan.page_size=2"):
        decode_layer(kv, index, cfg.kv_layout, cfg.index_layout, plan, q, softmax_scale=1.0, group=None)
    plan = plan_decode([[0]], [2], eng.ownership, 0, page_size=4, topk=4)
    with pytest.raises(ValueError, match=r"kv_local must be \[pages, 4, 104\], got \[8, 4, 16\]"):
        decode_layer(kv[..., :16], index, cfg.kv_layout, cfg.index_layout, plan, q, softmax_scale=1.0, group=None)


def test_single_process_sharded_decode_equals_full_view_decode():
    """With one rank the sharded path is plain local decode: the same tokens, and logits to the float64 noise."""
    ref_logits, ref_outputs, _ = _full_view_reference("fp8")
    with one_thread():
        eng = reference_runtime(_cfg("fp8"), mode="single", num_pages=NUM_PAGES, decode_mode="sharded")
        for p in _prompts():
            eng.add_request(p)
        eng.prefill(CHUNK)
        logits = _decode(eng, STEPS)
    assert [list(r.output) for r in eng.requests] == ref_outputs
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits)) <= 1e-9
    assert eng.stats["decode_comm_bytes"] == 0


def _inject_lost_candidate(rank, world):
    import torch.distributed as dist

    import dtkv
    import dtkv.decode._step_layer as layer_mod
    from dtkv.decode import INVALID_KEY, SelectionMismatchError

    eng = reference_runtime(
        _cfg("bf16"), mode="sharded", group=dist.group.WORLD, num_pages=NUM_PAGES, decode_mode="sharded"
    )
    for p in _prompts():
        eng.add_request(p)
    eng.prefill(CHUNK)
    honest = layer_mod.local_topk

    def lossy(keys, k, **kwargs):  # the bug: the last rank loses its best candidate of every query
        top = honest(keys, k)  # sorted: the first is the best
        if rank == world - 1:
            top = torch.cat((top[:, 1:], torch.full_like(top[:, :1], INVALID_KEY)), dim=1)
        return top

    layer_mod.local_topk = lossy
    try:
        with dtkv.debug_mode():
            eng.decode_step([r for r in eng.requests if r.output])
    except SelectionMismatchError as e:
        return str(e)
    finally:
        layer_mod.local_topk = honest
    return None


@pytest.mark.multirank
def test_debug_mode_catches_a_lost_candidate_on_every_rank(ranks3):
    messages = ranks3.run(_inject_lost_candidate)
    assert messages[0] is not None and len(set(messages)) == 1, messages  # the same error everywhere, no hang
    assert messages[0].startswith("DTKV_DEBUG: sharded top-k of layer 0 differs from the full view's top-k at query")


def _compiled_layer(rank, world):
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from dtkv.decode import DecodeQueries, decode_layer

    torch._dynamo.reset()
    cfg = _cfg("fp8")
    eng = reference_runtime(cfg, mode="sharded", group=dist.group.WORLD, num_pages=NUM_PAGES, decode_mode="sharded")
    for p in _prompts():
        eng.add_request(p)
    eng.prefill(CHUNK)
    plan = plan_sharded(eng, eng.requests)
    ids = torch.tensor([r.tokens[r.num_computed] for r in eng.requests])
    q = eng.adapter.model.project(0, eng.adapter.model.embed_tokens(ids), plan.query_pos)
    args = (eng.pool.local("kv", 0), eng.pool.local("index", 0), cfg.kv_layout, cfg.index_layout, plan)
    queries = DecodeQueries(q["iq"], q["iw"], q["q_nope"], q["q_rope"])
    kwargs = {"softmax_scale": 0.1, "group": dist.group.WORLD}
    eager = decode_layer(*args, queries, **kwargs)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(decode_layer, backend=counter, fullgraph=True)(*args, queries, **kwargs)
    return counter.frame_count, all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.multirank
@pytest.mark.slow
def test_decode_layer_compiles_fullgraph_with_its_collectives(ranks2):
    """aot_eager keeps eager kernels: one graph (no break, no host sync), bitwise the eager result."""
    for frames, equal in ranks2.run(_compiled_layer):
        assert frames == 1 and equal
