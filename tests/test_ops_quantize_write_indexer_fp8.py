"""``dtkv::quantize_write_indexer_fp8``: page-packed fp8 indexer keys + fp32 scales, bit-identical to a reference.

Tolerances: none for the stored bytes (same float32 IEEE arithmetic and round-to-nearest-even as the independent
table-driven reference). Round trip: ``|k̂ - k| <= |k| / 16 + amax_token / 2**18``, derived in
the docstring of ``ops/quantize_write_indexer_fp8.py`` (half an e4m3 ulp, the subnormal step, fp32 slack).
"""

from __future__ import annotations

import pytest
import torch

from dtkv import IndexerFp8Layout, PageOwnership
from dtkv.ops import dequantize_indexer_pages, quantize_indexer_fp8, quantize_write_indexer_fp8
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    assert_same_bytes,
    ref_indexer_write,
    scattered_locs,
    skip_unless,
    spread_rows,
)

SMALL = IndexerFp8Layout(page_size=16, head_dim=32)


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
    k = spread_rows(n, layout.head_dim, dtype, neg_zero_col=2)
    locs = scattered_locs(7, ps, n, pad_every=6 if n > 6 else 0)
    for rank in range(3):
        start = torch.randint(0, 255, (own.num_local_pages(rank), *layout.page_shape), dtype=torch.uint8)
        pool = start.to(device)
        quantize_write_indexer_fp8(pool, k.to(device), locs.to(device), own, rank, layout=layout, backend=backend)
        assert_same_bytes(pool, ref_indexer_write(start, k, locs, own, rank, layout), f"rank {rank}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_round_trip_within_bound(dtype):
    layout = IndexerFp8Layout(page_size=4, head_dim=128)
    k = spread_rows(16, 128, dtype, seed=5, neg_zero_col=2)
    own = PageOwnership(1, 4)
    pool = torch.zeros(4, *layout.page_shape, dtype=torch.uint8)
    quantize_write_indexer_fp8(pool, k, torch.arange(16), own, 0, layout=layout)
    back = dequantize_indexer_pages(pool, layout).view(16, 128)
    x = k.float()
    assert ((back - x).abs() <= x.abs() / 16 + x.abs().amax(-1, keepdim=True) / 2**18).all()
    q, s = quantize_indexer_fp8(k)
    assert torch.equal(s, pool[:, 4 * 128 :].contiguous().view(torch.float32).view(16))
    assert torch.equal(q.view(4, 4 * 128), pool[:, : 4 * 128])


def test_direct_is_the_owner_filter_of_own_rows_and_require_owned_is_gone():
    """``direct=True`` with rows that all sit on this rank's pages stores what the owner filter stores; the 0.1
    spelling ``require_owned=`` was removed in 0.2."""
    own = PageOwnership(2, 4, "interleave")
    k, locs = spread_rows(3, 32, torch.float32, neg_zero_col=2), torch.tensor([0, 33, 1])  # pages 0 and 2: rank 0
    expect = torch.zeros(2, SMALL.page_shape[0], dtype=torch.uint8)
    quantize_write_indexer_fp8(expect, k, locs, own, 0, layout=SMALL)
    pool = torch.zeros_like(expect)
    quantize_write_indexer_fp8(pool, k, locs, own, 0, layout=SMALL, direct=True)
    assert_same_bytes(pool, expect)
    assert pool.any()
    with pytest.raises(TypeError, match="require_owned"):
        quantize_write_indexer_fp8(pool, k, locs, own, 0, layout=SMALL, require_owned=True)
