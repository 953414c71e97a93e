"""``dtkv::sparse_indices``: logical locations -> bounded, padded int32 token slots, against a loop over entries.

The reference walks every entry with Python ints (remap by the page map, bound by ``num_slots``, pad to the width),
sharing no code with ``ops/``. Outputs are compared exactly (integers).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv.ops import sparse_indices
from tests.ops_reference import BACKENDS, backend_ok, skip_unless


def ref_sparse_indices(locs, page_map, page_size, num_slots, width, page_table=None):
    rows = []
    for n, row in enumerate(locs.tolist()):
        out = []
        for j in range(width):
            x = row[j] if j < len(row) else -1
            if page_table is not None and x >= 0:
                t = page_table[n]
                x = (
                    -1
                    if x // page_size >= len(t) or t[x // page_size] < 0
                    else t[x // page_size] * page_size + x % page_size
                )
            if page_map is not None and x >= 0:
                page = x // page_size
                mapped = page_map[page] if page < len(page_map) else -1
                x = -1 if mapped < 0 else mapped * page_size + x % page_size
            out.append(x if 0 <= x < num_slots else -1)
        rows.append(out)
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)


def _locs(n, k, hi, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, hi, (n, k), generator=g)
    if n and k:
        x[0, 0] = -1
        x[-1, -1] = hi - 1
    return x.to(dtype)


MAP = [3, -1, 0, 7, 2, 5, 1, 6, 4, -1, 8]  # 11 logical pages; 2 not in the view; 9 view pages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("n", "k", "width", "page_size", "with_map", "num_slots"),
    [
        (1, 1, 1, 1, False, 5),
        (7, 13, 64, 4, True, 36),  # padded to 64, every view slot in range
        (5, 20, 23, 5, True, 30),  # a bound below the view: slots >= 30 dropped
        (3, 17, 17, 4, False, 40),  # a pool read directly: only the bound applies
        (2, 9, 16, 1, True, 9),  # page ids (page_size 1)
        (4, 6, 8, 4, True, 0),  # nothing to read: every slot -1
        (0, 5, 64, 4, True, 36),  # no queries
        (3, 0, 64, 4, True, 36),  # no keys: all padding
    ],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_sparse_indices_vs_reference(backend, n, k, width, page_size, with_map, num_slots, dtype):
    skip_unless(backend, "cpu")
    locs = _locs(n, k, 13 * page_size, seed=n * 31 + k, dtype=dtype)  # pages past the map's 11 too
    page_map = torch.tensor(MAP, dtype=torch.int32) if with_map else None
    got = sparse_indices(locs, num_slots=num_slots, page_map=page_map, page_size=page_size, width=width,
                         backend=backend)  # fmt: skip
    want = ref_sparse_indices(locs, MAP if with_map else None, page_size, num_slots, width)
    assert got.dtype == torch.int32 and got.is_contiguous() and got.stride(0) == width
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_int64_locations_never_narrow_onto_valid_slots(backend):
    """``2**32 + 5`` must not become slot 5: the range test runs in the width the locations were given."""
    skip_unless(backend, "cpu")
    wide = torch.tensor([[2**32 + 5, 5, 2**31 + 1, -(2**32) + 5, 2**63 - 1, 2**40]])
    for page_map in (None, torch.tensor(MAP, dtype=torch.int64)):
        got = sparse_indices(wide, num_slots=40, page_map=page_map, page_size=4, backend=backend)
        expect5 = 5 if page_map is None else MAP[1]  # page 1 is not in the view: -1
        assert got.tolist() == [[-1, expect5 if expect5 >= 0 else -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_locations_and_page_map(backend):
    skip_unless(backend, "cpu")
    locs = _locs(6, 10, 44, seed=3)
    page_map = torch.tensor(MAP + MAP, dtype=torch.int32)[::2][:11]  # a strided map: [3, 0, 2, 1, 4, 8, -1, 7, ...]
    want = ref_sparse_indices(locs, page_map.tolist(), 4, 36, 16)
    for view in (locs.t().contiguous().t(), torch.stack([locs, locs], dim=-1)[..., 1]):
        assert not view.is_contiguous()
        got = sparse_indices(view, num_slots=36, page_map=page_map, page_size=4, width=16, backend=backend)
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "exc", "msg"),
    [
        (dict(width=3), ValueError, "width must be >= locs.shape[1]=4 (it only pads), got width=3"),
        (dict(num_slots=-1), ValueError, "num_slots must be in [0, 2**31 - 1] (int32 token slots), got num_slots=-1"),
        (dict(num_slots=2**31), ValueError, "num_slots must be in [0, 2**31 - 1]"),
        (dict(page_size=0), ValueError, "page_size must be >= 1, got page_size=0"),
        (dict(locs=torch.zeros(2, 4)), TypeError, "locs must have dtype"),
        (dict(locs=torch.zeros(4, dtype=torch.int64)), ValueError, "locs must have 2 dims, got locs.shape=(4,)"),
        (dict(page_map=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "page_map must have 1 dims"),
        (dict(page_map=torch.zeros(3)), TypeError, "page_map must have dtype"),
    ],
)
def test_rejects_bad_arguments(kwargs, exc, msg):
    args = dict(locs=torch.zeros(2, 4, dtype=torch.int64), num_slots=8, page_map=None, page_size=4, width=None)
    args.update(kwargs)
    with pytest.raises(exc, match=re.escape(msg)):
        sparse_indices(args.pop("locs"), **args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_map", [False, True])
def test_opcheck(backend, with_map):
    skip_unless(backend, "cpu")
    page_map = torch.tensor(MAP, dtype=torch.int32) if with_map else None
    table = torch.tensor([[3, 1, -1, 2], [0, 4, 5, 9], [8, -1, -1, -1], [6, 7, 10, 2], [1, 1, 1, 1]])
    for t in (None, table):
        torch.library.opcheck(
            torch.ops.dtkv.sparse_indices.default, (_locs(5, 7, 20, 1), page_map, t, 4, 36, 64, backend)
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64], ids=["table32", "table64"])
def test_positions_through_page_tables(backend, with_map, table_dtype):
    """Key positions of each row's request -> locations through its page table (and then the map), one launch; a
    rank-local table with -1 for pages another rank stores gives own-page slots."""
    skip_unless(backend, "cpu")
    table = torch.tensor([[3, 1, -1, 2, 9], [0, 4, 5, 10, 6], [8, -1, -1, -1, -1], [6, 7, 10, 2, 0]], dtype=table_dtype)
    pos = _locs(4, 11, 23, seed=5)  # page slots 0..5: slot 5 is past the table's width of 5
    page_map = torch.tensor(MAP, dtype=torch.int32) if with_map else None
    kw = dict(num_slots=40, page_map=page_map, page_size=4, width=16, page_table=table, backend=backend)
    got = sparse_indices(pos, **kw)
    assert torch.equal(got, ref_sparse_indices(pos, MAP if with_map else None, 4, 40, 16, table.tolist()))
    assert torch.equal(sparse_indices(pos, **{**kw, "page_table": table.t().contiguous().t()}), got)  # any strides
    with pytest.raises(ValueError, match=re.escape("page_table must have one row per row of locs (4), got")):
        sparse_indices(pos, **{**kw, "page_table": table[:3]})


def test_compiles_without_graph_breaks():
    backend = "triton" if backend_ok("triton", "cpu") else "torch"
    page_map = torch.tensor(MAP, dtype=torch.int32)

    def step(locs):
        return sparse_indices(locs, num_slots=36, page_map=page_map, page_size=4, width=64, backend=backend)

    locs = _locs(5, 20, 44, 2)
    cnt = CompileCounterWithBackend("aot_eager")
    got = torch.compile(step, backend=cnt, fullgraph=True)(locs)
    assert cnt.frame_count == 1 and torch.equal(got, step(locs))
