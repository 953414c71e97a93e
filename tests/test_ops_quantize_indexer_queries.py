"""``dtkv::quantize_indexer_queries``: the reference against :func:`dtkv.ops.quantize_indexer_fp8` (the indexer
keys' rule), the kernel (interpreter) against the reference bit for bit on every input dtype, awkward head and dim
counts, all-zero rows, magnitudes from 2**-30 to 2**20, strided queries and weights, opcheck, the errors, and on a
GPU at DeepSeek-V3.2's dims.

No tolerances: codes and weights are compared bit for bit (the kernel's divisions are IEEE-rounded like torch's,
its e4m3 conversion round-to-nearest-even like torch's ``.to(torch.float8_e4m3fn)`` of clamped values). Inputs
are finite (an infinite query has no defined scale).
"""

from __future__ import annotations

import re

import pytest
import torch

from dtkv.ops import quantize_indexer_fp8, quantize_indexer_queries
from dtkv.ops.quantize_indexer_queries import quantize_indexer_queries_torch
from tests.ops_reference import BACKENDS, skip_unless

SHAPES = [(1, 1, 1), (3, 5, 32), (4, 3, 48), (7, 64, 128), (2, 17, 100)]


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n, heads, _ = shape
    mag = torch.exp2(torch.randint(-30, 14, (n, heads, 1), generator=g).float())
    q = (torch.randn(*shape, generator=g) * mag).to(dtype)
    q[0, 0] = 0  # an all-zero row: scale 0, zero codes
    w = (torch.randn(n, heads, generator=g) - 0.2).to(dtype)
    return q, w


def _same(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_reference_is_the_key_rule():
    """Codes per (query, head) row as :func:`dtkv.ops.quantize_indexer_fp8` gives them (the keys' rule); the weight
    is ``w * scale_row * scale`` in that order; an all-zero row gets weight 0."""
    q, w = _inputs((3, 5, 32), torch.bfloat16, 0)
    codes, w8 = quantize_indexer_queries_torch(q, w, 0.25)
    want_codes, want_scale = quantize_indexer_fp8(q.float().reshape(-1, 32))
    assert torch.equal(codes.view(-1, 32), want_codes)
    assert torch.equal(w8, w.float() * want_scale.view(3, 5) * 0.25) and float(w8[0, 0]) == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_vs_reference(dtype, shape):
    skip_unless("triton", "cpu")
    q, w = _inputs(shape, dtype, sum(shape))
    if dtype == torch.float16:
        q = q.clamp(-6e4, 6e4)
    want = quantize_indexer_queries(q, w, scale=0.3, backend="torch")
    got = quantize_indexer_queries(q, w, scale=0.3, backend="triton")
    assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32
    assert _same(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend):
    """The indexer's queries as the adapter builds them (a head-split view of a projection, a weight column slice)
    give the codes of the contiguous tensors; a last dim that is not contiguous is copied first."""
    skip_unless(backend, "cpu")
    q, w = _inputs((6, 4, 32), torch.bfloat16, 3)
    want = quantize_indexer_queries(q, w, scale=0.5, backend=backend)
    wide = torch.zeros(6, 4, 40, dtype=torch.bfloat16)
    wide[..., :32] = q
    ww = torch.zeros(6, 9, dtype=torch.bfloat16)
    ww[:, 2:6] = w
    assert _same(quantize_indexer_queries(wide[..., :32], ww[:, 2:6], scale=0.5, backend=backend), want)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # last dim stride 4
    assert _same(quantize_indexer_queries(qt, w, scale=0.5, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    skip_unless(backend, "cpu")
    codes, w8 = quantize_indexer_queries(torch.zeros(0, 3, 8), torch.zeros(0, 3), backend=backend)
    assert codes.shape == (0, 3, 8) and w8.shape == (0, 3)
    codes, w8 = quantize_indexer_queries(torch.zeros(2, 3, 0), torch.ones(2, 3), backend=backend)
    assert codes.shape == (2, 3, 0) and w8.tolist() == [[0.0] * 3] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    q, w = _inputs((3, 4, 32), torch.float32, 5)
    torch.library.opcheck(torch.ops.dtkv.quantize_indexer_queries.default, (q, w, 0.5, backend))


def test_rejects_bad_input():
    q, w = _inputs((2, 3, 8), torch.float32, 1)
    with pytest.raises(ValueError, match=re.escape("scale must be > 0 (relu commutes only with a positive scale)")):
        quantize_indexer_queries(q, w, scale=0.0)
    with pytest.raises(TypeError, match=re.escape("q must have dtype [torch.bfloat16, torch.float16")):
        quantize_indexer_queries(q.to(torch.int32), w)
    with pytest.raises(ValueError, match=re.escape("q must have 3 dims, got q.shape=(2, 24)")):
        quantize_indexer_queries(q.view(2, 24), w)
    with pytest.raises(ValueError, match=re.escape("w must have shape [2, 3], got w.shape=[2, 4] (dim 1)")):
        quantize_indexer_queries(q, torch.zeros(2, 4))


@pytest.mark.gpu
def test_cuda_kernel_vs_reference_at_deepseek_dims():
    """On a GPU, 8192 queries x 64 heads x 128 dims in bf16 (a prefill chunk's indexer queries): the reference's
    bits (the hardware e4m3 conversion against torch's)."""
    q, w = _inputs((8192, 64, 128), torch.bfloat16, 9)
    q, w = q.cuda(), w.float().cuda()
    want = quantize_indexer_queries(q, w, scale=128**-0.5, backend="torch")
    got = quantize_indexer_queries(q, w, scale=128**-0.5, backend="triton")
    assert _same(got, want)
