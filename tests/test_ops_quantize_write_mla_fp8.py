"""``dtkv::quantize_write_mla_fp8``: fp8 MLA rows, written by owner, bit-identical to an independent reference.

Tolerances: none for the stored bytes. The reference quantizes with float32 IEEE arithmetic (``amax / 448``,
``x / s``) and a table-driven round-to-nearest-even onto e4m3, and every backend does the same arithmetic, so the
bytes agree exactly. The round trip is checked against the bound derived in :mod:`dtkv.ops.quantize_write_mla_fp8`:
``|x̂ - x| <= |x| / 16 + amax_block / 2**18`` (half an e4m3 ulp relative, the subnormal step, fp32 slack), and
``|x| / 2**8`` (half a bf16 ulp) on rope dims for fp32 input, exact for bf16 input.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dtkv import MLAFp8Layout, PageOwnership
from dtkv.ops import dequantize_mla_fp8, quantize_mla_fp8, quantize_write_mla_fp8
from tests.ops_reference import (
    BACKENDS,
    DEVICES,
    OWNERSHIP_KINDS,
    as_kind,
    assert_same_bytes,
    backend_ok,
    ref_mla_row,
    ref_write_rows,
    scattered_locs,
    skip_unless,
)

SMALL = MLAFp8Layout(page_size=16, kv_lora_rank=64, rope_dim=16, quant_block=32)
LAYOUTS = [
    pytest.param(MLAFp8Layout(page_size=1), id="glm-ps1"),
    pytest.param(SMALL, id="small-ps16"),
    pytest.param(MLAFp8Layout(page_size=64, kv_lora_rank=96, rope_dim=6, quant_block=32), id="odd-ps64"),
]


def _kv(n: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spanning 9 decades, an all-zero last row with a -0.0: subnormals, ties and the zero scale."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, dim, generator=g) * 10 ** torch.empty(n, 1).uniform_(-6, 3, generator=g)
    if n > 1:
        kv[-1] = 0.0
        kv[-1, 1] = -0.0
    return kv.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_write_mla_fp8_vs_reference(device, backend, layout, dtype):
    skip_unless(backend, device)
    own, ps = PageOwnership(2, 5, "interleave"), layout.page_size
    n = 3 if ps == 1 else 5 * ps - 3  # a partial last page
    kv = _kv(n, layout.row_dim, dtype)
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
    kv = _kv(64, layout.row_dim, dtype, seed=3)
    x = kv.float()
    back = dequantize_mla_fp8(quantize_mla_fp8(kv, layout), layout)
    L, qb = layout.kv_lora_rank, layout.quant_block
    lat, lat_back = x[:, :L].view(-1, L // qb, qb), back[:, :L].view(-1, L // qb, qb)
    bound = lat.abs() / 16 + lat.abs().amax(-1, keepdim=True) / 2**18
    assert ((lat_back - lat).abs() <= bound).all()
    rope_err = (back[:, L:] - x[:, L:]).abs()
    assert (rope_err <= (0 if dtype == torch.bfloat16 else 2**-8) * x[:, L:].abs()).all()
    assert not back.isnan().any()


def test_require_owned_rejects_foreign_pages_leaving_pool_unchanged():
    own = PageOwnership(2, 4, "interleave")
    pool = torch.randint(0, 255, (2, 16, SMALL.row_bytes), dtype=torch.uint8)
    before = pool.clone()
    kv, locs = torch.randn(3, SMALL.row_dim), torch.tensor([0, 16, 1])  # loc 16: page 1, rank 1
    with pytest.raises(ValueError, match=re.escape("locs[1]=16 is in logical page 1, owned by rank 1, not by rank 0")):
        quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=SMALL, require_owned=True)
    assert_same_bytes(pool, before)
    quantize_write_mla_fp8(pool, kv, locs, own, 0, layout=SMALL)  # owner filter: the foreign row is skipped
    assert_same_bytes(pool[1], before[1])


BAD = [
    ("kv dtype", dict(kv=torch.zeros(2, 80, dtype=torch.float64)), TypeError, "kv must have dtype"),
    ("kv shape", dict(kv=torch.zeros(2, 79)), ValueError, "kv must have shape [*, 80]"),
    ("pool dtype", dict(pool=torch.zeros(2, 16, 104)), TypeError, "pool must have dtype torch.uint8"),
    ("pool row", dict(pool=torch.zeros(2, 16, 100, dtype=torch.uint8)), ValueError, "pool must have shape [*, *, 104]"),
    ("page size", dict(pool=torch.zeros(2, 8, 104, dtype=torch.uint8)), ValueError, "pool must have page_size=16"),
    ("loc range", dict(locs=torch.tensor([0, 64])), ValueError, "got locs[1]=64"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("what", "change", "exc", "msg"), BAD, ids=[b[0] for b in BAD])
def test_rejects_bad_input_leaving_pool_unchanged(backend, what, change, exc, msg):
    skip_unless(backend, "cpu")
    own = PageOwnership(2, 4, "block")
    args = dict(pool=torch.randint(0, 255, (2, 16, SMALL.row_bytes), dtype=torch.uint8), kv=torch.randn(2, 80),
                locs=torch.tensor([0, 17]))  # fmt: skip
    args.update(change)
    before = args["pool"].clone()
    with pytest.raises(exc, match=re.escape(msg)):
        quantize_write_mla_fp8(args["pool"], args["kv"], args["locs"], own, 0, layout=SMALL, backend=backend)
    assert_same_bytes(args["pool"], before, "pool changed")


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    pool = torch.zeros(3, 16, SMALL.row_bytes, dtype=torch.uint8)
    args = (pool, torch.randn(5, 80).bfloat16(), torch.tensor([0, 17, -1, 40, 90]), 2, 6, 0, 0, 64, 16, 32, False,
            True, backend)  # fmt: skip
    torch.library.opcheck(torch.ops.dtkv.quantize_write_mla_fp8.default, args)


@pytest.mark.parametrize("kind", OWNERSHIP_KINDS)
def test_compiles_without_graph_breaks(kind):
    backend = "triton" if backend_ok("triton", "cpu") else "torch"
    own = as_kind(PageOwnership(2, 6, "block"), kind)
    cnt = CompileCounterWithBackend("aot_eager")

    def step(pool, kv, locs):
        quantize_write_mla_fp8(pool, kv, locs, own, 1, layout=SMALL, backend=backend)
        return dequantize_mla_fp8(pool, SMALL)

    kv, locs = _kv(20, SMALL.row_dim, torch.bfloat16), scattered_locs(6, 16, 20)
    eager = step(torch.zeros(3, 16, SMALL.row_bytes, dtype=torch.uint8), kv, locs)
    compiled = torch.compile(step, backend=cnt, fullgraph=True)(
        torch.zeros(3, 16, SMALL.row_bytes, dtype=torch.uint8), kv, locs
    )
    assert cnt.frame_count == 1
    assert_same_bytes(compiled, eager)
