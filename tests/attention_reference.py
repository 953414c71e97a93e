"""Independent references of the attention tests: sparse MLA by loops in float64 over rows decoded from their bytes.

No code shared with ``ops/`` or ``dtkv/attention``: a row is decoded by the layout's definition
(:class:`dtkv.MLAFp8Layout`: e4m3 bytes times their block's fp32 scale, the product rounded to float32 as the format
dequantizes; then the bf16 rope), and the softmax runs per (query, head) with Python floats.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["decode_row", "ref_sparse_mla"]


def decode_row(row: torch.Tensor, L: int, R: int, qb: int) -> list[float]:
    """One stored row -> float64 values, by the format's definition (latent: e4m3 value times its block's fp32 scale,
    the product in float32 as the format dequantizes)."""
    if row.dtype != torch.uint8:
        return [float(x) for x in row.double()]
    b = row.tolist()
    nb = L // qb
    scales = torch.tensor(b[L : L + 4 * nb], dtype=torch.uint8).view(torch.float32).tolist()
    lat = torch.tensor(b[:L], dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    rope = torch.tensor(b[L + 4 * nb : L + 4 * nb + 2 * R], dtype=torch.uint8).view(torch.bfloat16).double().tolist()
    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
    return [f32(lat[i] * scales[i // qb]) for i in range(L)] + rope


def ref_sparse_mla(q, rows, indices, scale, L, R, qb):
    """``q [N, H, L + R]``, stored ``rows [T, row]``, ``indices [N, K]`` (``-1`` and entries outside ``[0, T)``
    skipped) -> float64 ``(out [N, H, L], lse [N, H])``; zeros and ``-inf`` for a query with no row."""
    n, h, _ = q.shape
    out = torch.zeros(n, h, L, dtype=torch.float64)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float64)
    qd = q.double()
    for i in range(n):
        keys = [decode_row(rows[j], L, R, qb) for j in indices[i].tolist() if 0 <= j < rows.shape[0]]
        if not keys:
            continue
        k = torch.tensor(keys, dtype=torch.float64)  # [K', L + R]
        for hh in range(h):
            s = [float(qd[i, hh] @ k[j]) * scale for j in range(k.shape[0])]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            total = sum(w)
            lse[i, hh] = m + math.log(total)
            out[i, hh] = sum(wj / total * k[j, :L] for j, wj in enumerate(w))
    return out, lse
