"""``dtkv::quantize_write_mla_fp8``: fp8 MLA rows, written by owner, bit-identical to an independent reference.

Tolerances: none for the stored bytes. The reference quantizes with float32 IEEE arithmetic (``amax / 448``,
``x / s``) and a table-driven round-to-nearest-even onto e4m3, and every backend does the same arithmetic, so the
bytes agree exactly. The round trip is checked against the bound derived in ``ops/quantize_write_mla_fp8.py``:
``|x̂ - x| <= |x| / 16 + amax_block / 2**18`` (half an e4m3 ulp relative, the subnormal step, fp32 slack), and
``|x| / 2**8`` (half a bf16 ulp) on rope dims for fp32 input, exact for bf16 input.
"""

from __future__ import annotations

import pytest
import torch

from dtkv import MLAFp8Layout, PageOwnership
from dtkv.ops import dequantize_mla_fp8, quantize_mla_fp8, quantize_write_mla_fp8
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    assert_same_bytes,
    backend_ok,
    ref_mla_row,
    ref_write_rows,
    scattered_locs,
    skip_unless,
    spread_rows,
)

SMALL = MLAFp8Layout(page_size=16, kv_lora_rank=64, rope_dim=16, quant_block=32)
LAYOUTS = [
    pytest.param(MLAFp8Layout(page_size=1), id="glm-ps1"),
    pytest.param(SMALL, id="small-ps16"),
    pytest.param(MLAFp8Layout(page_size=64, kv_lora_rank=96, rope_dim=6, quant_block=32), id="odd-ps64"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_write_mla_fp8_vs_reference(device, backend, layout, dtype):
    skip_unless(backend, device)
    own, ps = PageOwnership(2, 5, "interleave"), layout.page_size
    n = 3 if ps == 1 else 5 * ps - 3  # a partial last page
    kv = spread_rows(n, layout.row_dim, dtype)
    locs = scattered_locs(5, ps, n, pad_every=7 if n > 7 else 0)
    ref_rows = torch.stack([ref_mla_row(r, layout) for r in kv])
    for rank in range(2):
        pool = torch.zeros(own.num_local_pages(rank), ps, layout.row_bytes, dtype=torch.uint8, device=device)
        quantize_write_mla_fp8(pool, kv.to(device), locs.to(device), own, rank, layout=layout, backend=backend)
        expect = ref_write_rows(torch.zeros_like(pool, device="cpu"), ref_rows, locs, own, rank)
        assert_same_bytes(pool, expect, f"rank {rank}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_round_trip_within_bound(dtype):
    layout = MLAFp8Layout(page_size=4)
    kv = spread_rows(64, layout.row_dim, dtype, seed=3)
    x = kv.float()
    back = dequantize_mla_fp8(quantize_mla_fp8(kv, layout), layout)
    L, qb = layout.kv_lora_rank, layout.quant_block
    lat, lat_back = x[:, :L].view(-1, L // qb, qb), back[:, :L].view(-1, L // qb, qb)
    bound = lat.abs() / 16 + lat.abs().amax(-1, keepdim=True) / 2**18
    assert ((lat_back - lat).abs() <= bound).all()
    rope_err = (back[:, L:] - x[:, L:]).abs()
    assert (rope_err <= (0 if dtype == torch.bfloat16 else 2**-8) * x[:, L:].abs()).all()
    assert not back.isnan().any()


def test_owner_filter_skips_the_rows_a_direct_write_refuses():
    """``direct=True`` refuses loc 16 (``tests/test_ops_contracts.py``); the owner filter skips it."""
    own = PageOwnership(2, 4, "interleave")
    pool = torch.randint(0, 255, (2, 16, SMALL.row_bytes), dtype=torch.uint8)
    before = pool.clone()
    kv, locs = torch.randn(3, SMALL.row_dim), torch.tensor([0, 16, 1])  # loc 16: page 1, rank 1
    quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=SMALL)  # owner filter: the foreign row is skipped
    assert_same_bytes(pool[1], before[1])


def test_unaligned_geometry_falls_back_to_torch():
    """``kv_lora_rank % 4 != 0`` misaligns the fp32 scales: ``auto`` uses torch, ``triton`` says why not."""
    lay = MLAFp8Layout(page_size=2, kv_lora_rank=30, rope_dim=3, quant_block=15)
    own = PageOwnership(1, 2)
    kv, locs = torch.randn(3, lay.row_dim), torch.tensor([0, 3, 1])
    pool = torch.zeros(2, 2, lay.row_bytes, dtype=torch.uint8)
    quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=lay)
    assert_same_bytes(pool, ref_write_rows(torch.zeros_like(pool), torch.stack([ref_mla_row(r, lay) for r in kv]),
                                           locs, own, 0))  # fmt: skip
    if backend_ok("triton", "cpu"):
        with pytest.raises(NotImplementedError, match="divisible by 4"):
            quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=lay, backend="triton")


def test_direct_is_the_owner_filter_of_own_rows_and_require_owned_is_gone():
    """``direct=True`` with rows that all sit on this rank's pages stores what the owner filter stores; the 0.1
    spelling ``require_owned=`` was removed in 0.2."""
    own = PageOwnership(2, 4, "interleave")
    kv, locs = spread_rows(3, SMALL.row_dim, torch.float32), torch.tensor([0, 33, 1])  # pages 0 and 2: rank 0
    expect = torch.zeros(2, 16, SMALL.row_bytes, dtype=torch.uint8)
    quantize_write_mla_fp8(expect, kv, locs, own, 0, layout=SMALL)
    pool = torch.zeros_like(expect)
    quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=SMALL, direct=True)
    assert_same_bytes(pool, expect)
    assert pool.any()
    with pytest.raises(TypeError, match="require_owned"):
        quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=SMALL, require_owned=True)
