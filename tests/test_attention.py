"""The attention-backend seam (``dtkv.attention``) on CPU: fit rules, the resolver, index construction, the contract.

- fit rules and resolver errors are pinned to their text; an explicit name never falls back, ``"auto"`` reports a
  faster backend that is available but does not fit, with the rule, and takes the next one;
- index construction against brute-force loops (awkward sizes, ``-1`` padding, pages outside the view, empty ranks);
- the seam's torch and Triton backends against a float64 loop reference (``tests/attention_reference.py``), and the
  view path against the replicated-pool path bit for bit on gloo ranks (2, 3, 4): the same bytes read through
  remapped indices give the same output;
- sharded decode over each rank's own pages (others' rows ``-1``) merged with :func:`dtkv.decode.merge_partials`
  equals decode over the whole pool, with empty partials (ranks that own none of a query's rows, and a rank that
  stores no page at all) weighing nothing.

Tolerances: torch in float64 vs the loop reference ``1e-12`` (summation order); the merge of float64 partials vs one
softmax ``1e-12`` (split-softmax identity, summation order); Triton in float32 ``2e-5``.
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from dtkv import MLAFp8Layout, MLALatentLayout, PageOwnership, debug_mode
from dtkv.attention import (
    AttentionBackend,
    AttentionFitError,
    AttentionSpec,
    available_backends,
    check_fit,
    dense_page_table,
    fit_errors,
    owned_page_map,
    positions_to_locs,
    resolve_attention,
)
from dtkv.ops import quantize_mla_fp8
from tests.attention_reference import ref_sparse_mla
from tests.ops_reference import backend_ok

FP8 = MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32)
BF16 = MLALatentLayout(page_size=4, kv_lora_rank=64, rope_dim=16)
LAYOUTS = [pytest.param(FP8, id="fp8"), pytest.param(BF16, id="bf16")]
V32_FP8 = MLAFp8Layout(page_size=64)  # DeepSeek-V3.2: 512 + 64, quant_block 128, page 64
SCALE = 1 / math.sqrt(80)
TRITON = pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="needs Triton in interpreter mode")


def _spec(layout=FP8, heads=4, topk=12):
    return AttentionSpec(num_heads=heads, layout=layout, topk=topk)


# ----------------------------------------------------------------------------------------- fit rules
@pytest.mark.parametrize(
    ("spec", "capability", "rules"),
    [
        (AttentionSpec(num_heads=128, layout=V32_FP8, topk=2048), (9, 0), []),
        (AttentionSpec(num_heads=64, layout=MLALatentLayout(page_size=16), topk=2048), (10, 0), []),
        (
            AttentionSpec(num_heads=16, layout=V32_FP8, topk=2048),
            (9, 0),
            ["flashmla needs 64 or 128 query heads per rank, got num_heads=16 (heads per rank after any "
             "tensor-parallel split)"],
        ),
        (
            AttentionSpec(num_heads=128, layout=MLAFp8Layout(page_size=32), topk=2048),
            None,
            ["flashmla reads fp8 pages of page_size=64 only, got page_size=32"],
        ),
        (
            AttentionSpec(num_heads=128, layout=MLAFp8Layout(page_size=64, quant_block=64), topk=2048),
            None,
            ["flashmla reads the 656-byte fp8 row (quant_block=128), got quant_block=64"],
        ),
        (
            AttentionSpec(num_heads=64, layout=MLALatentLayout(page_size=64, store_dtype=torch.float32), topk=64),
            None,
            ["flashmla reads bf16 latent pages, got store_dtype=torch.float32"],
        ),
        (
            AttentionSpec(num_heads=64, layout=V32_FP8, topk=64),
            (8, 0),
            ["flashmla's kernels run on compute capability 9.x (SM90, Hopper) or 10.x (SM100), got 8.0"],
        ),
        (
            _spec(),
            None,
            ["flashmla needs 64 or 128 query heads per rank, got num_heads=4 (heads per rank after any "
             "tensor-parallel split)",
             "flashmla needs kv_lora_rank=512 and rope_dim=64 (d_qk 576, d_v 512), got kv_lora_rank=64, rope_dim=16",
             "flashmla reads fp8 pages of page_size=64 only, got page_size=4",
             "flashmla reads the 656-byte fp8 row (quant_block=128), got quant_block=32"],
        ),
    ],
)  # fmt: skip
def test_flashmla_fit_rules(spec, capability, rules):
    assert fit_errors("flashmla", spec, device="cpu", capability=capability) == rules


def test_triton_and_torch_fit_rules():
    odd = AttentionSpec(num_heads=3, layout=MLALatentLayout(page_size=5, kv_lora_rank=48, rope_dim=8), topk=7)
    assert fit_errors("triton", odd) == [
        "triton needs kv_lora_rank and rope_dim to be powers of two >= 16, got kv_lora_rank=48, rope_dim=8"
    ]
    f64 = AttentionSpec(num_heads=2, layout=MLALatentLayout(page_size=4, store_dtype=torch.float64), topk=4)
    assert fit_errors("triton", f64) == ["triton reads bf16/fp16/fp32 latent pages, got store_dtype=torch.float64"]
    assert fit_errors("torch", odd) == fit_errors("torch", f64) == []
    with pytest.raises(AttentionFitError, match=re.escape("attention does not fit 'triton': triton needs kv_lora")):
        check_fit("triton", odd)
    with pytest.raises(ValueError, match=re.escape("attention backend must be one of ('torch', 'triton', 'flashmla'), "
                                                   "got 'cuda'")):  # fmt: skip
        fit_errors("cuda", odd)
    with pytest.raises(TypeError, match="spec must be an AttentionSpec, got dict"):
        fit_errors("torch", {})


def test_spec_rejects_bad_fields():
    with pytest.raises(ValueError, match="num_heads must be >= 1, got num_heads=0"):
        AttentionSpec(num_heads=0, layout=FP8, topk=4)
    with pytest.raises(TypeError, match="layout must be MLALatentLayout or MLAFp8Layout, got IndexerFp8Layout"):
        from dtkv import IndexerFp8Layout

        AttentionSpec(num_heads=2, layout=IndexerFp8Layout(), topk=4)


# ----------------------------------------------------------------------------------------- resolver
def test_auto_on_cpu_is_torch_and_says_why():
    backend = resolve_attention("auto", spec=_spec(), device="cpu")
    assert backend.name == "torch" and backend.reason == "auto on cpu: fastest available that fits"


def test_explicit_names_never_fall_back():
    assert resolve_attention("torch", spec=_spec(), device="cpu").reason == "attention='torch' asked for"
    with pytest.raises(NotImplementedError, match=re.escape("attention='flashmla' is unavailable: flashmla needs a "
                                                            "CUDA device, got cpu")):  # fmt: skip
        resolve_attention("flashmla", spec=_spec(), device="cpu")
    with pytest.raises(ValueError, match=re.escape("attention must be one of ('auto', 'torch', 'triton', 'flashmla'), "
                                                   "got attention='fast'")):  # fmt: skip
        resolve_attention("fast", spec=_spec(), device="cpu")
    assert (
        set(available_backends("cpu")) == {"torch", "triton", "flashmla"} and available_backends("cpu")["torch"] == ""
    )


@pytest.fixture
def cuda_available_everything(monkeypatch):
    """Pretend every backend is available on a CUDA device (no GPU needed: nothing runs)."""
    import dtkv.attention._resolve as res

    monkeypatch.setattr(res, "availability", lambda name, device: "")
    monkeypatch.setattr(res, "_warned", set())


def test_auto_reports_a_faster_backend_that_does_not_fit(cuda_available_everything, caplog):
    spec = AttentionSpec(num_heads=16, layout=V32_FP8, topk=2048)  # 128 heads over tensor-parallel 8
    with caplog.at_level(logging.WARNING, logger="dtkv.attention"):
        backend = resolve_attention("auto", spec=spec, device="cuda", capability=(9, 0))
    assert backend.name == "triton"
    rule = "flashmla needs 64 or 128 query heads per rank, got num_heads=16"
    assert rule in backend.reason and backend.reason.startswith("auto on cuda: fastest available that fits; flashmla")
    assert any(rule in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dtkv.attention"):
        again = resolve_attention("auto", spec=spec, device="cuda", capability=(9, 0))
    assert again.reason == backend.reason and not caplog.records  # reported once per process
    with pytest.raises(AttentionFitError, match=re.escape(f"attention does not fit 'flashmla': {rule}")):
        resolve_attention("flashmla", spec=spec, device="cuda", capability=(9, 0))


def test_auto_falls_to_torch_when_neither_kernel_fits(cuda_available_everything):
    spec = AttentionSpec(num_heads=3, layout=MLALatentLayout(page_size=5, kv_lora_rank=48, rope_dim=8), topk=7)
    backend = resolve_attention("auto", spec=spec, device="cuda", capability=(9, 0))
    assert backend.name == "torch" and "triton: does not fit (triton needs kv_lora_rank" in backend.reason


# ----------------------------------------------------------------------------------------- index construction
def test_positions_to_locs_vs_loops():
    g = torch.Generator().manual_seed(4)
    table = torch.tensor([[5, 2, -1, 7], [0, 3, 6, 1], [4, -1, -1, -1]])  # request 0's slot 2 not held (sharded)
    rows = torch.tensor([0, 2, 1, 1, 0])
    pos = torch.randint(-1, 19, (5, 9), generator=g)  # past the table's 4 pages of 4 tokens too
    got = positions_to_locs(pos, table, page_size=4, rows=rows)
    for n in range(5):
        for j in range(9):
            p, t = int(pos[n, j]), table[int(rows[n])].tolist()
            want = -1 if p < 0 or p // 4 >= 4 or t[p // 4] < 0 else t[p // 4] * 4 + p % 4
            assert int(got[n, j]) == want
    assert torch.equal(positions_to_locs(pos[:3], table, page_size=4), positions_to_locs(pos[:3], table, page_size=4,
                                                                                      rows=torch.arange(3)))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("page_table must have one row per query without rows=")):
        positions_to_locs(pos, table, page_size=4)


def test_dense_page_table_from_csr_vs_loops():
    kv_indptr = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)  # an empty request, one past max_pages
    kv_indices = torch.tensor([5, 2, 9, 0, 4, 6, 1, 3], dtype=torch.int32)
    got = dense_page_table(kv_indptr, kv_indices, max_pages=3)
    assert got.tolist() == [[5, 2, 9], [-1, -1, -1], [0, 4, 6], [3, -1, -1]]
    empty = dense_page_table(torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), max_pages=2)
    assert empty.tolist() == [[-1, -1], [-1, -1]]


@pytest.mark.parametrize(("cp", "num_pages", "scheme"), [(1, 5, "interleave"), (3, 10, "interleave"), (3, 4, "block")])
def test_owned_page_map_vs_ownership(cp, num_pages, scheme):
    own = PageOwnership(cp, num_pages, scheme)
    for rank in range(cp):
        m = owned_page_map(own, rank)
        assert m.dtype == torch.int32 and m.shape == (num_pages,)
        for p in range(num_pages):
            assert int(m[p]) == (own.local_index(p) if own.owner(p) == rank else -1)
    with pytest.raises(ValueError, match=re.escape(f"rank must be < ownership.cp_size={cp}, got rank={cp}")):
        owned_page_map(own, cp)


def test_backend_indices_bound_pad_and_remap():
    backend = resolve_attention("torch", spec=_spec(), device="cpu")
    kv = torch.zeros(6, 4, FP8.row_bytes, dtype=torch.uint8)  # 24 slots
    locs = torch.tensor([[0, 13, 27, -1, 23], [40, 5, 6, 7, 8]])
    page_map = torch.tensor([2, -1, 0, 5, 1, 4, -1, 3, -1, -1, 9], dtype=torch.int32)  # page 10 -> 9: past the view
    got = backend.indices(locs, kv, page_map=page_map)
    assert got.tolist() == [[8, 21, -1, -1, 19], [-1, -1, -1, -1, 0]]  # 27: page 6 absent; 40: page 10 -> slot 36
    assert backend.indices(locs, kv).tolist() == [[0, 13, -1, -1, 23], [-1, 5, 6, 7, 8]]


class _Wide(AttentionBackend):
    """A stand-in for a kernel with a top-k block of 64 (FlashMLA's rule, checked by the base class)."""

    name = "wide"
    index_multiple = 64

    def _run(self, q, kv, indices, softmax_scale, schedule, *, decode):
        return self._empty(q, torch.float32, torch.float32)


def test_index_width_rule_is_checked_and_built_indices_fit_it():
    backend = _Wide(_spec(topk=24), "cpu")
    q, kv = torch.zeros(3, 4, 80), torch.zeros(6, 4, FP8.row_bytes, dtype=torch.uint8)
    msg = ("wide needs an index width that is a multiple of 64 (its top-k block), got width=24: build indices with "
           "backend.indices(...) or dtkv.ops.sparse_indices(..., width=backend.index_width(topk)), which pad with -1")  # fmt: skip
    with pytest.raises(AttentionFitError, match=re.escape(msg)):
        backend.prefill(q, kv, torch.zeros(3, 24, dtype=torch.int32), softmax_scale=0.1)
    idx = backend.indices(torch.zeros(3, 24, dtype=torch.int64), kv)
    assert idx.shape == (3, 64) and backend.index_width(24) == 64 and backend.index_width(128) == 128
    out, lse = backend.prefill(q, kv, idx, softmax_scale=0.1)
    assert out.shape == (3, 4, 64) and lse.shape == (3, 4)
    with pytest.raises(AttentionFitError, match="got width=100"):
        backend.plan_decode(3, 100)


def test_run_checks_shapes_schedules_and_debug_ranges():
    backend = resolve_attention("torch", spec=_spec(), device="cpu")
    q, kv = torch.zeros(3, 4, 80), torch.zeros(6, 4, FP8.row_bytes, dtype=torch.uint8)
    idx = torch.zeros(3, 12, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape("q must have shape [*, 4, 80], got q.shape=[3, 5, 80] (dim 1)")):
        backend.prefill(torch.zeros(3, 5, 80), kv, idx, softmax_scale=0.1)
    with pytest.raises(ValueError, match=re.escape("kv must have shape [*, 4, 104]")):
        backend.prefill(q, torch.zeros(6, 4, 80, dtype=torch.uint8), idx, softmax_scale=0.1)
    with pytest.raises(ValueError, match=re.escape("indices must have shape [3, *]")):
        backend.prefill(q, kv, idx[:2], softmax_scale=0.1)
    schedule = backend.plan_decode(3, 12)
    assert schedule.ready and backend.decode(q, kv, idx, softmax_scale=0.1, schedule=schedule)[0].shape == (3, 4, 64)
    with pytest.raises(ValueError, match=re.escape("schedule was planned for backend 'torch' with [N, W] = [2, 12], "
                                                   "got backend 'torch' and indices.shape=[3, 12]")):  # fmt: skip
        backend.decode(q, kv, idx, softmax_scale=0.1, schedule=backend.plan_decode(2, 12))
    bad = idx.clone()
    bad[1, 3] = 24  # one past the 24 slots
    backend.prefill(q, kv, bad, softmax_scale=0.1)  # not checked (it would sync): the reference skips it
    with debug_mode(), pytest.raises(ValueError, match=re.escape("indices must be -1 or token slots below P * S = 24, "
                                                                 "got 24 (DTKV_DEBUG check)")):  # fmt: skip
        backend.prefill(q, kv, bad, softmax_scale=0.1)


# ----------------------------------------------------------------------------------------- the contract
def _pool(layout, num_pages, seed):
    """A logical pool ``[num_pages, S, row]`` of random rows in ``layout``'s format."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(num_pages * layout.page_size, layout.kv_lora_rank + layout.rope_dim, generator=g)
    rows = quantize_mla_fp8(src, layout) if isinstance(layout, MLAFp8Layout) else src.to(layout.dtype)
    return rows.view(num_pages, layout.page_size, -1)


def _queries(n, heads, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, 80, generator=g) / 2).to(dtype)


def _topk_positions(table, rows, k, seed, page_size=4):
    """Each query's top-k of its request's positions, ``-1`` padded when shorter."""
    g = torch.Generator().manual_seed(seed)
    lens = (table >= 0).sum(1) * page_size
    pos = torch.full((rows.shape[0], k + 3), -1)  # -1 padding: short requests, and 3 columns the kernels skip
    for i, r in enumerate(rows.tolist()):
        pick = torch.randperm(int(lens[r]), generator=g)[:k]
        pos[i, : pick.numel()] = pick
    return pos


def _topk_locs(table, rows, k, seed, page_size=4):
    """Each query's top-k of its request's positions as logical locations, ``-1`` padded when shorter."""
    return positions_to_locs(_topk_positions(table, rows, k, seed, page_size), table, page_size=page_size, rows=rows)


BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=TRITON)]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_seam_vs_loop_reference(name, layout):
    """Prefill and decode over a replicated pool (requests' pages out of logical order) equal the loop reference."""
    pool = _pool(layout, 11, seed=1)
    table = torch.tensor([[7, 2, 9, -1], [0, 5, 3, 10], [4, -1, -1, -1]])
    rows = torch.tensor([0, 0, 1, 2, 1, 1, 0])
    locs = _topk_locs(table, rows, 9, seed=2)
    backend = resolve_attention(name, spec=_spec(layout, topk=locs.shape[1]), device="cpu")
    q = _queries(7, 4, seed=3, dtype=torch.float64 if name == "torch" else torch.float32)
    idx = backend.indices(locs, pool)
    want_out, want_lse = ref_sparse_mla(q, pool.reshape(-1, pool.shape[-1]), idx, SCALE, 64, 16, 32)
    tol = 1e-12 if name == "torch" else 2e-5
    for out, lse in (backend.prefill(q, pool, idx, softmax_scale=SCALE),
                     backend.decode(q, pool, idx, softmax_scale=SCALE, schedule=backend.plan_decode(7, idx.shape[1]))):  # fmt: skip
        assert out.shape == (7, 4, 64) and lse.shape == (7, 4)
        assert (out.double() - want_out).abs().max() <= tol and (lse.double() - want_lse).abs().max() <= tol


@pytest.mark.parametrize("name", BACKENDS)
def test_empty_queries_and_empty_pages(name):
    backend = resolve_attention(name, spec=_spec(), device="cpu")
    pool = _pool(FP8, 3, seed=0)
    q = _queries(2, 4, seed=1, dtype=torch.float32)
    idx = torch.full((2, 12), -1, dtype=torch.int32)
    idx[1, 4] = 5
    for kv in (pool, pool[:0]):  # the second: a rank that stores no page
        out, lse = backend.decode(q, kv, idx if kv.shape[0] else idx.clamp(max=-1), softmax_scale=SCALE)
        assert not out[0].any() and bool((lse[0] == float("-inf")).all())
    assert bool(torch.isfinite(backend.prefill(q, pool, idx, softmax_scale=SCALE)[1][1]).all())


# ----------------------------------------------------------------------------------------- on CP ranks
NUM_PAGES = 13
TABLE = [[7, 2, 9, 12, 1], [0, 5, 3, 10, 11], [4, -1, -1, -1, -1]]  # request 2: one page, one owner


def _view_vs_pool(rank, world, name, kv_kind, scheme):
    """Seam over this rank's materialized view == seam over the replicated pool, bitwise; and sharded decode
    (own pages, others' rows -1) merged over the ranks == decode over the replicated pool."""
    import torch.distributed as dist

    from dtkv.decode import merge_partials
    from dtkv.materialize import gather_view, plan_materialize

    layout = FP8 if kv_kind == "fp8" else BF16
    own = PageOwnership(world, NUM_PAGES, scheme)
    full = _pool(layout, NUM_PAGES, seed=7)  # every rank builds the same logical pool
    local = full[own.local_pages(rank)].contiguous()  # this rank's stored pages
    table = torch.tensor(TABLE)
    rows = torch.tensor([0, 1, 2, 0, 1, 2, 2, 0])
    locs = _topk_locs(table, rows, 11, seed=8)
    backend = resolve_attention(name, spec=_spec(layout, topk=locs.shape[1]), device="cpu")
    q = _queries(8, 4, seed=9, dtype=torch.float64 if name == "torch" else torch.float32)
    # the replicated pool: the logical pool read directly
    ref_out, ref_lse = backend.prefill(q, full, backend.indices(locs, full), softmax_scale=SCALE)
    # the full view: every page the batch reads, gathered from the owners
    plan = plan_materialize(table[:, :3].flatten(), table[:, 3:].flatten(), own, rank, group=dist.group.WORLD)
    view = gather_view(local, plan, dist.group.WORLD)
    out, lse = backend.prefill(q, view, backend.indices(locs, view, page_map=plan.page_map), softmax_scale=SCALE)
    same_view = torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # sharded decode: own pages only, then the LSE merge
    idx = backend.indices(locs, local, page_map=owned_page_map(own, rank))
    # the same slots from the top-k positions and a rank-local page table (-1 where another rank owns the page)
    local_table = torch.where(own.owner(table) == rank, own.local_index(table), torch.full_like(table, -1))
    pos = _topk_positions(table, rows, 11, seed=8)
    same_slots = torch.equal(backend.indices(pos, local, page_table=local_table[rows]), idx)
    part_out, part_lse = backend.decode(q, local, idx, softmax_scale=SCALE)
    empty = int((part_lse == float("-inf")).all(dim=1).sum())
    m_out, m_lse = merge_partials(part_out.to(part_lse.dtype), part_lse, dist.group.WORLD)
    worst = max(float((m_out - ref_out).abs().max()), float((m_lse - ref_lse).abs().max()))
    return same_view and same_slots, worst, empty, local.shape[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kv_kind", ["fp8", "bf16"])
def test_view_equals_replicated_pool_and_shards_merge_to_it(ranks234, name, kv_kind):
    scheme = "block" if ranks234.world_size == 3 else "interleave"  # block, cp=3: uneven ranks
    results = ranks234.run(_view_vs_pool, name, kv_kind, scheme)
    assert all(r[0] for r in results), "the view path differs from the replicated-pool path (or own-page slots differ)"
    tol = 1e-12 if name == "torch" else 2e-5
    assert max(r[1] for r in results) <= tol
    assert sum(r[2] for r in results) > 0, "no rank had an empty partial: the -1 contract was not exercised"


def _no_page_rank(rank, world):
    """Block scheme, cp=3, 4 pages: [2, 2, 0] pages per rank -- rank 2 stores none and its partials are empty."""
    import torch.distributed as dist

    from dtkv.decode import merge_partials

    own = PageOwnership(world, 4, "block")
    full = _pool(FP8, 4, seed=3)
    local = full[own.local_pages(rank)].contiguous()
    table = torch.tensor([[3, 1, 0, 2]])
    locs = _topk_locs(table, torch.zeros(3, dtype=torch.int64), 10, seed=4)
    backend = resolve_attention("torch", spec=_spec(FP8, topk=locs.shape[1]), device="cpu")
    q = _queries(3, 4, seed=5)
    want_out, want_lse = backend.decode(q, full, backend.indices(locs, full), softmax_scale=SCALE)
    idx = backend.indices(locs, local, page_map=owned_page_map(own, rank))
    out, lse = merge_partials(*backend.decode(q, local, idx, softmax_scale=SCALE), dist.group.WORLD)
    return local.shape[0], max(float((out - want_out).abs().max()), float((lse - want_lse).abs().max()))


@pytest.mark.multirank
def test_a_rank_without_pages_weighs_nothing(ranks3):
    results = ranks3.run(_no_page_rank)
    assert [r[0] for r in results] == [2, 2, 0]
    assert max(r[1] for r in results) <= 1e-12
