"""The graph-capturable decode step (:class:`dtkv.decode.DecodeStep`), run eagerly on gloo ranks: sharded, full
view and replicated decode of the same requests against each other and against an independent per-request reference.

Setup: a sharded pool of random fp8 pages (656-byte-style MLA rows at a small geometry and indexer pages), its
replicated copy (every rank holds it whole), four requests of awkward lengths (a long one, one shorter than top-k,
a one-token one, one whose pages all sit on the last rank) in a bucket of six rows (two padding rows), two layers,
two steps on one ``DecodeStep`` per mode: the second step crosses page boundaries and takes new pages
(:func:`dtkv.decode.alloc_decode_pages`) without rebuilding anything (what a captured graph replays).

Tolerances. Float64 path (torch indexer and attention, the reference model's arithmetic): selections equal exactly
(float32-rounded scores of random keys are distinct; ties by position are exact), outputs within 1e-12 relative of
each other and of the reference (float64 summation order only: split softmax over <= 16 rows). Triton indexer
under the interpreter with fp8 queries: the three modes run the same kernel on the same bytes, so selections agree
except where a key's score lands within float32 noise of the K-th (reported as near-ties, none expected at these
seeds); outputs within 1e-5 relative (float32 attention).
"""

from __future__ import annotations

import math

import pytest
import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, PageOwnership
from dtkv.kvio import random_pages

PS = 4
TOPK = 8
LAYERS = 2
HEADS, RANK, ROPE = 2, 64, 16
IHEADS, IDIM = 2, 32
LENS = (37, 9, 1, 14)
PINNED = 3
NUM_PAGES = 96
BUCKET = 6


def _layouts():
    return {
        "kv": MLAFp8Layout(page_size=PS, kv_lora_rank=RANK, rope_dim=ROPE, quant_block=32),
        "index": IndexerFp8Layout(page_size=PS, head_dim=IDIM),
    }


def fill_random(pool, seed: int) -> None:
    """Random stored bytes (:func:`dtkv.kvio.random_pages`): MLA scales in [0.01, 0.02], index scales in [0.5, 1]."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        random_pages(pool.local("kv", layer), pool.layouts["kv"], g, scales=(0.01, 0.02))
        random_pages(pool.local("index", layer), pool.layouts["index"], g, scales=(0.5, 1.0))


def step_inputs(step, seed: int, dtype) -> None:
    """The same random inputs on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    for x in step.inputs:
        for t in x:
            t.copy_((torch.randn(t.shape, generator=g, dtype=torch.float64) / 2).to(t.dtype))


def reference_layer(full: dict, tables, lens, x, *, softmax_scale: float):
    """Per request, over its positions in the logical full pool: float64 scores rounded to float32, stable sort,
    top-k, softmax attention over the selected rows. ``(positions [N, K] -1 padded, out [N, H, R])``."""
    from dtkv import ops

    kv_lay, ix_lay = _layouts()["kv"], _layouts()["index"]
    keys_all = ops.dequantize_indexer_pages(full["index"], ix_lay).reshape(-1, IDIM).double()
    rows_all = ops.dequantize_mla_fp8(full["kv"].reshape(-1, kv_lay.row_bytes), kv_lay).double()
    pos_out = torch.full((len(lens), TOPK), -1, dtype=torch.int64)
    outs = torch.zeros(len(lens), HEADS, RANK, dtype=torch.float64)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = torch.tensor(tables[b])[pos // PS] * PS + pos % PS
        iq, iw = x.iq[b].double(), x.iw[b].double()
        s = (torch.relu(iq @ keys_all[rows].T) * iw[:, None]).sum(0).to(torch.float32)
        order = torch.sort(s, descending=True, stable=True).indices[:TOPK]
        pos_out[b, : order.numel()] = order
        sel = rows_all[rows[order]]
        q = x.q[b].double()
        logits = (q[:, :RANK] @ sel[:, :RANK].T + q[:, RANK:] @ sel[:, RANK:].T) * softmax_scale
        outs[b] = torch.softmax(logits, dim=-1) @ sel[:, :RANK]
    return pos_out, outs


def _run_modes(rank, world, dtype_name, indexer):
    import torch.distributed as dist

    from dtkv import PageAllocator, ShardedKVPool
    from dtkv._util import cdiv
    from dtkv.decode import DecodeStep, DecodeStepConfig, alloc_decode_pages

    dtype = getattr(torch, dtype_name)
    group = dist.group.WORLD
    own = PageOwnership(world, NUM_PAGES, "interleave" if world != 3 else "block")
    pool = ShardedKVPool(_layouts(), own, num_layers=LAYERS, group=group)
    fill_random(pool, 100 + rank)
    alloc = PageAllocator(own)
    tables = [alloc.alloc_balanced(cdiv(n, PS)).tolist() for n in LENS[:PINNED]]
    tables.append(alloc.alloc([world - 1] * cdiv(LENS[PINNED], PS)).tolist())
    repl_own = PageOwnership(1, NUM_PAGES)
    repl = ShardedKVPool(_layouts(), repl_own, num_layers=LAYERS, group=None)
    for layer in range(LAYERS):
        for name, full in pool.gather_full(layer).items():
            repl.local(name, layer).copy_(full)
    scale = 1 / math.sqrt(RANK + ROPE)
    steps = {}
    for mode in ("sharded", "full_view", "replicated"):
        cfg = DecodeStepConfig(mode=mode, num_heads=HEADS, topk=TOPK, softmax_scale=scale, max_batch=BUCKET,
                               max_pages=16, scored_pages=16, attention="torch", indexer=indexer)  # fmt: skip
        steps[mode] = DecodeStep(repl if mode == "replicated" else pool, cfg)
        steps[mode].alloc_inputs(dtype=dtype, index_heads=IHEADS)
    lens = list(LENS)
    report = []
    for it in range(2):
        results = {}
        for mode, st in steps.items():
            st.set_plan(tables, lens)
            step_inputs(st, 7 + it, dtype)
            results[mode] = st.run()
        fulls = [pool.gather_full(layer) for layer in range(LAYERS)]
        for layer in range(LAYERS):
            ref_pos, ref_out = reference_layer(fulls[layer], tables, lens, steps["replicated"].inputs[layer],
                                               softmax_scale=scale)  # fmt: skip
            row = {"step": it, "layer": layer, "ref_pos": ref_pos}
            for mode, res in results.items():
                r = res[layer]
                row[mode] = (DecodeStep.positions(r)[: len(lens)], r.out[: len(lens)].double(), r.lse)
            row["ref_out"] = ref_out
            report.append(row)
        # the next step: one more token each, new pages where a request crosses a page boundary
        lens = [n + 1 + 3 * (b == 0) for b, n in enumerate(lens)]
        needs = [max(0, cdiv(n, PS) - len(t)) for t, n in zip(tables, lens)]
        for t, new in zip(tables, alloc_decode_pages(alloc, tables, needs)):
            t.extend(new)
    comm = {m: st.comm_bytes().sent for m, st in steps.items()}
    calls = {m: st.exchange.calls for m, st in steps.items()}
    return report, comm, calls


@pytest.mark.multirank
def test_three_modes_agree_with_each_other_and_the_reference_float64(ranks234):
    results = ranks234.run(_run_modes, "float64", "torch")
    world = ranks234.world_size
    r0 = results[0][0]
    for report, comm, calls in results:
        assert calls["replicated"] == 0 and calls["sharded"] == 2 * 2 * LAYERS  # 2 steps x 2 exchanges x layers
        assert calls["full_view"] == 2 * 2 * LAYERS and comm["replicated"] == 0
        for row, row0 in zip(report, r0):
            for mode in ("sharded", "full_view", "replicated"):
                pos, out, _ = row[mode]
                assert torch.equal(pos, row["ref_pos"]), (world, mode, row["step"], row["layer"])
                rel = float((out - row["ref_out"]).abs().max() / row["ref_out"].abs().max())
                assert rel < 1e-12, (mode, rel)
                assert torch.equal(out, row0[mode][1])  # every rank holds the same bits
    # padding rows decode nothing
    for row in r0:
        assert torch.isinf(row["sharded"][2][len(LENS) :]).all() and (row["sharded"][2][len(LENS) :] < 0).all()


@pytest.mark.multirank
@pytest.mark.slow
def test_three_modes_agree_with_the_triton_indexer_fp8_queries(ranks2):
    """Interpreter Triton indexer (fp8 queries): the modes agree with each other; against the float64 reference
    only up to query quantization (not compared)."""
    pytest.importorskip("triton")
    from dtkv.ops._common import INTERPRET

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    for report, _, _ in ranks2.run(_run_modes, "bfloat16", "triton"):
        for row in report:
            pos_s, out_s, _ = row["sharded"]
            for mode in ("full_view", "replicated"):
                pos, out, _ = row[mode]
                assert torch.equal(torch.sort(pos, 1).values, torch.sort(pos_s, 1).values), (mode, row["layer"])
                assert float((out - out_s).abs().max() / out_s.abs().max()) < 1e-5


def _too_large_for_one_rank(rank, world, comm):
    import torch.distributed as dist

    from dtkv import PageAllocator, ShardedKVPool
    from dtkv.decode import DecodeStep, DecodeStepConfig

    own = PageOwnership(world, NUM_PAGES)
    pool = ShardedKVPool(_layouts(), own, num_layers=1, group=dist.group.WORLD)
    try:
        cfg = DecodeStepConfig(num_heads=HEADS, topk=TOPK, softmax_scale=0.1, max_batch=2, max_pages=8,
                               attention="torch", comm=comm)  # fmt: skip
        st = DecodeStep(pool, cfg)  # scored_pages defaults to ceil(8 / 2) + 1 = 5
    except ValueError as e:
        return "init: " + str(e)
    alloc = PageAllocator(own)
    tables = [alloc.alloc_balanced(2).tolist(), alloc.alloc([world - 1] * 6).tolist()]  # 6 pages on the last rank
    before = st._plan_dev.clone()
    try:
        st.set_plan(tables, [8, 6 * PS])
    except ValueError as e:
        return str(e), torch.equal(before, st._plan_dev)
    return None


@pytest.mark.multirank
def test_a_plan_too_large_for_one_rank_raises_on_every_rank(ranks2):
    """Only the last rank holds too many of the request's pages, but every rank raises the same error (checked from
    the tables every rank holds: no rank is left waiting in a collective) and the device plan is unchanged."""
    got = ranks2.run(_too_large_for_one_rank, "nccl")
    assert got[0] == got[1] and got[0][1] is True, got
    assert got[0][0] == (
        "request 1 keeps 6 pages on rank 1, more than the step's scored_pages=5: use a larger bucket (scored_pages)"
    )


@pytest.mark.multirank
def test_symm_mem_needs_cuda_on_every_rank(ranks2):
    got = ranks2.run(_too_large_for_one_rank, "symm_mem")
    assert got[0] == got[1] and got[0].startswith("init: comm='symm_mem' needs CUDA tensors"), got


def test_rejects_bad_configs_plans_and_calls():
    from dtkv import ShardedKVPool
    from dtkv.decode import DecodeStep, DecodeStepConfig

    pool = ShardedKVPool(_layouts(), PageOwnership(1, 16), num_layers=1)
    kw = {"num_heads": HEADS, "topk": TOPK, "softmax_scale": 0.1, "max_batch": 2, "max_pages": 4, "attention": "torch"}
    with pytest.raises(ValueError, match=r"mode must be one of \('sharded', 'full_view', 'replicated'\), got mode='x'"):
        DecodeStepConfig(mode="x", **kw)
    with pytest.raises(ValueError, match=r"comm must be one of \('nccl', 'symm_mem'\), got comm='mpi'"):
        DecodeStepConfig(comm="mpi", **kw)
    with pytest.raises(ValueError, match="max_batch must be >= 1, got max_batch=0"):
        DecodeStepConfig(**{**kw, "max_batch": 0})
    with pytest.raises(ValueError, match="pool has no layout 'latent'"):
        DecodeStep(pool, DecodeStepConfig(kv_name="latent", **kw))
    sharded = ShardedKVPool(_layouts(), PageOwnership(1, 16), num_layers=1)
    st = DecodeStep(sharded, DecodeStepConfig(**kw))
    before = st._plan_dev.clone()
    with pytest.raises(ValueError, match=r"len\(seq_lens\) must be <= 2 \(the step's batch bucket\), got 3"):
        st.set_plan([[0], [1], [2]], [1, 1, 1])
    with pytest.raises(ValueError, match="the longest request's pages must be <= 4 .*max_pages.*got 5"):
        st.set_plan([[0, 1, 2, 3, 4]], [5 * PS])
    with pytest.raises(ValueError, match="page_tables\\[0\\] must not repeat a page"):
        st.set_plan([[0, 0]], [PS + 1])
    assert torch.equal(before, st._plan_dev)  # nothing copied
    with pytest.raises(ValueError, match="inputs must hold one StepInputs per layer \\(1\\); see alloc_inputs"):
        st.run()
    with pytest.raises(RuntimeError, match="capture\\(\\) records CUDA graphs; this step runs on cpu"):
        st.capture()
    with pytest.raises(RuntimeError, match="replay\\(\\) needs capture\\(\\) first"):
        st.replay()


@pytest.mark.parametrize("cp", [1, 3])
def test_row_by_row_plans_equal_plans_built_whole(cp):
    """A bucket's plan kept row by row (:class:`dtkv.decode._bucket_plan.RowCache`, what ``set_plan(..., keys=)``
    uses) rebuilds only the rows whose request or pages changed; over steps that grow requests across page
    boundaries, swap a request in, shrink and regrow the batch, every plan equals the plan built whole, on every rank
    of the ownership. A bad plan raises as the whole build does, and the next call rebuilds every row."""
    from dtkv import PageAllocator
    from dtkv.decode import alloc_decode_pages
    from dtkv.decode._bucket_plan import BucketLayout, RowCache, build_bucket_plan

    own = PageOwnership(cp, NUM_PAGES)
    alloc = PageAllocator(own)
    layout = BucketLayout(batch=BUCKET, max_pages=16, scored_pages=16, send_pages=0)
    caches = [RowCache(layout, "sharded") for _ in range(cp)]
    t = [alloc.alloc_balanced(-(-n // PS)).tolist() for n in LENS]
    n_, k = list(LENS), list(range(len(LENS)))
    spare = [list(p) for p in t]
    for step in range(10):
        if step == 4:  # request 1 leaves, a new one takes its row
            t[1], n_[1], k[1] = alloc.alloc_balanced(2).tolist(), 6, 99
        if step == 6:  # the batch shrinks, then regrows
            t, n_, k = t[:2], n_[:2], k[:2]
        if step == 8:
            t, n_, k = [*t, spare[3]], [*n_, LENS[3]], [*k, 3]
        n_ = [x + 1 for x in n_]
        needs = [max(0, -(-x // PS) - len(p)) for x, p in zip(n_, t)]
        for p, new in zip(t, alloc_decode_pages(alloc, t, needs)):
            p.extend(new)
        for rank, cache in enumerate(caches):
            got = cache.update(t, n_, k, own, rank, page_size=PS, topk=TOPK)
            want = build_bucket_plan(layout, "sharded", t, n_, own, rank, page_size=PS, topk=TOPK)
            assert torch.equal(got, want), (rank, step)
        if step not in (0, 4, 8):  # only the rows that took a page are rebuilt
            assert caches[0].rebuilt == sum(1 for x in needs if x), (step, needs)
    cache = caches[0]
    with pytest.raises(ValueError, match="must not repeat a page"):
        cache.update([[t[0][0]] * len(t[0]), *t[1:]], n_, [1000, *k[1:]], own, 0, page_size=PS, topk=TOPK)
    with pytest.raises(ValueError, match=r"page_tables\[0\] must hold ceil\(seq_lens\[0\] / page_size\)"):
        cache.update(t, [n_[0] + 10 * PS, *n_[1:]], k, own, 0, page_size=PS, topk=TOPK)
    got = cache.update(t, n_, k, own, 0, page_size=PS, topk=TOPK)  # dropped: rebuilt whole, still right
    assert cache.rebuilt == len(t)
    assert torch.equal(got, build_bucket_plan(layout, "sharded", t, n_, own, 0, page_size=PS, topk=TOPK))
