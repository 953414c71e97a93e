"""The selection-key format of the DSA indexer, written once: a score and its position packed into one int64.

Entry points: :func:`selection_keys` (pack, torch), :func:`unpack_keys` (its inverse), :data:`INVALID_KEY`,
:data:`MAX_POSITION`, and the Triton helper :func:`pack_selection_key` that the indexer kernels
(:mod:`dtkv.ops.indexer_scores`, :mod:`dtkv.ops.indexer_logits`) pack their scores with, so the torch references,
the kernels and :mod:`dtkv.decode` (which re-exports the torch side) cannot drift apart.

**Selection rule**: scores are rounded to float32; a higher score comes first; equal scores come in increasing
position; keys that are not visible to the query (not causal, another request, padding) are never selected.

**Keys.** A candidate travels as one int64 whose integer order *is* the selection order::

    key = ord32(score) * 2**32 + (2**32 - 1 - position)        INVALID_KEY = -2**63 for padding

``ord32`` maps the float32 bit pattern to an int32 that orders like the float (negative patterns get their 31
magnitude bits flipped); ``-0.0`` is folded into ``+0.0`` and every NaN into one NaN above ``+inf`` first, which is
how ``torch.sort`` orders them. Equal scores then order by position, so the order is total: ``torch.topk`` over keys
needs no stable sort, and ties cannot be broken differently on different ranks or devices. A ``-inf`` score is
never a valid key. The "position" is whatever orders ties: a token position (sharded decode), or a key-table column
(the extend-step indexer, whose columns are in position order within a request).
"""

from __future__ import annotations

import torch

from ._common import tl, triton

__all__ = [
    "INVALID_KEY",
    "MAX_POSITION",
    "NO_ORDER_KEY",
    "group_order_maxima",
    "key_positions",
    "order_key",
    "order_keys",
    "pack_selection_key",
    "selection_keys",
    "unpack_keys",
]

INVALID_KEY = -(2**63)
"""The key of a padding candidate: below every real key (a real key is at least ``ord32(-inf) * 2**32``)."""

MAX_POSITION = 2**32 - 2
"""Largest position a key can carry."""

NO_ORDER_KEY = -(2**31)
"""The int32 order key of a ``-inf`` score (:func:`order_keys`): below every candidate's."""

_LOW32 = 2**32 - 1
_MAG31 = 0x7FFFFFFF


def selection_keys(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Pack scores (rounded to float32) and positions into int64 keys ordered like the selection rule.

    Args:
        scores: ``[...]`` any floating dtype (rounded to float32 here).
        positions: int ``[...]`` (same shape, or broadcastable) positions in ``[0, MAX_POSITION]`` where valid.
        valid: bool ``[...]`` (likewise): False for padding and keys the query may not see; ``None``: every key
            with a score above ``-inf``. A ``-inf`` score is never valid.

    Returns:
        int64 ``[...]``; :data:`INVALID_KEY` where not valid.
    """
    s = scores.to(torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 -> +0.0 (equal floats must give equal keys)
    s = torch.where(torch.isnan(s), torch.full_like(s, float("nan")), s)  # one NaN, above +inf (as torch.sort)
    bits = s.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, torch.bitwise_xor(bits, _MAG31), bits)
    keys = ordered * (2**32) + (_LOW32 - positions.to(torch.int64))
    keep = s != float("-inf") if valid is None else valid & (s != float("-inf"))
    return torch.where(keep, keys, torch.full_like(keys, INVALID_KEY))


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int32 ``ord32`` of float32 scores (a key's upper half: ``-0.0`` as ``+0.0``, every NaN one NaN above
    ``+inf``), :data:`NO_ORDER_KEY` for ``-inf``: integers that order like the selection rule orders the scores."""
    s = scores.to(torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)
    s = torch.where(torch.isnan(s), torch.full_like(s, float("nan")), s)
    bits = s.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, torch.bitwise_xor(bits, _MAG31), bits)
    return torch.where(s == float("-inf"), torch.full_like(ordered, NO_ORDER_KEY), ordered)


def group_order_maxima(scores: torch.Tensor, group: int) -> torch.Tensor:
    """The largest :func:`order_keys` of each group of ``group`` consecutive columns of ``scores`` ``[N, K]``:
    int32 ``[N, cdiv(K, group)]`` (a partial last group takes the columns it has)."""
    n, num_keys = scores.shape
    num_groups = -(-num_keys // group)
    u = torch.full((n, num_groups * group), NO_ORDER_KEY, dtype=torch.int32, device=scores.device)
    u[:, :num_keys] = order_keys(scores)
    return u.view(n, num_groups, group).amax(dim=2)


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`selection_keys`: ``(scores float32, positions int64, valid bool)``, each ``keys.shape``.

    Invalid entries have position ``-1`` and score ``-inf``.
    """
    valid = keys != INVALID_KEY
    positions = key_positions(keys)
    ordered = torch.bitwise_right_shift(keys, 32)
    bits = torch.where(ordered < 0, torch.bitwise_xor(ordered, _MAG31), ordered).to(torch.int32)
    scores = bits.view(torch.float32)
    scores = torch.where(valid, scores, torch.full_like(scores, float("-inf")))
    return scores, torch.where(valid, positions, torch.full_like(positions, -1)), valid


def key_positions(keys: torch.Tensor) -> torch.Tensor:
    """The position each int64 key carries, without the validity mask of :func:`unpack_keys` (one op, no
    branch): a padding key's (:data:`INVALID_KEY`) is ``MAX_POSITION + 1``, past every real position."""
    return _LOW32 - torch.bitwise_and(keys, _LOW32)


@triton.jit
def order_key(s):
    """:func:`order_keys` of a tile inside a kernel: float32 ``s`` -> int32, :data:`NO_ORDER_KEY` for ``-inf``."""
    s = tl.where(s == 0.0, 0.0, s)
    s = tl.where(s != s, float("nan"), s)
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(s == float("-inf"), -2147483648, ordered)


@triton.jit
def pack_selection_key(s, pos, valid):
    """:func:`selection_keys` of a tile inside a kernel: float32 scores ``s``, int positions ``pos`` and bool
    ``valid`` (broadcastable to one shape) -> the int64 keys, :data:`INVALID_KEY` where not valid or ``-inf``."""
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0
    s = tl.where(s != s, float("nan"), s)  # every NaN one NaN
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = ordered * 4294967296 + (4294967295 - pos)
    return tl.where(valid & (s != float("-inf")), key, -9223372036854775808)
