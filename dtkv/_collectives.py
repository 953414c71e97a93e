"""Functional-collective helpers (compile-friendly, gloo-safe) shared by pools and materialization.

gloo has no fp8 (and we keep one code path for every dtype), so tensors travel as ``uint8`` views.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather_into", "all_gather_rows", "as_bytes", "from_bytes", "group_rank", "group_size"]

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # 2.13 name, then 2.11
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # likewise, in place


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``uint8`` with the last dim widened by the item size (no copy)."""
    if t.dtype == torch.uint8:
        return t
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def from_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_bytes`."""
    return t if dtype == torch.uint8 else t.view(dtype)


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``x`` (same shape on every rank) along dim 0 as bytes: ``[world * x.shape[0], ...]``.

    Uses functional collectives and waits for the result, so the output is a plain tensor that opaque ops may
    consume. Under ``torch.compile`` this traces to ``all_gather_into_tensor`` + ``wait_tensor``.
    """
    out = _all_gather(as_bytes(x).contiguous(), 0, group)
    out = funcol.wait_tensor(out)
    return from_bytes(out, x.dtype)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False):
    """In-place rank-major all-gather of ``x`` into ``out`` (``[world * x.shape[0], ...]``), as bytes.

    Returns the c10d work handle when ``async_op`` (call ``.wait()`` before reading ``out``), else None.
    """
    return _all_gather_into(as_bytes(out), as_bytes(x).contiguous(), group=group, async_op=async_op)


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)
