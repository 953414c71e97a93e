"""``dtkv::write_owned``: every rank keeps exactly its pages' rows, bit for bit, on every backend.

Contract: rows whose page the rank owns land at ``pool[local_index(page), offset]``; ``-1`` and foreign rows
touch nothing; bad input raises before any byte of the pool changes. No tolerances: the op copies bytes.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv import PageOwnership
from dtkv.ops import write_owned
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    OWNERSHIP_KINDS,
    as_kind,
    assert_same_bytes,
    ref_write_rows,
    scattered_locs,
    skip_unless,
)

CASES = [  # (cp, num_pages, layout, page_size, n rows)
    pytest.param(1, 3, "interleave", 1, 1, id="cp1-ps1-n1"),
    pytest.param(3, 7, "interleave", 16, 37, id="cp3-ps16-partial"),
    pytest.param(2, 5, "block", 64, 130, id="cp2-ps64-block"),
    pytest.param(4, 10, "block", 1, 9, id="cp4-ps1-block"),
]


def _rows(n: int, dim: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n, dim), generator=g, dtype=torch.uint8).to(device)
    return torch.randn(n, dim, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("cp", "num_pages", "layout", "ps", "n"), CASES)
@pytest.mark.parametrize("dtype,dim", [(torch.uint8, 656), (torch.bfloat16, 576)], ids=["fp8row", "bf16"])
def test_write_owned_vs_reference(device, backend, cp, num_pages, layout, ps, n, dtype, dim):
    skip_unless(backend, device)
    own = PageOwnership(cp, num_pages, layout)
    rows = _rows(n, dim, dtype, device)
    locs = scattered_locs(num_pages, ps, n, pad_every=5 if n > 5 else 0).to(device)
    for rank in range(cp):
        start = _rows(own.num_local_pages(rank) * ps, dim, dtype, "cpu", seed=rank + 1)
        pool = start.view(-1, ps, dim).to(device)
        write_owned(pool, rows, locs, own, rank, backend=backend)
        expect = ref_write_rows(start.view(-1, ps, dim), rows.cpu(), locs.cpu(), own, rank)
        assert_same_bytes(pool, expect, f"rank {rank}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_strided_pool_view(device, backend):
    """A layer of a ``[layers, pages, S, D + pad]`` buffer: page and row strides differ from a packed pool."""
    skip_unless(backend, device)
    own, ps, dim = PageOwnership(2, 6, "interleave"), 4, 12
    buf = torch.zeros(3, 3, ps, dim + 4, dtype=torch.float32, device=device)
    pool = buf[1, :, :, :dim]
    rows = torch.randn(17, dim, device=device)
    locs = scattered_locs(6, ps, 17).to(device)
    write_owned(pool, rows, locs, own, 1, backend=backend)
    expect = ref_write_rows(torch.zeros(3, ps, dim), rows.cpu(), locs.cpu(), own, 1)
    assert_same_bytes(pool, expect)
    assert not buf[0].any() and not buf[2].any() and not buf[1, :, :, dim:].any(), "wrote outside the view"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_allows_empty_and_all_padding(backend):
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 4, "interleave")
    pool = torch.ones(2, 2, 8)
    write_owned(pool, torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64), own, 0, backend=backend)
    write_owned(pool, torch.zeros(3, 8), torch.full((3,), -1, dtype=torch.int32), own, 0, backend=backend)
    assert torch.equal(pool, torch.ones(2, 2, 8))


BAD = [
    ("rows dtype", dict(rows=torch.zeros(4, 8, dtype=torch.float16)), TypeError, "rows must have dtype"),
    ("rows shape", dict(rows=torch.zeros(4, 9)), ValueError, "rows must have shape [*, 8]"),
    ("locs dtype", dict(locs=torch.zeros(4)), TypeError, "locs must have dtype"),
    ("locs shape", dict(locs=torch.zeros(5, dtype=torch.int64)), ValueError, "locs must have shape [4]"),
    ("loc too large", dict(locs=torch.tensor([0, 1, 16, 2])), ValueError, "got locs[2]=16"),
    ("loc below -1", dict(locs=torch.tensor([0, -2, 1, 2])), ValueError, "got locs[1]=-2"),
    ("pool too small", dict(pool=torch.zeros(1, 2, 8)), ValueError, "but pool holds only 1 local pages"),
    ("rank", dict(rank=2), ValueError, "rank must be in [0, cp_size=2)"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("what", "change", "exc", "msg"), BAD, ids=[b[0] for b in BAD])
def test_rejects_bad_input_leaving_pool_unchanged(backend, what, change, exc, msg):
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 8, "interleave")  # 16 token locations, rank 0 owns pages 0 2 4 6
    args = dict(pool=torch.randn(4, 2, 8), rows=torch.randn(4, 8), locs=torch.tensor([0, 5, 8, 13]), rank=0)
    args.update(change)
    before = args["pool"].clone()
    with pytest.raises(exc, match=re.escape(msg)):
        write_owned(args["pool"], args["rows"], args["locs"], own, args["rank"], backend=backend)
    assert_same_bytes(args["pool"], before, "pool changed")


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'triton'\), got backend='cuda'"):
        write_owned(torch.zeros(1, 1, 1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64), PageOwnership(1, 1),
                    0, backend="cuda")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    pool = torch.randn(3, 4, 8)
    args = (pool, torch.randn(6, 8), torch.tensor([0, 5, -1, 9, 17, 22]), 2, 6, 0, 1, True, backend)
    torch.library.opcheck(torch.ops.dtkv.write_owned.default, args)


@pytest.mark.parametrize("kind", OWNERSHIP_KINDS)
def test_compiles_without_graph_breaks(kind):
    backend = "triton" if _triton_cpu() else "torch"
    own = as_kind(PageOwnership(2, 6, "block"), kind)
    cnt = CompileCounterWithBackend("aot_eager")

    def step(pool, rows, locs):
        write_owned(pool, rows, locs, own, 1, backend=backend)
        return pool.sum()

    rows, locs = torch.randn(10, 8), scattered_locs(6, 4, 10)
    eager, compiled = torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)
    step(eager, rows, locs)
    torch.compile(step, backend=cnt, fullgraph=True)(compiled, rows, locs)
    assert cnt.frame_count == 1
    assert_same_bytes(compiled, eager)


def _triton_cpu() -> bool:
    from tests.ops_reference import backend_ok

    return backend_ok("triton", "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_misaligned_rows_and_pool(backend):
    """Odd byte offsets force byte-wide words on one side: both sides then copy bytes."""
    skip_unless(backend, "cpu")
    own = PageOwnership(1, 3)
    buf = torch.zeros(3 * 2 * 16 + 1, dtype=torch.uint8)
    pool = buf[1:].view(3, 2, 16)  # storage offset 1: only uint8 words
    rows = torch.randint(0, 255, (4, 16), dtype=torch.uint8)
    locs = torch.tensor([5, 0, 2, 3])
    write_owned(pool, rows, locs, own, 0, backend=backend)
    assert_same_bytes(pool, ref_write_rows(torch.zeros(3, 2, 16, dtype=torch.uint8), rows, locs, own, 0))
    assert buf[0] == 0
