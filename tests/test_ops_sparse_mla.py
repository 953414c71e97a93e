"""``dtkv::sparse_mla``: MLA attention over selected rows, fp8 or latent, against a float64 loop reference.

``ref_sparse_mla`` (``tests/attention_reference.py``) decodes each selected row from its bytes by the layout's definition (e4m3 bytes times the fp32
scale of their block, then the bf16 rope; :class:`dtkv.MLAFp8Layout`) and runs the softmax per (query, head) in
float64, sharing no code with ``ops/``. Tolerances, per path:

- the torch reference (:func:`dtkv.ops.sparse_mla.sparse_mla_torch`) in float64: ``1e-12`` (summation order only);
- the Triton kernel with float32 queries: ``2e-5`` (float32 products and online-softmax rescaling, ~1e-6 measured);
- the Triton kernel with bf16 queries: ``0.05`` absolute on outputs of magnitude ~1 and ``0.03`` on ``lse``: keys and
  probabilities are rounded to bf16 before the products (relative 2**-8 each, as FlashMLA does), which moves the
  logits by ~1e-2.

Empty queries (every index ``-1`` or out of range) are exact on every path: zeros and ``-inf``.
"""

from __future__ import annotations

import re

import pytest
import torch

from dtkv import MLAFp8Layout
from dtkv.ops import quantize_mla_fp8, sparse_mla
from dtkv.ops.sparse_mla import sparse_mla_torch
from tests.attention_reference import ref_sparse_mla
from tests.ops_reference import BACKENDS, skip_unless

LAY = MLAFp8Layout(page_size=4, kv_lora_rank=64, rope_dim=16, quant_block=32)


def _case(seed, n=5, heads=4, rows=40, k=20, fp8=True, q_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(rows, 80, generator=g)
    kv = quantize_mla_fp8(src, LAY) if fp8 else src.to(torch.bfloat16)
    q = torch.randn(n, heads, 80, generator=g).to(q_dtype)
    idx = torch.randint(-1, rows + 3, (n, k), generator=g).to(torch.int32)  # some past the rows: skipped
    if n > 2:
        idx[2] = -1  # an empty query
    return q, kv, idx


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "latent"])
@pytest.mark.parametrize(("n", "heads", "k"), [(1, 1, 1), (5, 4, 20), (3, 3, 37)])
def test_reference_vs_loops(fp8, n, heads, k):
    q, kv, idx = _case(n * 7 + k, n=n, heads=heads, k=k, fp8=fp8, q_dtype=torch.float64)
    want_out, want_lse = ref_sparse_mla(q, kv, idx, 0.11, 64, 16, 32)
    out, lse = sparse_mla_torch(q, kv, idx, 0.11, 64, 16, 32)
    assert out.dtype == lse.dtype == torch.float64
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(out, want_out, rtol=0, atol=1e-12)
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "latent"])
@pytest.mark.parametrize(("n", "heads", "k"), [(1, 1, 1), (5, 4, 20), (3, 19, 37)])  # K and H past a block
def test_op_vs_reference(backend, q_dtype, fp8, n, heads, k):
    skip_unless(backend, "cpu")
    q, kv, idx = _case(n * 13 + k, n=n, heads=heads, k=k, fp8=fp8, q_dtype=q_dtype)
    want_out, want_lse = ref_sparse_mla(q, kv, idx, 0.11, 64, 16, 32)
    out, lse = sparse_mla(q, kv, idx, 0.11, kv_lora_rank=64, rope_dim=16, quant_block=32, backend=backend)
    assert out.shape == (n, heads, 64) and out.dtype == q_dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    empty = torch.isinf(want_lse)
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and bool((lse[empty] == float("-inf")).all())
    tol_out, tol_lse = (0.05, 0.03) if q_dtype == torch.bfloat16 and backend == "triton" else (2e-5, 2e-5)
    if q_dtype == torch.bfloat16 and backend == "torch":
        tol_out = 8e-3  # the output's one rounding to bf16 (half an ulp at magnitude ~1)
    assert (out.double() - want_out).abs().max() <= tol_out
    assert (lse.double() - want_lse)[~empty].abs().max() <= tol_lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_kv_and_no_queries(backend):
    skip_unless(backend, "cpu")
    q, kv, idx = _case(1)
    out, lse = sparse_mla(q, kv[:0], idx, 0.1, kv_lora_rank=64, rope_dim=16, quant_block=32, backend=backend)
    assert not out.any() and bool((lse == float("-inf")).all())
    out, lse = sparse_mla(q[:0], kv, idx[:0], 0.1, kv_lora_rank=64, rope_dim=16, quant_block=32, backend=backend)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize(
    ("change", "exc", "msg"),
    [
        (dict(q=torch.zeros(5, 4, 81)), ValueError, "q must have shape [N, H, kv_lora_rank + rope_dim = 80]"),
        (dict(q=torch.zeros(5, 4, 80, dtype=torch.int32)), TypeError, "q must have dtype"),
        (dict(idx=torch.zeros(4, 20, dtype=torch.int32)), ValueError, "indices must have shape [N=5, K]"),
        (dict(idx=torch.zeros(5, 20)), TypeError, "indices must have dtype"),
        (dict(kv=torch.zeros(40, 657, dtype=torch.uint8)), ValueError, "kv_rows (fp8) must have shape [T, 104]"),
        (dict(kv=torch.zeros(40, 81)), ValueError, "kv_rows (latent) must have shape [T, 80]"),
        (dict(qb=48), ValueError, "quant_block must divide kv_lora_rank for fp8 rows, got quant_block=48"),
    ],
)
def test_rejects_bad_arguments(change, exc, msg):
    q, kv, idx = _case(0)
    args = dict(q=q, kv=kv, idx=idx, qb=32)
    args.update(change)
    with pytest.raises(exc, match=re.escape(msg)):
        sparse_mla(args["q"], args["kv"], args["idx"], 0.1, kv_lora_rank=64, rope_dim=16, quant_block=args["qb"])


def test_triton_rejects_dims_it_cannot_tile():
    q = torch.zeros(2, 2, 60)
    kv = torch.zeros(8, 60)
    with pytest.raises(ValueError, match=re.escape("needs kv_lora_rank and rope_dim to be powers of two >= 16")):
        torch.ops.dtkv.sparse_mla(q, kv, torch.zeros(2, 3, dtype=torch.int32), 0.1, 48, 12, 0, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "latent"])
def test_opcheck(backend, fp8):
    skip_unless(backend, "cpu")
    q, kv, idx = _case(3, n=3, heads=2, k=16, fp8=fp8)
    torch.library.opcheck(torch.ops.dtkv.sparse_mla.default, (q, kv, idx, 0.1, 64, 16, 32, backend))
