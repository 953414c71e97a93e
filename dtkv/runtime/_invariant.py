"""Batch-invariant matrix products: a row's result does not depend on the rows that share its call.

A BLAS GEMM picks its kernel and blocking by the operands' shapes, so row ``i`` of ``x @ w`` can differ in its last
bits depending on how many rows ``x`` has (measured on CPU MKL: 15 of 27 row-count variations in float32). A prefix
cache makes the rows of a step depend on what was cached, so a float32 model's results would differ in their last
bits from the run without the cache. Inside :func:`batch_invariant` every matrix product runs as a loop of
fixed-shape calls -- rows in blocks of :data:`BLOCK_M`, columns of a product with activations in blocks of
:data:`BLOCK_N`, batch entries in blocks of :data:`BLOCK_B`, zero padded -- so each output element is computed by
the same kernel on the same operands whatever else shares the call: the same bits in every batch.

Covered: ``torch.nn.functional.linear`` (every ``nn.Linear``; the weight's shape is fixed per call site, so only the
rows are blocked), ``torch.matmul`` / ``@``, ``torch.mm``, ``torch.bmm`` and ``grouped_mm`` (transformers' MoE
experts: each expert's rows on their own). ``torch.einsum``, ``addmm`` and ``baddbmm``
raise inside the block (write the contraction with ``matmul``), so nothing is silently left batch-dependent.
Elementwise transcendental functions (``silu``, ``sigmoid``, ``exp``, ``sin``, ``cos``, ``rsqrt``, ...) are the
other source: CPU kernels compute a tensor's last ``numel % (2 * vector width)`` elements with the scalar function,
which differs from the vector one in the last bit for some inputs (``silu`` and ``sigmoid`` on AVX-512), so a
value's result would depend on its place in the tensor; inside the block they run on zero-padded flat inputs
(:func:`invariant_unary`). Everything else a DSA model runs is exact IEEE arithmetic or a per-row reduction over a
row length that does not change (norms, softmax over a fixed top-k), hence batch-invariant already.

Sharded decode's attention (:mod:`dtkv.decode`) runs outside it (:func:`suspended`): its sums follow the page
placement anyway and it is checked to a tolerance. It costs Python-level loops (tiny models: a few ms per layer);
the parity tests and ``--multi-turn`` demo of the transformers models use it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dtkv._util import cdiv

__all__ = [
    "BLOCK_B",
    "BLOCK_M",
    "BLOCK_N",
    "batch_invariant",
    "invariant_grouped_mm",
    "invariant_linear",
    "invariant_matmul",
    "invariant_unary",
]

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
    if a.numel() == 0 or b.numel() == 0:  # nothing to compute (a rank with no rows this step)
        return torch.matmul(a, b)
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


def invariant_grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """``F.grouped_mm`` for the MoE forward (``mat_a [S, K]`` rows grouped by ``offs``, ``mat_b [G, K, N]``), each
    group's rows through :func:`invariant_matmul`; rows past ``offs[-1]`` are zero."""
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None:
        raise NotImplementedError(
            "batch_invariant() supports grouped_mm of a 2-D mat_a with offs and a 3-D mat_b (the MoE forward), got "
            f"mat_a.dim()={mat_a.dim()}, mat_b.dim()={mat_b.dim()}, offs={'set' if offs is not None else None}"
        )
    out = mat_a.new_zeros((mat_a.shape[0], mat_b.shape[2]), dtype=out_dtype or mat_a.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            rows = _blocked_mm(mat_a[start:end], mat_b[g])
            if bias is not None:
                rows = rows + bias[g]
            out[start:end] = rows.to(out.dtype)
        start = end
    return out


VEC_ELEMENTS = 128
"""Elementwise transcendental ops run over a multiple of this many elements (see the module docstring)."""


def invariant_unary(func, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``func(x)`` for an elementwise transcendental ``func``, with every element on the vectorized path.

    CPU kernels compute the last ``numel % (2 * vector width)`` elements with the scalar function, which may differ
    from the vector one in the last bit (``silu`` and ``sigmoid`` do, measured on AVX-512): the result for a value
    would depend on where it sits in the tensor. The flattened input is zero padded to a multiple of
    :data:`VEC_ELEMENTS`, so no element is ever in a tail.
    """
    n = x.numel()
    if n == 0:
        return func(x, *args, **kwargs)
    flat = _pad(x.reshape(-1), 0, cdiv(n, VEC_ELEMENTS) * VEC_ELEMENTS)
    return func(flat, *args, **kwargs)[:n].reshape(x.shape)


_UNARY = {
    f
    for name in ("silu", "sigmoid", "gelu", "tanh")
    for f in (getattr(F, name, None), getattr(torch, name, None), getattr(torch.Tensor, name, None))
    if f is not None
} | {
    f
    for name in ("exp", "log", "sin", "cos", "rsqrt", "sqrt", "erf", "expm1", "log1p")
    for f in (getattr(torch, name), getattr(torch.Tensor, name))
}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_GROUPED = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None}
_MM = {torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm}
_REFUSED = {torch.einsum, torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm}


_SUSPENDED = threading.local()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Inside :func:`batch_invariant`, run the block with plain products (e.g. sharded decode's attention, whose
    sums follow the page placement and which is checked to a tolerance, not bitwise)."""
    before = getattr(_SUSPENDED, "on", False)
    _SUSPENDED.on = True
    try:
        yield
    finally:
        _SUSPENDED.on = before


class _BatchInvariant(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_SUSPENDED, "on", False):
            return func(*args, **kwargs)
        if func is F.linear:
            return invariant_linear(*args, **kwargs)
        if func in _MATMUL or func in _MM:
            out = kwargs.pop("out", None)
            if kwargs:
                raise TypeError(f"batch_invariant() does not support {func.__name__} with {sorted(kwargs)}")
            res = invariant_matmul(*args)
            return res if out is None else out.copy_(res)
        if func in _GROUPED:
            return invariant_grouped_mm(*args, **kwargs)
        if func in _UNARY and args and isinstance(args[0], torch.Tensor) and not kwargs.get("inplace", False):
            return invariant_unary(func, *args, **kwargs)
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
