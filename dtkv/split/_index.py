"""Per-token index expansion for :mod:`dtkv.split`: every per-token index is a run of affine pieces.

A plan describes each index by blocks (one per request segment) of ``out[k] = slope * k + shift``; expanding
them costs one ``repeat`` plus one add (numpy on CPU), or one ``repeat_interleave`` on another device, where
only the per-block values cross over. No per-token Python loop anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "cached_arange",
    "expand_blocks",
    "expand_blocks_torch",
    "indptr_of",
    "invert_gather",
    "invert_gather_torch",
    "small_tensor",
]

_ARANGE = np.arange(0, dtype=np.int64)


def cached_arange(n: int) -> np.ndarray:
    """Read-only ``arange(n)`` (int64) sliced from a cache that only grows."""
    global _ARANGE
    if n > _ARANGE.size:
        a = np.arange(max(n, 2 * _ARANGE.size), dtype=np.int64)
        a.flags.writeable = False
        _ARANGE = a
    return _ARANGE[:n]


def expand_blocks(
    shift: np.ndarray, lens: np.ndarray, total: int, device: torch.device, slope: int = 1
) -> torch.Tensor:
    """int64 ``[total]`` on ``device`` with ``out[k] = slope * k + shift[b]`` for every row ``k`` of block ``b``.

    Block ``b`` spans ``lens[b]`` consecutive rows (``lens.sum() == total``). On CPU this is one numpy
    ``repeat`` plus one add of a cached ``arange``; elsewhere :func:`expand_blocks_torch` expands on the device.
    """
    if device.type != "cpu":
        return expand_blocks_torch(shift, lens, total, device, slope)
    out = np.repeat(shift.astype(np.int64, copy=False), lens)
    assert out.size == total, f"blocks cover {out.size} rows, expected {total}"
    if slope:
        out += cached_arange(total) if slope == 1 else slope * cached_arange(total)
    return torch.from_numpy(out)


def expand_blocks_torch(
    shift: np.ndarray, lens: np.ndarray, total: int, device: torch.device, slope: int = 1
) -> torch.Tensor:
    """:func:`expand_blocks` on ``device``: only the per-block values cross over; ``repeat_interleave`` gets
    ``output_size``, so nothing waits for the device."""
    shift_t = torch.from_numpy(shift.astype(np.int64, copy=False)).to(device, non_blocking=True)
    lens_t = torch.from_numpy(lens.astype(np.int64, copy=False)).to(device, non_blocking=True)
    out = torch.repeat_interleave(shift_t, lens_t, output_size=total)
    if slope:
        out.add_(torch.arange(total, device=device, dtype=torch.int64).mul_(slope))
    return out


def invert_gather(gather: torch.Tensor, num_local_tokens: Sequence[int], max_local: int, total: int) -> torch.Tensor:
    """``restore`` from ``gather``: one scatter a rank (numpy on CPU, :func:`invert_gather_torch` elsewhere)."""
    if gather.device.type != "cpu":
        return invert_gather_torch(gather, num_local_tokens, max_local, total)
    g, restore = gather.numpy(), np.empty(total, dtype=np.int64)
    for r, n in enumerate(num_local_tokens):
        restore[g[r * max_local : r * max_local + n]] = cached_arange(r * max_local + n)[r * max_local :]
    return torch.from_numpy(restore)


def invert_gather_torch(
    gather: torch.Tensor, num_local_tokens: Sequence[int], max_local: int, total: int
) -> torch.Tensor:
    """:func:`invert_gather` with ``index_copy_`` (any device)."""
    restore = torch.empty(total, dtype=torch.int64, device=gather.device)
    for r, n in enumerate(num_local_tokens):
        rows = torch.arange(r * max_local, r * max_local + n, dtype=torch.int64, device=gather.device)
        restore.index_copy_(0, gather[r * max_local : r * max_local + n], rows)
    return restore


def indptr_of(lens: np.ndarray) -> np.ndarray:
    """CSR offsets int64 ``[n + 1]`` of ``n`` lengths."""
    out = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def small_tensor(arr: np.ndarray, device: torch.device, dtype: type = np.int64) -> torch.Tensor:
    """A small host array as a tensor on ``device`` (cast on the host: a numpy cast costs far less than a torch op)."""
    t = torch.from_numpy(np.ascontiguousarray(arr, dtype=dtype))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
