"""Batch-invariant matrix products: a row's result does not depend on the rows that share its call.

A BLAS GEMM picks its kernel and blocking by the operands' shapes, so row ``i`` of ``x @ w`` can differ in its last
bits depending on how many rows ``x`` has (measured on CPU MKL: 15 of 27 row-count variations in float32). A prefix
cache makes the rows of a step depend on what was cached, so a float32 model's results would differ in their last
bits from the run without the cache. Inside :func:`batch_invariant` every matrix product runs as a loop of
fixed-shape calls -- rows in blocks of :data:`BLOCK_M`, columns of a product with activations in blocks of
:data:`BLOCK_N`, batch entries in blocks of :data:`BLOCK_B`, zero padded -- so each output element is computed by
the same kernel on the same operands whatever else shares the call: the same bits in every batch.

Covered: ``torch.nn.functional.linear`` (every ``nn.Linear``; the weight's shape is fixed per call site, so only the
rows are blocked), ``torch.matmul`` / ``@``, ``torch.mm``, ``torch.bmm``. ``torch.einsum``, ``addmm`` and ``baddbmm``
raise inside the block (write the contraction with ``matmul``), so nothing is silently left batch-dependent.
Everything else a DSA model runs is row-wise (norms, rotary embedding, softmax over a fixed top-k, the MoE's
per-expert loop), hence batch-invariant already.

It costs Python-level loops (tiny models: a few ms per layer); the parity tests and ``--multi-turn`` demo of the
transformers models use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dtkv._util import cdiv

__all__ = ["BLOCK_B", "BLOCK_M", "BLOCK_N", "batch_invariant", "invariant_linear", "invariant_matmul"]

BLOCK_M = 16
"""Rows per call."""
BLOCK_N = 64
"""Columns per call of a product whose right operand is not a weight (its width varies between steps)."""
BLOCK_B = 8
"""Batch entries per ``bmm`` call."""


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    pad = list(x.shape)
    pad[dim] = size - x.shape[dim]
    return torch.cat((x, x.new_zeros(pad)), dim=dim)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in blocks of :data:`BLOCK_M` rows (``x`` ``[..., K]``)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if m == 0:
        return F.linear(flat, weight, bias).reshape(*lead, weight.shape[0])
    padded = _pad(flat, 0, cdiv(m, BLOCK_M) * BLOCK_M)
    out = torch.cat([F.linear(padded[i : i + BLOCK_M], weight, bias) for i in range(0, padded.shape[0], BLOCK_M)])
    return out[:m].reshape(*lead, weight.shape[0])


def invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` (broadcasting, 1-D operands) computed in fixed-shape blocks."""
    squeeze_m, squeeze_n = a.dim() == 1, b.dim() == 1
    if squeeze_m:
        a = a[None]
    if squeeze_n:
        b = b[:, None]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.dim() == 2:  # one right operand for every batch entry: fold the batch into the rows
        batch = a.shape[:-2]
        out = _blocked_mm(a.reshape(-1, k), b).reshape(*batch, m, n)
    else:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3 = a.expand(*batch, m, k).reshape(-1, m, k)
        b3 = b.expand(*batch, k, n).reshape(-1, k, n)
        out = _blocked_bmm(a3, b3).reshape(*batch, m, n)
    if squeeze_n:
        out = out[..., 0]
    if squeeze_m:
        out = out[..., 0, :] if not squeeze_n else out[..., 0]
    return out


def _blocked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    if m == 0 or n == 0:
        return torch.mm(a, b)
    ap = _pad(a, 0, cdiv(m, BLOCK_M) * BLOCK_M)
    bp = _pad(b, 1, cdiv(n, BLOCK_N) * BLOCK_N)
    rows = [
        torch.cat([torch.mm(ap[i : i + BLOCK_M], bp[:, j : j + BLOCK_N]) for j in range(0, bp.shape[1], BLOCK_N)], 1)
        for i in range(0, ap.shape[0], BLOCK_M)
    ]
    return torch.cat(rows)[:m, :n]


def _blocked_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    nb, m, n = a.shape[0], a.shape[1], b.shape[2]
    if nb == 0 or m == 0 or n == 0:
        return torch.bmm(a, b)
    ap = _pad(_pad(a, 0, cdiv(nb, BLOCK_B) * BLOCK_B), 1, cdiv(m, BLOCK_M) * BLOCK_M)
    bp = _pad(_pad(b, 0, ap.shape[0]), 2, cdiv(n, BLOCK_N) * BLOCK_N)
    out = ap.new_empty((ap.shape[0], ap.shape[1], bp.shape[2]))
    for s in range(0, ap.shape[0], BLOCK_B):
        for i in range(0, ap.shape[1], BLOCK_M):
            for j in range(0, bp.shape[2], BLOCK_N):
                out[s : s + BLOCK_B, i : i + BLOCK_M, j : j + BLOCK_N] = torch.bmm(
                    ap[s : s + BLOCK_B, i : i + BLOCK_M], bp[s : s + BLOCK_B, :, j : j + BLOCK_N]
                )
    return out[:nb, :m, :n]


_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_MM = {torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm}
_REFUSED = {torch.einsum, torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm}


class _BatchInvariant(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        if func in _MATMUL or func in _MM:
            if kwargs:
                raise TypeError(f"batch_invariant() does not support {func.__name__} with {sorted(kwargs)}")
            return invariant_matmul(*args)
        if func in _REFUSED:
            raise RuntimeError(
                f"batch_invariant() cannot make {getattr(func, '__name__', func)} batch-invariant: write the "
                "contraction with torch.matmul (or leave the block)"
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Inside the block, matrix products do not depend on the rows sharing a call (module docstring)."""
    if not enabled:
        yield
        return
    with _BatchInvariant():
        yield
