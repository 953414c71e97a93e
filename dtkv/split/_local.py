"""Row helpers (run phase): move batch rows between natural order, a rank's local order and prev/next halves.

All of them are index ops driven by a :class:`dtkv.split.CPSplit`; none synchronizes with the host. Row tensors
have the token dimension first and any trailing shape (``[num_rows, *]``), any dtype.
"""

from __future__ import annotations

import torch

from dtkv._checks import check_tensor
from dtkv.split._plan import CPSplit

__all__ = ["merge_prev_next", "pad_local", "restore_natural", "split_prev_next", "take_local"]


def _check_rows(name: str, x: object, num_rows: int, what: str) -> torch.Tensor:
    x = check_tensor(name, x)
    if x.dim() == 0 or x.shape[0] != num_rows:
        raise ValueError(f"{name} must have {num_rows} rows ({what}) in dim 0, got {name}.shape={list(x.shape)}")
    return x


def _on(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return index if index.device == x.device else index.to(x.device, non_blocking=True)


def take_local(x: torch.Tensor, split: CPSplit, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a natural-order batch tensor, in local order.

    Args:
        x: ``[split.total_tokens, *]``, natural order (request by request).
        split: the plan.
        rank: the CP rank.

    Returns:
        ``[split.local(rank).num_tokens, *]`` (a new tensor).
    """
    loc = split.local(rank)
    x = _check_rows("x", x, split.total_tokens, "split.total_tokens")
    return x.index_select(0, _on(loc.token_index, x))


def pad_local(x_local: torch.Tensor, split: CPSplit) -> torch.Tensor:
    """Zero-pad local rows to ``split.max_local_tokens``, the equal per-rank size an all-gather needs.

    Args:
        x_local: ``[n, *]`` with ``n <= split.max_local_tokens``.

    Returns:
        ``[split.max_local_tokens, *]``; ``x_local`` itself when no padding is needed.
    """
    x_local = check_tensor("x_local", x_local)
    m = split.max_local_tokens
    if x_local.dim() == 0 or x_local.shape[0] > m:
        raise ValueError(
            f"x_local must have at most split.max_local_tokens={m} rows in dim 0, got x_local.shape="
            f"{list(x_local.shape)}"
        )
    if x_local.shape[0] == m:
        return x_local
    out = x_local.new_zeros((m, *x_local.shape[1:]))
    out[: x_local.shape[0]] = x_local
    return out


def restore_natural(gathered: torch.Tensor, split: CPSplit) -> torch.Tensor:
    """Natural-order rows from the rank-major all-gather of every rank's :func:`pad_local` output.

    Args:
        gathered: ``[cp * max_local_tokens, *]``, rank-major (flatten a ``[cp, max_local_tokens, *]`` result
            with ``.flatten(0, 1)`` first).

    Returns:
        ``[split.total_tokens, *]`` in natural order (padding rows dropped).
    """
    gathered = check_tensor("gathered", gathered)
    cp, m = split.cp_size, split.max_local_tokens
    gathered = _check_rows("gathered", gathered, cp * m, f"cp_size * max_local_tokens = {cp} * {m}")
    return gathered.index_select(0, _on(split.restore_index, gathered))


def split_prev_next(x_local: torch.Tensor, split: CPSplit, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split local rows (q, indexer weights, topk inputs, ...) into the prev and next halves.

    The halves follow the recorded segment lengths (``actual_seq_q_prev``/``next``), never ``(n + 1) // 2``:
    page-aligned segments are unequal. Each half is concatenated over requests; its indptr is
    ``local.cu_seqlens_q_prev``/``_next``.

    Args:
        x_local: ``[split.local(rank).num_tokens, *]`` in local order.

    Returns:
        ``(prev_rows, next_rows)``: ``[sum(actual_seq_q_prev), *]`` and ``[sum(actual_seq_q_next), *]``;
        views of ``x_local`` for a single request, new tensors otherwise.
    """
    loc = split.local(rank)
    x_local = _check_rows("x_local", x_local, loc.num_tokens, f"split.local({rank}).num_tokens")
    if loc.num_reqs == 1:
        n_prev = loc.actual_seq_q_prev[0]
        return x_local[:n_prev], x_local[n_prev:]
    return x_local.index_select(0, _on(loc.prev_index, x_local)), x_local.index_select(0, _on(loc.next_index, x_local))


def merge_prev_next(prev_rows: torch.Tensor, next_rows: torch.Tensor, split: CPSplit, rank: int) -> torch.Tensor:
    """Inverse of :func:`split_prev_next`: interleave the halves back into local order.

    Args:
        prev_rows: ``[sum(actual_seq_q_prev), *]``.
        next_rows: ``[sum(actual_seq_q_next), *]``, same trailing shape, dtype and device.

    Returns:
        ``[split.local(rank).num_tokens, *]`` in local order.
    """
    loc = split.local(rank)
    n_prev, n_next = sum(loc.actual_seq_q_prev), sum(loc.actual_seq_q_next)
    prev_rows = _check_rows("prev_rows", prev_rows, n_prev, f"sum(split.local({rank}).actual_seq_q_prev)")
    next_rows = _check_rows("next_rows", next_rows, n_next, f"sum(split.local({rank}).actual_seq_q_next)")
    if prev_rows.shape[1:] != next_rows.shape[1:] or prev_rows.dtype != next_rows.dtype:
        raise ValueError(
            "prev_rows and next_rows must share trailing shape and dtype, got "
            f"{list(prev_rows.shape)} {prev_rows.dtype} and {list(next_rows.shape)} {next_rows.dtype}"
        )
    if loc.num_reqs == 1:
        return torch.cat([prev_rows, next_rows], dim=0)
    out = prev_rows.new_empty((loc.num_tokens, *prev_rows.shape[1:]))
    out.index_copy_(0, _on(loc.prev_index, out), prev_rows)
    out.index_copy_(0, _on(loc.next_index, out), next_rows)
    return out
