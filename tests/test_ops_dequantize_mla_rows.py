"""``dtkv::dequantize_mla_rows``: the reference against an independent decode of the row format (the e4m3 codes'
bit fields, the scales' and rope dims' bytes), the kernel (interpreter) against the reference bit for bit (every
code byte, NaN codes and subnormals included, random scale and rope bits, both output dtypes), awkward layouts and
page counts, strided and page-major views, unaligned storage, empty input, opcheck, the errors, and on a GPU at
DeepSeek-V3.2's dims.

No tolerances: outputs are compared as bits (NaN positions as positions: a NaN's payload is not the format's).
"""

from __future__ import annotations

import re

import pytest
import torch

from dtkv import MLAFp8Layout
from dtkv.ops import dequantize_mla_rows, quantize_mla_fp8
from dtkv.ops.dequantize_mla_rows import dequantize_mla_rows_torch
from tests.ops_reference import BACKENDS, skip_unless

FP8 = MLAFp8Layout(page_size=64)
LAYOUTS = {
    "deepseek": FP8,
    "small": MLAFp8Layout(page_size=5, kv_lora_rank=24, rope_dim=6, quant_block=8),  # 3 scales, a pow2-padded tile
    "one-block": MLAFp8Layout(page_size=3, kv_lora_rank=4, rope_dim=2, quant_block=4),
    "no-rope": MLAFp8Layout(page_size=2, kv_lora_rank=12, rope_dim=0, quant_block=4),
}


def _e4m3(code: int) -> float:
    """e4m3fn decoded from its bit fields (S.EEEE.MMM, bias 7; S.1111.111 NaN, no infinities)."""
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def _independent(rows: torch.Tensor, lay: MLAFp8Layout) -> torch.Tensor:
    """Float64 ``[M, L + R]`` from the bytes alone (a table of the 256 codes, the scales and rope dims by bits)."""
    flat = rows.reshape(-1, lay.row_bytes)
    table = torch.tensor([_e4m3(c) for c in range(256)], dtype=torch.float64)
    codes = table[flat[:, : lay.kv_lora_rank].long()]
    sb = flat[:, lay.scale_offset : lay.rope_offset].contiguous().view(torch.int32)  # little-endian words
    scales = sb.view(torch.float32).double().repeat_interleave(lay.quant_block, dim=1)
    rb = flat[:, lay.rope_offset :].contiguous().view(torch.int16).int() << 16
    rope = rb.view(torch.float32).double()
    return torch.cat([codes * scales, rope], dim=1)


def _random_rows(lay: MLAFp8Layout, lead: tuple[int, ...], seed: int, *, finite_scales: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (*lead, lay.row_bytes), generator=g, dtype=torch.uint8)
    if finite_scales:  # scales over 2**-40..2**20, some 0 and some subnormal
        n = rows.numel() // lay.row_bytes
        s = torch.exp2(torch.randint(-40, 20, (n, lay.num_scales), generator=g).float())
        s = s * torch.rand(n, lay.num_scales, generator=g)
        s.view(-1)[:: max(1, s.numel() // 3)] = 0.0
        s.view(-1)[1 :: max(1, s.numel() // 3)] = 1e-40  # subnormal
        rows.view(-1, lay.row_bytes)[:, lay.scale_offset : lay.rope_offset] = s.view(torch.uint8).view(n, -1)
    return rows


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN against NaN by position (not payload)."""
    na, nb = a.isnan(), b.isnan()
    if not torch.equal(na, nb):
        return False
    ints = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return torch.equal(a.view(ints)[~na], b.view(ints)[~nb])


def test_reference_is_the_format():
    """The reference decodes every code byte, the scales and the rope bits as the format says (float32: the
    product ``code * scale`` of two float32 values is exact in float64, then rounded once)."""
    for lay in LAYOUTS.values():
        rows = _random_rows(lay, (7,), 1)
        rows[0, : min(256, lay.kv_lora_rank)] = torch.arange(min(256, lay.kv_lora_rank), dtype=torch.uint8)
        want = _independent(rows, lay)
        for dtype in (torch.float32, torch.bfloat16):
            got = dequantize_mla_rows_torch(rows, lay, dtype)
            assert got.shape == (7, lay.row_dim) and got.dtype == dtype
            assert _same_bits(got, want.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_triton_vs_reference(name, dtype):
    """Every byte pattern of the codes (random rows and one row of the 256 codes in order), random finite scales
    (0 and subnormal among them), random rope bits (NaN, infinities, subnormals): the reference's bits."""
    skip_unless("triton", "cpu")
    lay = LAYOUTS[name]
    pages = _random_rows(lay, (3, lay.page_size), 2)
    k = min(256, lay.kv_lora_rank)
    pages[0, 0, :k] = torch.arange(256, dtype=torch.uint8)[:k]
    want = dequantize_mla_rows(pages, lay, dtype=dtype, backend="torch")
    got = dequantize_mla_rows(pages, lay, dtype=dtype, backend="triton")
    assert got.shape == (3 * lay.page_size, lay.row_dim) and got.dtype == dtype and got.is_contiguous()
    assert _same_bits(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_scale_bits(backend):
    """Scales of any bits (NaN and infinite scales too): the reference's bits on either backend."""
    skip_unless(backend, "cpu")
    rows = _random_rows(FP8, (2, 64), 3, finite_scales=False)
    for dtype in (torch.bfloat16, torch.float32):
        want = dequantize_mla_rows_torch(rows, FP8, dtype)
        assert _same_bits(dequantize_mla_rows(rows, FP8, dtype=dtype, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_rows_round_trip(backend):
    """Rows written by the quantizer come back within its bound (``|x' - x| <= |x| / 16 + a / 2**18``), in bf16
    as the float32 result rounded once."""
    skip_unless(backend, "cpu")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * 64 + 13, 576, generator=g) * torch.exp2(torch.randint(-8, 8, (2 * 64 + 13, 1), generator=g))
    rows = quantize_mla_fp8(x, FP8)
    back = dequantize_mla_rows(rows, FP8, dtype=torch.float32, backend=backend)
    lat, xl = back[:, :512].view(-1, 4, 128), x[:, :512].view(-1, 4, 128)
    amax = xl.abs().amax(-1, keepdim=True)
    assert bool(((lat - xl).abs() <= xl.abs() / 16 + amax / 2**18).all())
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).float())
    assert _same_bits(dequantize_mla_rows(rows, FP8, dtype=torch.bfloat16, backend=backend), back.to(torch.bfloat16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_and_unaligned_storage(backend):
    """A page-major pool's layer view (page stride past the page, read in place), a slice of pages, rows with
    more leading dims, 1-D and 2-D rows, and pages at a storage offset that is not a multiple of 4 bytes (read
    through a copy) all decode to the rows of the same pages stored contiguously."""
    skip_unless(backend, "cpu")
    lay = LAYOUTS["small"]
    pages = _random_rows(lay, (5, lay.page_size), 6)
    want = dequantize_mla_rows(pages, lay, backend=backend)
    major = torch.zeros(5, 3, lay.page_size, lay.row_bytes, dtype=torch.uint8)  # [P, layers, S, row_bytes]
    major[:, 1] = pages
    assert _same_bits(dequantize_mla_rows(major[:, 1], lay, backend=backend), want)
    m = lay.page_size
    assert _same_bits(dequantize_mla_rows(pages[1:4], lay, backend=backend), want[m : 4 * m])
    assert _same_bits(dequantize_mla_rows(pages.view(5, 1, m, -1), lay, backend=backend), want)
    assert _same_bits(dequantize_mla_rows(pages.reshape(-1, lay.row_bytes), lay, backend=backend), want)
    assert _same_bits(dequantize_mla_rows(pages[2, 3], lay, backend=backend), want[2 * m + 3][None])
    for offset in (1, 2):
        buf = torch.zeros(pages.numel() + offset, dtype=torch.uint8)
        buf[offset:] = pages.reshape(-1)
        assert _same_bits(dequantize_mla_rows(buf[offset:].view(pages.shape), lay, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input(backend):
    skip_unless(backend, "cpu")
    for lead in ((0, 64), (0,)):
        out = dequantize_mla_rows(torch.zeros(*lead, FP8.row_bytes, dtype=torch.uint8), FP8, backend=backend)
        assert out.shape == (0, 576) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    rows = quantize_mla_fp8(torch.randn(10, 30), LAYOUTS["small"]).view(2, 5, -1)  # finite (opcheck: NaN != NaN)
    torch.library.opcheck(torch.ops.dtkv.dequantize_mla_rows.default, (rows, 24, 6, 8, torch.float32, backend))


def test_rejects_bad_input():
    rows = _random_rows(FP8, (2,), 8)
    with pytest.raises(TypeError, match=re.escape("layout must be a dtkv.MLAFp8Layout, got MLALatentLayout")):
        from dtkv import MLALatentLayout

        dequantize_mla_rows(rows, MLALatentLayout())
    with pytest.raises(TypeError, match=re.escape("rows must have dtype torch.uint8, got rows.dtype=torch.int8")):
        dequantize_mla_rows(rows.view(torch.int8), FP8)
    with pytest.raises(ValueError, match=re.escape("rows must have shape [..., 656] (layout.row_bytes), got")):
        dequantize_mla_rows(rows[:, :655], FP8)
    with pytest.raises(TypeError, match=re.escape("dtype must be one of [torch.bfloat16, torch.float32], got")):
        dequantize_mla_rows(rows, FP8, dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("backend must be one of")):
        dequantize_mla_rows(rows, FP8, backend="cuda")


def test_layouts_the_kernel_does_not_take():
    """``kv_lora_rank`` not divisible by 4 or an odd ``rope_dim``: ``"auto"`` decodes with torch, ``"triton"``
    names the rule."""
    skip_unless("triton", "cpu")
    lay = MLAFp8Layout(page_size=2, kv_lora_rank=6, rope_dim=3, quant_block=3)
    rows = _random_rows(lay, (2, 2), 9)
    want = dequantize_mla_rows_torch(rows, lay, torch.bfloat16)
    assert _same_bits(dequantize_mla_rows(rows, lay, backend="auto"), want)
    with pytest.raises(NotImplementedError, match=re.escape("kv_lora_rank divisible by 4 and an even rope_dim")):
        dequantize_mla_rows(rows, lay, backend="triton")


@pytest.mark.gpu
def test_cuda_kernel_vs_reference_at_deepseek_dims():
    """On a GPU, 1000 pages of 64 rows of random bytes (a 64K-row view), page-major: the reference's bits."""
    pages = _random_rows(FP8, (1000, 64), 10).cuda()
    major = torch.zeros(1000, 2, 64, FP8.row_bytes, dtype=torch.uint8, device="cuda")
    major[:, 1] = pages
    for dtype in (torch.bfloat16, torch.float32):
        want = dequantize_mla_rows(pages, FP8, dtype=dtype, backend="torch")
        assert _same_bits(dequantize_mla_rows(major[:, 1], FP8, dtype=dtype, backend="triton"), want)
