"""Planning a CP split of a batch: :func:`plan_cp_split` -> :class:`CPSplit` and its per-rank :class:`LocalSplit`.

The rules are stated once, in :mod:`dtkv.split`. Planning is host-side (plan phase) per-request math on
``[num_reqs, 2cp+1]`` numpy arrays. Every per-token index is a run of affine pieces, one per (request,
segment), so it is expanded with one ``repeat`` plus one add (no per-token Python loop), lazily, on the
target device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from dtkv._checks import check_int
from dtkv._util import as_int_array
from dtkv.split._index import expand_blocks, indptr_of, invert_gather, small_tensor

__all__ = ["INT32_MAX", "CPSplit", "LocalSplit", "SplitMode", "plan_cp_split"]

SplitMode = Literal["zigzag", "round_robin"]
_MODES = ("zigzag", "round_robin")


INT32_MAX = 2**31 - 1
"""Largest KV length (``prefix_len + extend_len``) and batch size (``sum(extend_lens)``) a split accepts: the
per-request lengths and indptrs kernels read are int32 (as flashinfer's and FlashMLA's are)."""


def _as_lengths(name: str, values: object) -> np.ndarray:
    """Per-request lengths as int64 numpy ``[num_reqs]``; raises naming ``name``, the value and the rule."""
    return as_int_array(name, values, ndim=1, shape_hint="[num_reqs]", min_value=0)


def _check_int32_lengths(prefix: np.ndarray, extend: np.ndarray) -> None:
    """Reject KV lengths and batch sizes the int32 tensors of the split cannot hold (no silent wrap-around)."""
    for name, arr in (("prefix_lens", prefix), ("extend_lens", extend)):
        if arr.size and int(arr.max()) > INT32_MAX:
            i = int(np.argmax(arr))
            raise ValueError(f"{name} must be <= 2**31 - 1 (int32 KV lengths), got {name}[{i}]={int(arr[i])}")
    kv = prefix + extend  # both <= 2**31 - 1: no int64 overflow
    if kv.size and int(kv.max()) > INT32_MAX:
        i = int(np.argmax(kv))
        raise ValueError(
            "prefix_lens[i] + extend_lens[i] must be <= 2**31 - 1 (the int32 KV lengths kernels read), got "
            f"prefix_lens[{i}] + extend_lens[{i}] = {int(prefix[i])} + {int(extend[i])} = {int(kv[i])}"
        )
    total = int(extend.sum())
    if total > INT32_MAX:
        raise ValueError(
            f"sum(extend_lens) must be <= 2**31 - 1 (the int32 cu_seqlens of the batch), got {total} tokens"
        )


_SEGMENT_INDEX: dict[int, np.ndarray] = {}


def _zigzag_boundaries(
    prefix: np.ndarray, extend: np.ndarray, cp: int, page_size: int, page_aligned: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Extend-relative boundaries int64 ``[num_reqs, 2cp+1]`` and the aligned flags bool ``[num_reqs]``."""
    num_segs = 2 * cp
    j = _SEGMENT_INDEX.get(num_segs)
    if j is None:
        j = _SEGMENT_INDEX.setdefault(num_segs, np.arange(num_segs + 1, dtype=np.int64))
    base = extend // num_segs
    bounds = np.minimum(j, (extend - base * num_segs)[:, None])  # token-balanced: base * j + min(j, rem)
    bounds += base[:, None] * j
    if not page_aligned:
        return bounds, np.zeros(extend.size, dtype=bool)
    first_page = prefix // page_size
    end_page = (prefix + extend + page_size - 1) // page_size
    aligned = end_page - first_page >= num_segs  # pages touched (an empty extend has end - first <= 1)
    if aligned.any():
        inner = j[1:num_segs]
        # Nearest page edge (ties go up), in page units. Boundary k must lie in [first_page + k,
        # end_page - 2cp + k] (a page a segment), so m - k is clipped to [first_page, end_page - 2cp]; a running
        # max then keeps m strictly increasing by pushing a boundary right of its predecessor.
        m = (bounds[:, 1:num_segs] + (prefix + page_size // 2)[:, None]) // page_size
        m -= inner
        np.clip(m, first_page[:, None], np.maximum(end_page - num_segs, first_page)[:, None], out=m)
        np.maximum.accumulate(m, axis=1, out=m)
        m += inner
        m *= page_size
        m -= prefix[:, None]
        np.copyto(bounds[:, 1:num_segs], m, where=aligned[:, None])
    return bounds, aligned


def _rr_first_offset(ext_start: np.ndarray, cp: int) -> np.ndarray:
    """Round-robin: extend offset of each rank's first token of each request, int64 ``[num_reqs, cp]``.

    Batch row ``t`` goes to rank ``t % cp``, so request ``i`` (rows from ``ext_start[i]``) gives rank ``r`` its
    offsets ``o`` with ``o == (r - ext_start[i]) % cp (mod cp)``; the value may exceed the request's length.
    """
    return (np.arange(cp, dtype=np.int64)[None, :] - ext_start[:, None]) % cp


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LocalSplit:
    """One rank's share of a :class:`CPSplit` (build with :meth:`CPSplit.local`; cached there).

    Local order is request by request, each request's prev segment then its next segment. Host tuples have
    one entry per request; tensors live on ``CPSplit.device``.
    """

    rank: int
    """The CP rank this view describes."""
    num_reqs: int
    """Requests in the batch (every rank sees every request, possibly with zero local tokens)."""
    num_tokens: int
    """Tokens this rank computes (``cu_seqlens_q[-1]``)."""
    actual_seq_q_prev: tuple[int, ...]
    """Per request, tokens of the prev segment (segment ``rank`` in zigzag, every local token in round_robin)."""
    actual_seq_q_next: tuple[int, ...]
    """Per request, tokens of the next segment (segment ``2cp-1-rank`` in zigzag, 0 in round_robin)."""
    kv_len_prev: tuple[int, ...]
    """Per request, causal KV extent of the prev segment: ``prefix_len + end of the segment`` (round_robin:
    ``prefix_len + 1 +`` the extend offset of the request's last local token, or ``prefix_len`` with none)."""
    kv_len_next: tuple[int, ...]
    """Per request, causal KV extent of the next segment (round_robin: equal to ``kv_len_prev``)."""
    token_index: torch.Tensor = field(repr=False)
    """int64 ``[num_tokens]``: row of the natural-order batch tensor behind each local row."""
    positions: torch.Tensor = field(repr=False)
    """int64 ``[num_tokens]``: absolute position (``prefix_len + extend offset``) of each local row."""
    req_idx: torch.Tensor = field(repr=False)
    """int64 ``[num_tokens]``: request of each local row."""
    cu_seqlens_q: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs + 1]``: local rows of request ``i`` are ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``."""
    cu_seqlens_q_prev: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs + 1]``: indptr of the prev rows as concatenated by :func:`dtkv.split.split_prev_next`."""
    cu_seqlens_q_next: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs + 1]``: indptr of the next rows as concatenated by :func:`dtkv.split.split_prev_next`."""
    prev_index: torch.Tensor = field(repr=False)
    """int64 ``[cu_seqlens_q_prev[-1]]``: local rows of the prev segments, request by request."""
    next_index: torch.Tensor = field(repr=False)
    """int64 ``[cu_seqlens_q_next[-1]]``: local rows of the next segments, request by request."""
    actual_seq_q_prev_tensor: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs]`` twin of :attr:`actual_seq_q_prev`, for kernels."""
    actual_seq_q_next_tensor: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs]`` twin of :attr:`actual_seq_q_next`."""
    kv_len_prev_tensor: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs]`` twin of :attr:`kv_len_prev`."""
    kv_len_next_tensor: torch.Tensor = field(repr=False)
    """int32 ``[num_reqs]`` twin of :attr:`kv_len_next`."""


@dataclass(frozen=True, slots=True)
class _Blocks:
    """Host description of the per-token indices as runs ("blocks") of an affine map.

    Rank ``r``'s local rows of request ``i`` come in ``k`` blocks (zigzag: prev, next; round_robin: one); local
    row ``q`` of block ``(r, i, k)`` holds natural row ``slope * q + shift[r, i, k]``.
    """

    shift: np.ndarray  # int64 [cp, num_reqs, k]
    lens: np.ndarray  # int64 [cp, num_reqs, k]
    slope: int


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class CPSplit:
    """Split metadata of one CP extend batch (plan phase; build with :func:`plan_cp_split`).

    Host fields are Python ints/tuples or CPU tensors. The per-token index tensors (:attr:`restore_index`,
    :attr:`gather_index`, and those of :meth:`local`) live on :attr:`device` and are built on first use, then
    cached, so a rank pays only for what it reads. Instances compare by identity (they hold tensors).
    """

    cp_size: int
    """Ranks in the CP group."""
    page_size: int
    """Tokens per KV page."""
    mode: SplitMode
    """``"zigzag"`` or ``"round_robin"``."""
    num_reqs: int
    """Requests in the batch."""
    prefix_lens: tuple[int, ...]
    """Per request, tokens already in the KV pool."""
    extend_lens: tuple[int, ...]
    """Per request, tokens computed in this step."""
    extend_indptr: tuple[int, ...] = field(repr=False)
    """``[num_reqs + 1]``: request ``i`` owns rows ``extend_indptr[i]:extend_indptr[i+1]`` of the natural batch."""
    boundaries: torch.Tensor | None = field(repr=False)
    """int64 CPU ``[num_reqs, 2cp+1]``: extend-relative segment boundaries (zigzag); None for round_robin."""
    page_aligned: torch.Tensor = field(repr=False)
    """bool CPU ``[num_reqs]``: the request was split on page edges, so each page it touches has one compute
    owner. False for fallback requests, under ``page_aligned=False`` and for round_robin."""
    all_page_aligned: bool
    """Every request is page-aligned (False for an empty batch)."""
    total_tokens: int
    """Rows of the natural-order batch (sum of ``extend_lens``)."""
    num_local_tokens: tuple[int, ...]
    """Per rank, tokens it computes."""
    max_local_tokens: int
    """Padded per-rank all-gather size: ``max(num_local_tokens)``."""
    device: torch.device = field(repr=False)
    """Where the per-token index tensors live."""
    _counts: np.ndarray = field(repr=False)  # int64 [num_reqs, cp]: local tokens per (request, rank)
    _starts: np.ndarray = field(repr=False)  # int64 [num_reqs, cp]: first local row per (request, rank)
    _blocks: _Blocks = field(repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_segments(self) -> int:
        """Zigzag segments per request: ``2 * cp_size``."""
        return 2 * self.cp_size

    @property
    def segment_lens(self) -> torch.Tensor | None:
        """int64 CPU ``[num_reqs, 2cp]``: token counts of the zigzag segments (None for round_robin)."""
        return None if self.boundaries is None else self.boundaries.diff(dim=1)

    @property
    def restore_index(self) -> torch.Tensor:
        """int64 ``[total_tokens]``: natural row ``t`` -> its row in the rank-major gathered tensor
        ``[cp * max_local_tokens]``."""
        if "restore" not in self._cache:
            self._cache["restore"] = _build_restore(self)
        return self._cache["restore"]

    @property
    def gather_index(self) -> torch.Tensor:
        """int64 ``[cp * max_local_tokens]``: gathered row -> natural row, ``-1`` for padding (the inverse of
        :attr:`restore_index`)."""
        if "gather" not in self._cache:
            self._cache["gather"] = _build_gather(self)
        return self._cache["gather"]

    def local(self, rank: int) -> LocalSplit:
        """Rank ``rank``'s view (plan phase, cached): local lengths, indptrs and index tensors."""
        check_int("rank", rank, min_value=0)
        if rank >= self.cp_size:
            raise ValueError(f"rank must be < cp_size={self.cp_size}, got rank={rank}")
        key = ("local", rank)
        if key not in self._cache:
            self._cache[key] = _build_local(self, rank)
        return self._cache[key]


def _build_restore(split: CPSplit) -> torch.Tensor:
    b, cp, m = split._blocks, split.cp_size, split.max_local_tokens
    if split.boundaries is None:
        return invert_gather(split.gather_index, split.num_local_tokens, m, split.total_tokens)
    # natural row t of segment j (rank r, block k) sits at gathered row r * m + (t - shift[r, i, k])
    rows = (np.arange(cp, dtype=np.int64) * m)[:, None, None] - b.shift  # [cp, num_reqs, 2]
    shift = np.empty((split.num_reqs, 2 * cp), dtype=np.int64)
    shift[:, :cp] = rows[:, :, 0].T
    shift[:, cp:] = rows[::-1, :, 1].T
    lens = split.boundaries.numpy()
    lens = lens[:, 1:] - lens[:, :-1]
    return expand_blocks(shift.ravel(), lens.ravel(), split.total_tokens, split.device)


def _build_gather(split: CPSplit) -> torch.Tensor:
    b, cp, m = split._blocks, split.cp_size, split.max_local_tokens
    totals = np.asarray(split.num_local_tokens, dtype=np.int64)
    # gathered row g = r * m + q; one padding block closes each rank's part
    shift = np.concatenate(
        [(b.shift - b.slope * m * np.arange(cp)[:, None, None]).reshape(cp, -1), np.zeros((cp, 1), np.int64)], 1
    )
    lens = np.concatenate([b.lens.reshape(cp, -1), (m - totals)[:, None]], axis=1)
    out = expand_blocks(shift.ravel(), lens.ravel(), cp * m, split.device, b.slope)
    for r in range(cp):
        out[r * m + int(totals[r]) : (r + 1) * m] = -1
    return out


def _build_local(split: CPSplit, rank: int) -> LocalSplit:
    cp, num_reqs, dev, b = split.cp_size, split.num_reqs, split.device, split._blocks
    prefix = np.asarray(split.prefix_lens, dtype=np.int64).reshape(num_reqs)
    ext_start = np.asarray(split.extend_indptr[:-1], dtype=np.int64).reshape(num_reqs)
    counts, starts = split._counts[:, rank], split._starts[:, rank]
    if split.boundaries is not None:
        bounds = split.boundaries.numpy()
        prev = bounds[:, rank + 1] - bounds[:, rank]
        nxt = bounds[:, 2 * cp - rank] - bounds[:, 2 * cp - 1 - rank]
        kv_prev = prefix + bounds[:, rank + 1]
        kv_next = prefix + bounds[:, 2 * cp - rank]
    else:
        prev, nxt = counts, np.zeros_like(counts)
        first = _rr_first_offset(ext_start, cp)[:, rank]
        kv_prev = kv_next = prefix + np.where(counts > 0, first + cp * (counts - 1) + 1, 0)
    n = int(split.num_local_tokens[rank])
    shift, lens = b.shift[rank], b.lens[rank].ravel()
    cu_prev, cu_next = indptr_of(prev), indptr_of(nxt)
    return LocalSplit(
        rank=rank,
        num_reqs=num_reqs,
        num_tokens=n,
        actual_seq_q_prev=tuple(prev.tolist()),
        actual_seq_q_next=tuple(nxt.tolist()),
        kv_len_prev=tuple(kv_prev.tolist()),
        kv_len_next=tuple(kv_next.tolist()),
        token_index=expand_blocks(shift.ravel(), lens, n, dev, b.slope),
        positions=expand_blocks((shift + (prefix - ext_start)[:, None]).ravel(), lens, n, dev, b.slope),
        req_idx=expand_blocks(np.arange(num_reqs, dtype=np.int64), counts, n, dev, slope=0),
        cu_seqlens_q=small_tensor(indptr_of(counts), dev, np.int32),
        cu_seqlens_q_prev=small_tensor(cu_prev, dev, np.int32),
        cu_seqlens_q_next=small_tensor(cu_next, dev, np.int32),
        prev_index=expand_blocks(starts - cu_prev[:-1], prev, int(cu_prev[-1]), dev),
        next_index=expand_blocks(starts + prev - cu_next[:-1], nxt, int(cu_next[-1]), dev),
        actual_seq_q_prev_tensor=small_tensor(prev, dev, np.int32),
        actual_seq_q_next_tensor=small_tensor(nxt, dev, np.int32),
        kv_len_prev_tensor=small_tensor(kv_prev, dev, np.int32),
        kv_len_next_tensor=small_tensor(kv_next, dev, np.int32),
    )


def plan_cp_split(
    prefix_lens: Sequence[int] | torch.Tensor,
    extend_lens: Sequence[int] | torch.Tensor,
    *,
    cp_size: int,
    page_size: int,
    mode: SplitMode = "zigzag",
    page_aligned: bool = True,
    device: torch.device | str | None = None,
) -> CPSplit:
    """Split each request's extend across ``cp_size`` ranks (plan phase: host work, no device sync).

    The rules (token-balanced and page-aligned zigzag, fallback, round_robin, ``extend_len == 0``) are stated
    in :mod:`dtkv.split`.

    Args:
        prefix_lens: per request, tokens already in the KV pool: ints or an integer tensor ``[num_reqs]``.
        extend_lens: per request, tokens computed now: same form and length; 0 is allowed (the request then
            has no tokens and is not page-aligned).
        cp_size: ranks of the CP group (>= 1).
        page_size: tokens per KV page (>= 1).
        mode: ``"zigzag"`` (2cp segments; rank r computes segments r and 2cp-1-r) or ``"round_robin"``
            (row ``t`` of the batch's concatenated extends -> rank ``t % cp``; never page-aligned).
        page_aligned: zigzag only: put the internal boundaries on page edges for requests touching >= 2cp
            pages. Ignored by round_robin.
        device: where the per-token index tensors are built (default CPU).

    Returns:
        A frozen :class:`CPSplit`.

    Raises:
        TypeError: non-integer lengths, ``cp_size``, ``page_size``, or a non-bool ``page_aligned``.
        ValueError: negative lengths, ``cp_size``/``page_size`` < 1, lengths of different sizes, unknown mode, or
            a KV length ``prefix_len + extend_len`` or batch size ``sum(extend_lens)`` above ``2**31 - 1`` (the
            split's length tensors are int32, like the kernels that read them; rejected rather than wrapped).

    Example:
        >>> s = plan_cp_split([5], [23], cp_size=2, page_size=4)
        >>> s.boundaries.tolist(), s.all_page_aligned
        ([[0, 7, 11, 19, 23]], True)
        >>> s.local(0).actual_seq_q_prev, s.local(0).actual_seq_q_next, s.local(0).kv_len_next
        ((7,), (4,), (28,))
    """
    check_int("cp_size", cp_size, min_value=1)
    check_int("page_size", page_size, min_value=1)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got mode={mode!r}")
    if not isinstance(page_aligned, bool):
        raise TypeError(f"page_aligned must be a bool, got page_aligned={page_aligned!r}")
    prefix = _as_lengths("prefix_lens", prefix_lens)
    extend = _as_lengths("extend_lens", extend_lens)
    if prefix.size != extend.size:
        raise ValueError(
            "prefix_lens and extend_lens must have one entry per request, got "
            f"len(prefix_lens)={prefix.size} and len(extend_lens)={extend.size}"
        )
    _check_int32_lengths(prefix, extend)
    cp, num_reqs = cp_size, int(extend.size)
    ext_indptr = indptr_of(extend)
    ext_start = ext_indptr[:-1]
    shift = np.empty((cp, num_reqs, 2 if mode == "zigzag" else 1), dtype=np.int64)
    if mode == "zigzag":
        bounds, aligned = _zigzag_boundaries(prefix, extend, cp, page_size, page_aligned)
        seg = bounds[:, 1:] - bounds[:, :-1]  # [num_reqs, 2cp]
        prev, nxt = seg[:, :cp], seg[:, : cp - 1 : -1]  # segment r, segment 2cp-1-r
        counts = prev + nxt
        starts = np.cumsum(counts, axis=0)
        starts -= counts
        seg_start = bounds[:, :-1] + ext_start[:, None]  # natural row of each segment's first token
        np.subtract(seg_start[:, :cp], starts, out=shift[:, :, 0].T)
        np.subtract(seg_start[:, : cp - 1 : -1], starts + prev, out=shift[:, :, 1].T)
        lens = np.stack([prev.T, nxt.T], axis=2)
        blocks = _Blocks(shift=shift, lens=lens, slope=1)
    else:
        bounds, aligned = None, np.zeros(num_reqs, dtype=bool)
        first = _rr_first_offset(ext_start, cp)  # [num_reqs, cp]: rank r's first extend offset
        counts = (extend[:, None] - first + cp - 1) // cp  # offsets o < extend_len with o == first (mod cp)
        starts = np.cumsum(counts, axis=0)
        starts -= counts
        shift[:, :, 0] = (ext_start[:, None] + first - cp * starts).T
        blocks = _Blocks(shift=shift, lens=counts.T[:, :, None], slope=cp)
    totals = counts.sum(axis=0)
    return CPSplit(
        cp_size=cp,
        page_size=page_size,
        mode=mode,
        num_reqs=num_reqs,
        prefix_lens=tuple(prefix.tolist()),
        extend_lens=tuple(extend.tolist()),
        extend_indptr=tuple(ext_indptr.tolist()),
        boundaries=None if bounds is None else torch.from_numpy(bounds),
        page_aligned=torch.from_numpy(aligned),
        all_page_aligned=bool(num_reqs) and bool(aligned.all()),
        total_tokens=int(ext_indptr[-1]),
        num_local_tokens=tuple(totals.tolist()),
        max_local_tokens=int(totals.max()) if num_reqs else 0,
        device=torch.device("cpu") if device is None else torch.device(device),
        _counts=counts,
        _starts=starts,
        _blocks=blocks,
    )
