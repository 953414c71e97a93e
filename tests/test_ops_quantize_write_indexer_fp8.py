"""``dtkv::quantize_write_indexer_fp8``: page-packed fp8 indexer keys + fp32 scales, bit-identical to a reference.

Tolerances: none for the stored bytes (same float32 IEEE arithmetic and round-to-nearest-even as the independent
table-driven reference). Round trip: ``|k̂ - k| <= |k| / 16 + amax_token / 2**18``, derived in
:mod:`dtkv.ops.quantize_write_indexer_fp8` (half an e4m3 ulp, the subnormal step, fp32 slack).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv import IndexerFp8Layout, PageOwnership
from dtkv.ops import dequantize_indexer_pages, quantize_indexer_fp8, quantize_write_indexer_fp8
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    OWNERSHIP_KINDS,
    as_kind,
    assert_same_bytes,
    backend_ok,
    ref_indexer_write,
    scattered_locs,
    skip_unless,
)

SMALL = IndexerFp8Layout(page_size=16, head_dim=32)


def _k(n: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, dim, generator=g) * 10 ** torch.empty(n, 1).uniform_(-6, 3, generator=g)
    if n > 1:
        k[-1] = 0.0  # zero scale
        k[-1, 2] = -0.0
    return k.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "layout",
    [IndexerFp8Layout(page_size=1, head_dim=128), SMALL, IndexerFp8Layout(page_size=64, head_dim=20)],
    ids=["ps1-h128", "ps16-h32", "ps64-h20"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_write_indexer_fp8_vs_reference(device, backend, layout, dtype):
    skip_unless(backend, device)
    own, ps = PageOwnership(3, 7, "interleave"), layout.page_size
    n = 1 if ps == 1 else 4 * ps + 5  # one token / a partial last page
    k = _k(n, layout.head_dim, dtype)
    locs = scattered_locs(7, ps, n, pad_every=6 if n > 6 else 0)
    for rank in range(3):
        start = torch.randint(0, 255, (own.num_local_pages(rank), *layout.page_shape), dtype=torch.uint8)
        pool = start.to(device)
        quantize_write_indexer_fp8(pool, k.to(device), locs.to(device), own, rank, layout=layout, backend=backend)
        assert_same_bytes(pool, ref_indexer_write(start, k, locs, own, rank, layout), f"rank {rank}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_round_trip_within_bound(dtype):
    layout = IndexerFp8Layout(page_size=4, head_dim=128)
    k = _k(16, 128, dtype, seed=5)
    own = PageOwnership(1, 4)
    pool = torch.zeros(4, *layout.page_shape, dtype=torch.uint8)
    quantize_write_indexer_fp8(pool, k, torch.arange(16), own, 0, layout=layout)
    back = dequantize_indexer_pages(pool, layout).view(16, 128)
    x = k.float()
    assert ((back - x).abs() <= x.abs() / 16 + x.abs().amax(-1, keepdim=True) / 2**18).all()
    q, s = quantize_indexer_fp8(k)
    assert torch.equal(s, pool[:, 4 * 128 :].contiguous().view(torch.float32).view(16))
    assert torch.equal(q.view(4, 4 * 128), pool[:, : 4 * 128])


BAD = [
    ("k dtype", dict(k=torch.zeros(2, 32, dtype=torch.int32)), TypeError, "k must have dtype"),
    ("k dim", dict(k=torch.zeros(2, 31)), ValueError, "k must have shape [*, 32] (layout.head_dim)"),
    ("pool shape", dict(pool=torch.zeros(2, 500, dtype=torch.uint8)), ValueError, "pool must have shape [*, 576]"),
    ("locs dtype", dict(locs=torch.tensor([0.0, 1.0])), TypeError, "locs must have dtype"),
    ("loc range", dict(locs=torch.tensor([0, 100])), ValueError, "got locs[1]=100"),
    ("foreign", dict(locs=torch.tensor([0, 16]), require_owned=True), ValueError, "owned by rank 1, not by rank 0"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("what", "change", "exc", "msg"), BAD, ids=[b[0] for b in BAD])
def test_rejects_bad_input_leaving_pool_unchanged(backend, what, change, exc, msg):
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 4, "interleave")
    args = dict(pool=torch.randint(0, 255, (2, 576), dtype=torch.uint8), k=torch.randn(2, 32),
                locs=torch.tensor([0, 33]), require_owned=False)  # fmt: skip
    args.update(change)
    before = args["pool"].clone()
    with pytest.raises(exc, match=re.escape(msg)):
        quantize_write_indexer_fp8(args["pool"], args["k"], args["locs"], own, 0, layout=SMALL,
                                   require_owned=args["require_owned"], backend=backend)  # fmt: skip
    assert_same_bytes(args["pool"], before, "pool changed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    pool = torch.zeros(3, SMALL.page_shape[0], dtype=torch.uint8)
    args = (pool, torch.randn(5, 32), torch.tensor([0, 17, -1, 40, 90]), 2, 6, 0, 0, 16, False, True, backend)
    torch.library.opcheck(torch.ops.dtkv.quantize_write_indexer_fp8.default, args)


@pytest.mark.parametrize("kind", OWNERSHIP_KINDS)
def test_compiles_without_graph_breaks(kind):
    backend = "triton" if backend_ok("triton", "cpu") else "torch"
    own = as_kind(PageOwnership(2, 6, "interleave"), kind)
    cnt = CompileCounterWithBackend("aot_eager")

    def step(pool, k, locs):
        quantize_write_indexer_fp8(pool, k, locs, own, 0, layout=SMALL, backend=backend)
        return dequantize_indexer_pages(pool, SMALL)

    k, locs = _k(20, 32, torch.bfloat16), scattered_locs(6, 16, 20)
    eager = step(torch.zeros(3, 576, dtype=torch.uint8), k, locs)
    compiled = torch.compile(step, backend=cnt, fullgraph=True)(torch.zeros(3, 576, dtype=torch.uint8), k, locs)
    assert cnt.frame_count == 1
    assert_same_bytes(compiled, eager)
