"""Exact sharded top-k for the DSA indexer: local top-k on each rank, one candidate all-gather, one global top-k.

Legend: ``N`` queries, ``S`` keys scored by one rank, ``K`` top-k, ``I`` indexer heads, ``J`` indexer dims,
``C`` ranks (``cp_size``).

**Selection rule** (the reference model's, :meth:`dtkv.model.TinyDSA.select`): scores are rounded to float32; a
higher score comes first; equal scores come in increasing position; keys that are not causal for the query (or
padding) are never selected; at most ``K`` keys are kept.

**Keys.** A candidate travels as one int64 whose integer order *is* the selection order
(``ord32(score) * 2**32 + (2**32 - 1 - position)``): the format is :mod:`dtkv.ops.selection_keys`', which the
indexer kernels pack with too; :func:`selection_keys`, :func:`unpack_keys`, :func:`key_positions`,
:data:`INVALID_KEY` and :data:`MAX_POSITION` are re-exported here. The order is total, so ``torch.topk`` over
keys needs no stable sort and ties cannot be broken differently on different ranks or devices.

**Why it is exact.** Every key of the global top-k is in its owner's local top-k (the order is total and identical
on every rank), so the top-k of the gathered candidates is the top-k of all keys: the same positions, in the same
order, as a stable sort of the full view -- provided each key's float32 score is the same in both computations.
The reference model scores in float64; a GEMM over a subset of the keys may differ from the full GEMM in the last
float64 bit (measured: ~1.5% of scores on CPU MKL), and float32 rounding absorbs that unless a score lies within
~1e-16 of a float32 rounding midpoint (about 2**-29 of scores), which then matters only at the K-th place.
``DTKV_DEBUG`` checks every selection against the full view (:func:`dtkv.decode.check_selection`).

**Bytes.** Each rank contributes ``N * K * 8`` bytes per layer and step (scores and positions packed in one int64),
whatever the context length; it receives ``(C - 1) * N * K * 8``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtkv._collectives import all_gather_rows, group_size
from dtkv.ops.selection_keys import INVALID_KEY, MAX_POSITION, key_positions, selection_keys, unpack_keys

__all__ = [
    "INVALID_KEY",
    "MAX_POSITION",
    "SelectionMismatchError",
    "check_selection",
    "global_topk",
    "index_scores",
    "key_positions",
    "local_topk",
    "selection_keys",
    "unpack_keys",
]


def index_scores(iq_NIJ: torch.Tensor, iw_NI: torch.Tensor, keys_NSJ: torch.Tensor) -> torch.Tensor:
    """DSA indexer scores ``sum_i iw[n, i] * relu(iq[n, i] . k[n, s])`` (the reference model's formula, batched).

    Args:
        iq_NIJ: indexer queries ``[N, I, J]``, floating.
        iw_NI: per-head weights ``[N, I]``, same dtype.
        keys_NSJ: each query's keys ``[N, S, J]``, same dtype (padding rows are masked later, by position).

    Returns:
        ``[N, S]`` in the inputs' dtype.
    """
    return (torch.relu(torch.einsum("nij,nsj->nis", iq_NIJ, keys_NSJ)) * iw_NI[:, :, None]).sum(1)


def local_topk(keys_NS: torch.Tensor, k: int, *, sorted: bool = True) -> torch.Tensor:
    """The ``k`` largest keys of each row: int64 ``[N, k]`` (padded with :data:`INVALID_KEY`), largest first, or in
    any order with ``sorted=False`` (the same set: keys are distinct; skips ``torch.topk``'s sort of the result)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    n, s = keys_NS.shape
    if s < k:
        pad = torch.full((n, k - s), INVALID_KEY, dtype=torch.int64, device=keys_NS.device)
        keys_NS = torch.cat((keys_NS, pad), dim=1)
    return torch.topk(keys_NS, k, dim=1, largest=True, sorted=sorted).values


def global_topk(local_NK: torch.Tensor, k: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather every rank's candidates and keep the ``k`` largest: the same int64 ``[N, k]`` on every rank.

    Collective over ``group`` (``None``: one process, returns ``local_topk(local_NK, k)``). Every rank passes
    ``[N, K]`` with the same ``N`` and ``K``; ``k <= K * cp_size``. Bytes per rank: ``N * K * 8`` sent.
    """
    cp = group_size(group)
    if cp == 1:
        return local_topk(local_NK, k)
    n, kk = local_NK.shape
    gathered = all_gather_rows(local_NK.contiguous(), group).view(cp, n, kk)
    return local_topk(gathered.transpose(0, 1).reshape(n, cp * kk), k)


class SelectionMismatchError(RuntimeError):
    """A sharded top-k differs from the full view's (raised by ``DTKV_DEBUG`` checks on every rank)."""


def check_selection(
    positions_NK: torch.Tensor, reference_NK: torch.Tensor, group: dist.ProcessGroup | None, *, what: str
) -> None:
    """Raise :class:`SelectionMismatchError` on every rank if any rank's selection differs from its reference.

    Collective over ``group`` (every rank calls it). Synchronizes; for ``DTKV_DEBUG`` and tests.

    Args:
        positions_NK: int64 ``[N, K]`` selected positions in selection order, ``-1`` padding.
        reference_NK: the same from the full view (e.g. :meth:`dtkv.model.TinyDSA.select`).
        group: the CP group (``None``: this process only).
        what: names the selection in the message (e.g. ``"layer 2, step 7"``).
    """
    got = positions_NK.detach().to("cpu", torch.int64)
    want = reference_NK.detach().to("cpu", torch.int64)
    mine = torch.tensor([0, -1, -1, -1, -1], dtype=torch.int64)
    if got.shape != want.shape:
        mine = torch.tensor([1, -1, -1, -1, -1], dtype=torch.int64)
    else:
        bad = torch.nonzero(got != want)
        if bad.numel():
            n, j = (int(v) for v in bad[0])
            mine = torch.tensor([1, n, j, int(got[n, j]), int(want[n, j])], dtype=torch.int64)
    verdicts = mine[None] if group_size(group) == 1 else all_gather_rows(mine[None], group)
    faulty = torch.nonzero(verdicts[:, 0]).flatten().tolist()
    if not faulty:
        return
    _, n, j, g, w = (int(v) for v in verdicts[faulty[0]])
    where = f"query {n}, place {j}: position {g} instead of {w}" if n >= 0 else "a different shape"
    raise SelectionMismatchError(
        f"DTKV_DEBUG: sharded top-k of {what} differs from the full view's top-k at {where} "
        f"(first on rank {faulty[0]}; ranks at fault: {faulty})"
    )
