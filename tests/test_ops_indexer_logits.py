"""``dtkv::indexer_logits``: the torch reference against an independent per-key float64 loop, every kernel
variant and grid against the reference, the packed keys against :func:`dtkv.decode.selection_keys` of the logits,
the top-k's tie rule (lowest column) against a stable sort, visibility ranges and slots of every kind, strided and
empty inputs, opcheck, a fullgraph compile, the errors, the kernels' address bounds under the interpreter, and the
sm_90 build's rules (wgmma, no spills: :func:`check_sm90_build`, on ``tests/test_ops_compile.py``'s one build
of every kernel) without a GPU.

Tolerances. Masks, packed positions and top-k columns are integers: equal. Logits: the reference dequantizes the
keys (codes x scale in float32) and sums in float32, the loop in float64, the kernel applies the key scale after
the head sum and (under the interpreter) sums the dot in numpy's float32 order: a few float32 ulps of the row's
largest ``|logit|``; we allow 1e-5 (a wrong key, head, scale or range moves a logit by O(1)).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from dtkv import IndexerFp8Layout
from dtkv.decode import INVALID_KEY, selection_keys
from dtkv.ops import _tuned, indexer_logits, indexer_topk, quantize_indexer_fp8, quantize_indexer_queries
from dtkv.ops.indexer_logits import indexer_logits_flops, indexer_logits_torch, launch_grid
from tests.ops_reference import BACKENDS, address_check, benchmark, skip_unless
from tests.test_ops_indexer_scores import index_pages

_mod = sys.modules["dtkv.ops.indexer_logits"]  # the package's attribute of that name is the function
ROOT = Path(__file__).resolve().parent.parent

LAUNCHES = {
    "default": {},
    "keys_q1_k16": {"block_q": 1, "block_k": 16},
    "keys_q4_k32": {"block_q": 4, "block_k": 32, "num_warps": 8},
    "keys_q8_k128": {"block_q": 8, "block_k": 128},
    "queries_q2_k16": {"variant": "queries", "block_k": 16},
    "queries_q1_k64": {"variant": "queries", "block_q": 1, "num_stages": 2},
    "split_q1_k16": {"variant": "split", "block_q": 1, "block_k": 16},
    "split_q2_k32": {"variant": "split", "block_q": 2, "block_k": 32},
    "split_q4_k64": {"variant": "split", "block_q": 4, "block_k": 64, "num_warps": 8},
}
GEOMS = [(1, 2, 32, 4, 5, 1), (5, 3, 48, 5, 7, 29), (7, 16, 64, 16, 9, 130), (3, 64, 128, 64, 3, 150)]
"""``(queries, heads, dims, page size, pages, key columns)``: one key; padded heads and dims with an odd page size;
several tiles and query blocks; DeepSeek-V3.2's geometry."""


def _case(n, heads, hd, ps, num_pages, cols, seed, idx=torch.int64):
    """Random pages, slots with every kind of invalid one (-1, other negatives, one past the pages), visibility
    ranges that are empty, start before 0, end past ``cols``, or cover everything."""
    g = torch.Generator().manual_seed(seed)
    lay = IndexerFp8Layout(page_size=ps, head_dim=hd)
    pages = index_pages(num_pages, lay, g)
    slots = torch.randint(0, num_pages * ps, (cols,), generator=g)
    slots[3::11] = -1
    slots[5::13] = -9
    slots[7::17] = num_pages * ps
    start = torch.randint(-2, cols, (n,), generator=g)
    end = start + torch.randint(-3, cols + 2, (n,), generator=g)
    if n > 1:
        start[0], end[0] = 0, cols  # one query sees every column
    q, w = quantize_indexer_queries(torch.randn(n, heads, hd, generator=g), torch.rand(n, heads, generator=g) - 0.3)
    return lay, q, w, pages, slots.to(idx), start.to(idx), end.to(idx)


def _loop_reference(q, w, pages, slots, start, end, lay):
    """Key by key in float64 from the page bytes: ``(logits [N, K] float64, visible [N, K])``."""
    n, heads, hd = q.shape
    ps, num_slots = lay.page_size, pages.shape[0] * lay.page_size
    out = torch.full((n, slots.shape[0]), float("-inf"), dtype=torch.float64)
    qd, wd = q.double(), w.double()
    for c in range(slots.shape[0]):
        s = int(slots[c])
        if not 0 <= s < num_slots:
            continue
        page, t = divmod(s, ps)
        code = pages[page, t * hd : (t + 1) * hd].view(torch.float8_e4m3fn).double()
        scale = float(pages[page, ps * hd + 4 * t : ps * hd + 4 * t + 4].view(torch.float32))
        for i in range(n):
            if int(start[i]) <= c < int(end[i]):
                out[i, c] = sum(float(wd[i, h]) * max(0.0, float(qd[i, h] @ code)) for h in range(heads)) * scale
    return out, torch.isfinite(out)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb)
    if fa.any():
        rel = float((a[fa].double() - b[fb].double()).abs().max() / b[fb].double().abs().max().clamp(min=1e-30))
        assert rel < tol, rel


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "n{}_i{}_j{}_s{}_p{}_k{}".format(*g))
def test_reference_vs_per_key_loop(geom):
    lay, q, w, pages, slots, start, end = _case(*geom, seed=sum(geom))
    got = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend="torch")
    want, _ = _loop_reference(q, w, pages, slots, start, end, lay)
    assert got.dtype == torch.float32 and got.shape == want.shape
    _close(got, want)


def test_reference_blocks_queries(monkeypatch):
    """The reference's ``[B, I, K]`` products come in blocks of queries (here one query a block): same logits."""
    lay, q, w, pages, slots, start, end = _case(7, 16, 64, 16, 9, 130, seed=3)
    codes = q.view(torch.uint8)
    whole = indexer_logits_torch(codes, w, pages, slots, start, end, lay.page_size, False)
    monkeypatch.setattr(_mod, "_REF_BLOCK_BYTES", 1)
    assert torch.equal(indexer_logits_torch(codes, w, pages, slots, start, end, lay.page_size, False), whole)


@pytest.mark.parametrize("sms", [132, 1], ids=["blocks_only", "key_split"])
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "n{}_i{}_j{}_s{}_p{}_k{}".format(*g))
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_triton_vs_reference(monkeypatch, launch, geom, sms):
    """Every variant, with the grid of an H200 (few query blocks: the key range split over programs) and of one SM
    (one program a query block: its whole visible range, tiles before and after it only stored)."""
    skip_unless("triton", "cpu")
    monkeypatch.setattr(_mod, "_num_sms", lambda device: sms)
    lay, q, w, pages, slots, start, end = _case(*geom, seed=7 * sum(geom), idx=torch.int32 if sms == 1 else torch.int64)
    want = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend="torch")
    with _tuned.override("indexer_logits", **LAUNCHES[launch]):
        got = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend="triton")
        packed = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend="triton", packed=True)
    _close(got, want)
    cols = torch.arange(slots.shape[0]).expand_as(got)
    assert torch.equal(packed, selection_keys(got, cols, torch.isfinite(got)))


def _group_maxima(logits: torch.Tensor, group: int) -> torch.Tensor:
    """Each group's largest order key, from the int64 selection keys' upper halves (one python loop over groups)."""
    upper = torch.bitwise_right_shift(selection_keys(logits, torch.zeros_like(logits, dtype=torch.int64)), 32)
    cols = logits.shape[1]
    return torch.stack([upper[:, c : c + group].amax(dim=1) for c in range(0, cols, group)], 1).to(torch.int32)


@pytest.mark.parametrize("sms", [132, 1], ids=["blocks_only", "key_split"])
@pytest.mark.parametrize("group", [2, 8, 32])
@pytest.mark.parametrize("launch", ["default", "keys_q1_k16", "queries_q2_k16", "split_q2_k32", "torch"])
@pytest.mark.parametrize("geom", GEOMS[1:3], ids=lambda g: "n{}_i{}_j{}_s{}_p{}_k{}".format(*g))
def test_group_maxima_are_the_largest_order_key_of_each_group(monkeypatch, geom, launch, group, sms):
    """``group``: the kernel's epilogue writes each group's largest order key (a partial last group, groups wider
    than the launch's tiles, tiles outside a query's range and the key split included), the logits unchanged."""
    skip_unless("torch" if launch == "torch" else "triton", "cpu")
    monkeypatch.setattr(_mod, "_num_sms", lambda device: sms)
    lay, q, w, pages, slots, start, end = _case(*geom, seed=11 * sum(geom))
    backend = "torch" if launch == "torch" else "triton"
    with _tuned.override("indexer_logits", **LAUNCHES.get(launch, {})):
        got, gmax = indexer_logits(q, w, pages, slots, start, end, layout=lay, group=group, backend=backend)
    want = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend="torch")
    _close(got, want)
    assert gmax.dtype == torch.int32 and gmax.shape == (q.shape[0], -(-slots.shape[0] // group))
    assert torch.equal(gmax, _group_maxima(got, group))
    assert (gmax > -(2**31)).any() and (group > 8 or (gmax == -(2**31)).any())  # groups with visible keys, and not


def test_group_maxima_settings_are_checked():
    lay, q, w, pages, slots, start, end = _case(3, 2, 32, 4, 5, 9, seed=3)
    for group in (1, 3, 256, -2):
        with pytest.raises(
            ValueError, match=re.escape(f"group must be 0 (none) or a power of two in [2, 128], got group={group}")
        ):
            indexer_logits(q, w, pages, slots, start, end, layout=lay, group=group, backend="torch")
    with pytest.raises(ValueError, match=re.escape("group must be 0 with packed=True (the maxima come with float32")):
        indexer_logits(q, w, pages, slots, start, end, layout=lay, group=4, packed=True, backend="torch")


def _per_query_tables(n, cols, num_slots, seed):
    """``[n, cols]`` key tables, each row its own slots (invalid ones included), as full-view decode's requests."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, num_slots, (n, cols), generator=g)
    tables[:, 2::9] = -1
    tables[1:, 4::7] = num_slots
    return tables


@pytest.mark.parametrize("packed", [False, True], ids=["logits", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geom", GEOMS[1:], ids=lambda g: "n{}_i{}_j{}_s{}_p{}_k{}".format(*g))
def test_a_key_table_per_query_scores_each_query_against_its_own_row(geom, backend, packed):
    """``key_slots`` ``[N, K]`` (one launch for a full-view decode batch): row ``n`` of the output is query ``n``
    over row ``n`` of the tables -- the per-key float64 loop of that row, and the one-query call over it (the
    Triton kernel bit for bit: a block is one query either way)."""
    skip_unless(backend, "cpu")
    lay, q, w, pages, _, start, end = _case(*geom, seed=3 * sum(geom))
    tables = _per_query_tables(q.shape[0], geom[5], pages.shape[0] * lay.page_size, seed=sum(geom))
    got = indexer_logits(q, w, pages, tables, start, end, layout=lay, backend=backend, packed=packed)
    assert got.shape == tables.shape and got.dtype == (torch.int64 if packed else torch.float32)
    with _tuned.override("indexer_logits", block_q=1):
        for i in range(q.shape[0]):
            one = indexer_logits(q[i : i + 1], w[i : i + 1], pages, tables[i], start[i : i + 1], end[i : i + 1],
                                 layout=lay, backend=backend, packed=packed)  # fmt: skip
            assert torch.equal(got[i : i + 1], one), i
            if not packed:
                want, _ = _loop_reference(q[i : i + 1], w[i : i + 1], pages, tables[i], start[i : i + 1],
                                          end[i : i + 1], lay)  # fmt: skip
                _close(got[i : i + 1], want)


def test_a_key_table_per_query_stays_in_bounds_and_takes_strided_tables():
    """Under the interpreter's address check, per-query tables read only their own rows (a transposed view of the
    tables is normalized, not read with the wrong strides), with the defaults and a launch of wide blocks."""
    skip_unless("triton", "cpu")
    M = benchmark("memcheck_ops")
    lay, q, w, pages, _, start, end = _case(5, 3, 48, 5, 7, 29, seed=4)
    tables = _per_query_tables(5, 29, pages.shape[0] * lay.page_size, seed=4).to(torch.int32)
    want = indexer_logits(q, w, pages, tables, start, end, layout=lay, backend="torch")
    bands = M.Bands(4)
    args = [bands.put("q", q.view(torch.uint8)).view(torch.float8_e4m3fn), bands.put("w", w),
            bands.put("pages", pages), bands.put("tables", tables, poison=0), bands.put("start", start, poison=0),
            bands.put("end", end, poison=29)]  # fmt: skip
    for cfg in ({}, {"block_q": 8, "block_k": 16}):
        with _tuned.override("indexer_logits", **cfg), address_check():
            got = indexer_logits(*args, layout=lay, backend="triton")
        _close(got, want)
        assert not bands.changed(), cfg
    strided = tables.t().contiguous().t()
    assert not strided.is_contiguous()
    _close(indexer_logits(q, w, pages, strided, start, end, layout=lay, backend="triton"), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_keys_are_selection_keys_of_the_logits(backend):
    """``packed=True`` is :func:`dtkv.decode.selection_keys` of the float32 logits with the columns as positions,
    bit for bit (``-0.0`` folded, ``INVALID_KEY`` where not visible)."""
    skip_unless(backend, "cpu")
    lay, q, w, pages, slots, start, end = _case(5, 3, 48, 5, 7, 29, seed=2)
    w[0] = 0.0  # a query whose every logit is 0.0 (or -0.0 from negative zero products)
    logits = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend=backend)
    keys = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend=backend, packed=True)
    cols = torch.arange(slots.shape[0]).expand_as(logits)
    assert torch.equal(keys, selection_keys(logits, cols, torch.isfinite(logits)))
    assert bool((keys[~torch.isfinite(logits)] == INVALID_KEY).all())


def _stable_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection rule as a stable descending sort of the float32 scores (ties to the lower column)."""
    vals, cols = torch.sort(logits, dim=1, descending=True, stable=True)
    vals, cols = vals[:, :k], cols[:, :k]
    valid = vals > float("-inf")
    return torch.where(valid, cols, torch.full_like(cols, -1)), valid


@pytest.mark.parametrize("k", [1, 4, 9, 40])
def test_topk_of_packed_keys_is_the_stable_sort(k):
    """Scores with many exact ties (integers, zeros and negative zeros), rows with fewer visible keys than ``k``,
    ``k`` past the columns: the columns and their order are those of a stable descending sort."""
    g = torch.Generator().manual_seed(k)
    scores = torch.randint(-2, 3, (6, 31), generator=g).float()
    scores[scores == 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (int((scores == 0).sum()),), generator=g)]
    scores[torch.rand(6, 31, generator=g) < 0.3] = float("-inf")
    scores[5] = float("-inf")  # nothing visible
    cols = torch.arange(31).expand_as(scores)
    cols_k, valid = indexer_topk(selection_keys(scores, cols, torch.isfinite(scores)), k)
    want_cols, want_valid = _stable_topk(torch.where(scores == 0, torch.zeros_like(scores), scores), min(k, 31))
    assert cols_k.shape == (6, k) and valid.shape == (6, k)
    assert torch.equal(cols_k[:, : min(k, 31)], want_cols) and torch.equal(valid[:, : min(k, 31)], want_valid)
    assert bool((cols_k[:, 31:] == -1).all()) and not bool(valid[:, 31:].any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lowest_column(backend):
    """Every column holds the same key (one slot read 40 times): all logits of a query are exactly equal, and its
    top-k is the lowest visible columns in order."""
    skip_unless(backend, "cpu")
    lay, q, w, pages, *_ = _case(3, 4, 32, 4, 2, 1, seed=4)
    slots = torch.full((40,), 5)
    start, end = torch.tensor([0, 7, 30]), torch.tensor([40, 20, 33])
    keys = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend=backend, packed=True)
    cols, valid = indexer_topk(keys, 5)
    assert cols.tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [30, 31, 32, -1, -1]]
    assert valid.sum(1).tolist() == [5, 5, 3]


def test_indexer_topk_shapes_and_errors():
    cols, valid = indexer_topk(torch.empty(0, 5, dtype=torch.int64), 3)
    assert cols.shape == (0, 3) and valid.shape == (0, 3)
    cols, valid = indexer_topk(torch.empty(2, 0, dtype=torch.int64), 3)
    assert cols.tolist() == [[-1] * 3] * 2 and not valid.any()
    with pytest.raises(ValueError, match="k must be >= 1, got k=0"):
        indexer_topk(torch.zeros(2, 3, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match=re.escape("keys must have dtype torch.int64, got keys.dtype=torch.float32")):
        indexer_topk(torch.zeros(2, 3), 1)


def test_quantize_indexer_queries_folds_the_scales():
    """Codes per (query, head) row as :func:`dtkv.ops.quantize_indexer_fp8` gives them; the weight carries the row's
    scale and ``scale``; an all-zero row gets weight 0; a non-positive scale is refused."""
    g = torch.Generator().manual_seed(0)
    q, w = torch.randn(3, 5, 32, generator=g).bfloat16(), torch.randn(3, 5, generator=g)
    q[1, 2] = 0
    codes, w8 = quantize_indexer_queries(q, w, scale=0.25)
    want_codes, want_scale = quantize_indexer_fp8(q.reshape(-1, 32))
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(codes.view(torch.uint8).view(-1, 32), want_codes)
    assert w8.dtype == torch.float32 and torch.equal(w8, w * want_scale.view(3, 5) * 0.25)
    assert float(w8[1, 2]) == 0.0
    with pytest.raises(ValueError, match=re.escape("scale must be > 0 (relu commutes only with a positive scale)")):
        quantize_indexer_queries(q, w, scale=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_pages_and_index_views(backend):
    """Pages 16 bytes apart (a layer view of a layered pool) and index arguments that are views with strides give
    the logits of the contiguous inputs."""
    skip_unless(backend, "cpu")
    lay, q, w, pages, slots, start, end = _case(5, 3, 48, 5, 7, 29, seed=9)
    want = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend=backend)
    wide = torch.zeros(pages.shape[0], pages.shape[1] + 16, dtype=torch.uint8)
    wide[:, : pages.shape[1]] = pages
    strided = wide[:, : pages.shape[1]]
    s2, ranges = torch.stack((slots, slots), 1), torch.stack((start, end), 1)
    got = indexer_logits(q, w, strided, s2[:, 0], ranges[:, 0], ranges[:, 1], layout=lay, backend=backend)
    assert strided.stride(0) == pages.shape[1] + 16 and not s2[:, 0].is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    skip_unless(backend, "cpu")
    lay, q, w, pages, slots, start, end = _case(3, 2, 32, 4, 3, 10, seed=1)
    none = indexer_logits(q[:0], w[:0], pages, slots, start[:0], end[:0], layout=lay, backend=backend)
    assert none.shape == (0, 10)
    no_keys = indexer_logits(q, w, pages, slots[:0], start, end, layout=lay, backend=backend, packed=True)
    assert no_keys.shape == (3, 0) and no_keys.dtype == torch.int64
    no_pages = indexer_logits(q, w, pages[:0], slots, start, end, layout=lay, backend=backend)
    assert no_pages.shape == (3, 10) and bool(torch.isneginf(no_pages).all())  # no slot points into a page


@pytest.mark.parametrize("table", ["shared", "per_query"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck(backend, packed, table):
    skip_unless(backend, "cpu")
    lay, q, w, pages, slots, start, end = _case(3, 2, 32, 4, 5, 20, seed=5)
    if table == "per_query":
        slots = _per_query_tables(3, 20, pages.shape[0] * lay.page_size, seed=5)
    for group in (0,) if packed else (0, 4):
        args = (q.view(torch.uint8), w, pages, slots, start, end, lay.page_size, packed, group, backend)
        torch.library.opcheck(torch.ops.dtkv.indexer_logits.default, args)


def test_compiles_fullgraph_with_the_top_k():
    """Query quantization, the packed logits and the top-k trace into one graph (``fullgraph=True``) and give the
    eager bits."""
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = "triton" if _triton_here() else "torch"
    lay, _, _, pages, slots, start, end = _case(3, 2, 32, 4, 5, 20, seed=6)
    g = torch.Generator().manual_seed(6)
    q, w = torch.randn(3, 2, 32, generator=g), torch.rand(3, 2, generator=g)

    def select(q, w, pages, slots, start, end):
        q8, w8 = quantize_indexer_queries(q, w, scale=0.5)
        keys = indexer_logits(q8, w8, pages, slots, start, end, layout=lay, packed=True, backend=backend)
        return indexer_topk(keys, 4)

    eager = select(q, w, pages, slots, start, end)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(select, backend=counter, fullgraph=True)(q, w, pages, slots, start, end)
    assert counter.frame_count == 1
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def _triton_here() -> bool:
    try:
        skip_unless("triton", "cpu")
    except pytest.skip.Exception:
        return False
    return True


def test_rejects_bad_input():
    lay, q, w, pages, slots, start, end = _case(2, 2, 32, 4, 6, 9, seed=1)

    def call(**kw):
        a = {"q": q, "w": w, "pages": pages, "key_slots": slots, "key_start": start, "key_end": end} | kw
        return indexer_logits(**a, layout=kw.pop("layout", lay), backend="torch")

    with pytest.raises(ValueError, match=re.escape("q must have shape [*, *, 32] (layout.head_dim), got [2, 2, 16]")):
        call(q=q[..., :16])
    with pytest.raises(TypeError, match=re.escape("q must have dtype torch.float8_e4m3fn, got q.dtype=torch.float32")):
        call(q=q.float())
    with pytest.raises(TypeError, match=re.escape("w must have dtype torch.float32, got w.dtype=torch.bfloat16")):
        call(w=w.bfloat16())
    with pytest.raises(ValueError, match=re.escape("w must have shape [2, 2], got w.shape=[2, 3] (dim 1)")):
        call(w=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=re.escape("pages must have shape [*, 144], got pages.shape=[6, 143]")):
        call(pages=pages[:, :143])
    with pytest.raises(TypeError, match=re.escape("key_slots must have dtype [torch.int32, torch.int64]")):
        call(key_slots=slots.float())
    with pytest.raises(ValueError, match=re.escape("key_slots must be [K] (one key table) or [N, K] with N = 2")):
        call(key_slots=slots[:, None])  # [9, 1]: 9 rows for 2 queries
    with pytest.raises(ValueError, match=re.escape("got shape [2, 9, 1]")):
        call(key_slots=torch.stack((slots, slots))[..., None])
    with pytest.raises(ValueError, match=re.escape("key_start must have shape [2], got key_start.shape=[3]")):
        call(key_start=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("key_end must have shape [2], got key_end.shape=[1]")):
        call(key_end=end[:1])
    with pytest.raises(TypeError, match="layout must be a dtkv.IndexerFp8Layout, got str"):
        indexer_logits(q, w, pages, slots, start, end, layout="indexer")


def test_triton_refuses_misaligned_scales_and_auto_falls_back():
    skip_unless("triton", "cpu")
    odd = IndexerFp8Layout(page_size=3, head_dim=33)  # a 99-byte code block: scales not 4-byte aligned
    pages = torch.zeros(4, odd.page_shape[0], dtype=torch.uint8)
    q, w = torch.zeros(2, 2, 33).to(torch.float8_e4m3fn), torch.zeros(2, 2)
    args = (q, w, pages, torch.arange(5), torch.zeros(2, dtype=torch.int64), torch.full((2,), 5))
    with pytest.raises(NotImplementedError, match="multiples of 4.*use backend='torch'"):
        indexer_logits(*args, layout=odd, backend="triton")
    assert indexer_logits(*args, layout=odd).shape == (2, 5)


def test_launch_rejects_unknown_variants_and_split_blocks():
    """A launch configuration the kernel cannot take raises before anything launches, naming the key and value."""
    skip_unless("triton", "cpu")
    lay, q, w, pages, slots, start, end = _case(3, 2, 32, 4, 5, 9, seed=3)
    call = lambda: indexer_logits(q, w, pages, slots, start, end, layout=lay, backend="triton")  # noqa: E731
    with _tuned.override("indexer_logits", variant="rows"):
        with pytest.raises(ValueError, match=re.escape("variant must be one of ('keys', 'queries', 'split')")):
            call()
    with _tuned.override("indexer_logits", variant="split", block_q=3):
        with pytest.raises(ValueError, match="variant 'split' takes block_q 1, 2 or 4, got block_q=3"):
            call()


def test_launch_grid_splits_keys_only_when_the_blocks_do_not_fill_the_gpu(monkeypatch):
    monkeypatch.setattr(_mod, "_num_sms", lambda device: 132)
    cfg = _tuned.launch_config("indexer_logits", 1, torch.device("cpu"))
    cpu = torch.device("cpu")
    assert launch_grid(8192, 32768, cfg, cpu) == (4096, 1, 512)  # 2 queries a block: 4096 blocks, no split
    assert launch_grid(1, 32768, cfg, cpu) == (1, 256, 2)  # 3 programs x 132 SMs wanted: 2 of 512 tiles each
    assert launch_grid(16, 100, cfg, cpu) == (8, 2, 1)  # never more splits than tiles
    monkeypatch.setattr(_mod, "_num_sms", lambda device: 10**6)
    assert launch_grid(1, 64 * 100000, cfg, cpu) == (1, 50000, 2)  # the grid's y dimension stays below 65536


def test_flops_count_visible_keys_only():
    start, end = torch.tensor([0, 5, 9, 3]), torch.tensor([4, 5, 20, 1])
    assert indexer_logits_flops(start, end, heads=64, head_dim=128) == 2 * 64 * 128 * (4 + 0 + 11 + 0)


def test_kernel_stays_in_bounds():
    """Every configuration the sweep can pick (and the defaults) on guard-banded inputs under the interpreter's
    address check: only the tensors' own bytes are read and written, the bands stay as they were, and the logits
    are the torch backend's."""
    skip_unless("triton", "cpu")
    M = benchmark("memcheck_ops")
    bench = benchmark("bench_indexer_logits")
    cfgs = [bench.full(c) for c in [{}, *bench.CANDIDATES] if "ctas_per_sm" not in c]
    cfgs = [c for i, c in enumerate(cfgs) if c not in cfgs[:i]]
    problems = []
    for geom, seed in (((5, 3, 48, 5, 7, 29), 0), ((2, 16, 64, 16, 4, 70), 1)):
        lay, q, w, pages, slots, start, end = _case(*geom, seed=seed, idx=torch.int32 if seed else torch.int64)
        bands = M.Bands(seed)
        args = [bands.put("q", q.view(torch.uint8)).view(torch.float8_e4m3fn), bands.put("w", w),
                bands.put("pages", pages), bands.put("slots", slots, poison=0), bands.put("start", start, poison=0),
                bands.put("end", end, poison=slots.shape[0])]  # fmt: skip
        want = indexer_logits(*args, layout=lay, backend="torch")
        for cfg in cfgs:
            with _tuned.override("indexer_logits", **cfg), address_check():
                got = indexer_logits(*args, layout=lay, backend="triton")
            fg, fw = torch.isfinite(got), torch.isfinite(want)
            if not torch.equal(fg, fw) or not torch.allclose(got[fg], want[fw], rtol=1e-5, atol=1e-6):
                problems.append(f"{geom} {cfg}: logits differ from the torch backend's")
            if bands.changed():
                problems.append(f"{geom} {cfg}: bands written next to {bands.changed()}")
    assert problems == []


def check_sm90_build(records: list[dict]) -> None:
    """The kernel in the run's sm_90 build (``tests/test_ops_compile.py`` builds every kernel once, no GPU, and
    calls this with its records): every launch compiles; at DeepSeek-V3.2's geometry the dot is a Hopper ``wgmma``;
    nothing spills; the default launch fits 3 programs per SM (at most 168 registers per thread, 64 KB of shared
    memory), which its grid target assumes. The forced-int64 builds are left out (they are the launches' own only
    where an offset needs it)."""
    records = [r for r in records if r["kernel"] == "_indexer_logits_kernel" and "int64 offsets" not in r["where"]]
    assert records and all(r["ok"] and r.get("local", 0) == 0 for r in records), records
    deepseek = [r for r in records if r["constexprs"]["NH"] == "64" and r["constexprs"]["J"] == "128"]
    assert deepseek and all(r["wgmma"] > 0 for r in deepseek)
    assert any(r["constexprs"]["GROUP"] != "0" for r in deepseek)  # the group maxima's epilogue
    assert any(r["constexprs"]["SPLIT"] == "True" for r in deepseek)  # a dot per query
    default = _tuned.DEFAULTS["indexer_logits"]
    first = next(r for r in deepseek if r["constexprs"]["BQ"] == str(default["block_q"])
                 and r["constexprs"]["KEYS_M"] == "True" and r["num_warps"] == default["num_warps"])  # fmt: skip
    assert first["registers"] <= 168 and first["smem"] <= 64 * 1024, first


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["default", "keys_q1_k16", "queries_q1_k64"])
def test_cuda_kernel_vs_reference(launch):
    """On a GPU, DeepSeek-V3.2's geometry (64 heads x 128 dims, pages of 64) with a causal chunk: masks equal, logits
    within 1e-2 of each row's largest (the fp8 ``wgmma`` accumulates with the tensor core's reduced-precision adder,
    about 2**-13 relative per dot), packed keys bitwise the selection keys of the same launch's logits."""
    lay, q, w, pages, slots, _, _ = _case(96, 64, 128, 64, 70, 4000, seed=8)
    start = torch.zeros(96, dtype=torch.int64)
    end = torch.arange(4000 - 96, 4000) + 1
    args = [t.cuda() for t in (q, w, pages, slots, start, end)]
    want = indexer_logits(*args, layout=lay, backend="torch")
    with _tuned.override("indexer_logits", **LAUNCHES[launch]):
        got = indexer_logits(*args, layout=lay, backend="triton")
        packed = indexer_logits(*args, layout=lay, backend="triton", packed=True)
    _close(got.cpu(), want.cpu(), tol=1e-2)
    cols = torch.arange(slots.shape[0], device="cuda").expand_as(got)
    assert torch.equal(packed, selection_keys(got, cols, torch.isfinite(got)))
