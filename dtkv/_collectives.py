"""Collective helpers shared by pools, materialization, decode and the runtime: functional collectives
(compile-friendly, gloo-safe) and the CPU channel of a group.

- :func:`all_gather_rows` / :func:`all_gather_into` / :func:`gather_padded`: rank-major all-gathers along dim 0.
  gloo has no fp8 (and we keep one code path for every dtype), so tensors travel as ``uint8`` views.
- :func:`cpu_channel`: a process group over the same ranks that moves CPU tensors (the group itself when it has a
  gloo backend, otherwise a gloo mirror built once, ``new_group`` with local synchronization). Host-side
  agreements (:func:`dtkv._agree.agree`: plans, step verdicts, configurations) run on it; on an NCCL group their
  collectives would wait for the GPU to drain, which in chunked prefill exposes the next step's host work.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "all_gather_into",
    "all_gather_rows",
    "as_bytes",
    "cpu_channel",
    "from_bytes",
    "gather_padded",
    "group_rank",
    "group_size",
]

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


def gather_padded(x: torch.Tensor, rows: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rank-major all-gather of ``x`` ``[n, ...]`` padded with zero rows to ``rows >= n``: ``[cp * rows, ...]``
    (``group=None``: ``x`` padded, nothing exchanged)."""
    if x.shape[0] != rows:
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        x = padded
    return x if group is None else all_gather_rows(x, group)


_MIRRORS: dict[str, dist.ProcessGroup] = {}


def cpu_channel(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group over the same ranks that moves CPU tensors (``group`` itself when it has gloo).

    The gloo mirror of a GPU-only group is built on first use; every rank of ``group`` must reach that first use
    (it is collective over the group's ranks only).
    """
    if "gloo" in str(dist.get_backend(group)):
        return group
    name = group.group_name
    mirror = _MIRRORS.get(name)
    if mirror is None:
        ranks = dist.get_process_group_ranks(group)
        mirror = dist.new_group(
            ranks, backend="gloo", use_local_synchronization=True, timeout=datetime.timedelta(minutes=5)
        )
        _MIRRORS[name] = mirror
    return mirror


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)
