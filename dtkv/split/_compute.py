"""Compute owners of KV pages under a CP split, and the direct-write check (plan phase, host).

A request's pages are given as a dense page table ``req_pages`` ``[num_reqs, max_pages]`` (``-1`` padded, any
integer dtype): slot ``s`` of request ``i`` holds the logical page of absolute positions
``[s * page_size, (s + 1) * page_size)`` (format in :mod:`dtkv.page_table`). The slots an extend *touches* are
``prefix_len // page_size`` up to ``ceil((prefix_len + extend_len) / page_size)``; terms are defined in
:mod:`dtkv.split`.
"""

from __future__ import annotations

import numpy as np
import torch

from dtkv._checks import check_int, check_tensor
from dtkv._env import debug_enabled
from dtkv._util import cdiv
from dtkv.ownership import PageOwnership
from dtkv.split._plan import CPSplit, _rr_first_offset

__all__ = [
    "MULTIPLE_COMPUTE_OWNERS",
    "NO_COMPUTE_OWNER",
    "compute_owners",
    "compute_pages",
    "handoff_pages",
    "local_locs",
    "verify_direct_write",
]

NO_COMPUTE_OWNER = -1
""":func:`compute_owners` value of a slot holding no extend token (prefix-only or past the end)."""
MULTIPLE_COMPUTE_OWNERS = -2
""":func:`compute_owners` value of a slot whose extend tokens are computed by more than one rank."""

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _slot_extents(split: CPSplit) -> tuple[np.ndarray, np.ndarray]:
    """Per request, first touched slot and end slot (exclusive), int64 ``[num_reqs]`` each (empty if 0 tokens)."""
    ps = split.page_size
    prefix = np.asarray(split.prefix_lens, dtype=np.int64).reshape(split.num_reqs)
    extend = np.asarray(split.extend_lens, dtype=np.int64).reshape(split.num_reqs)
    first = prefix // ps
    end = np.where(extend > 0, cdiv(prefix + extend, ps), first)
    return first, end


def _slot_rank_counts(split: CPSplit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every touched slot as ``(request, slot)`` and the extend tokens each rank computes in it.

    Returns ``req`` int64 ``[num_slots]``, ``slot`` int64 ``[num_slots]`` (request by request, in slot order)
    and ``counts`` int64 ``[num_slots, cp]``. Cached on the split.
    """
    if "slots" in split._cache:
        return split._cache["slots"]
    cp, ps, num_reqs = split.cp_size, split.page_size, split.num_reqs
    prefix = np.asarray(split.prefix_lens, dtype=np.int64).reshape(num_reqs)
    extend = np.asarray(split.extend_lens, dtype=np.int64).reshape(num_reqs)
    first, end = _slot_extents(split)
    touched = end - first
    req = np.repeat(np.arange(num_reqs, dtype=np.int64), touched)
    slot = np.arange(req.size, dtype=np.int64) + np.repeat(first - (np.cumsum(touched) - touched), touched)
    lo = np.maximum(slot * ps - prefix[req], 0)[:, None]  # extend offsets [lo, hi) of the slot
    hi = np.minimum((slot + 1) * ps - prefix[req], extend[req])[:, None]
    if split.boundaries is not None:
        bounds = split.boundaries.numpy()[req]  # [num_slots, 2cp+1]
        per_seg = np.maximum(np.minimum(hi, bounds[:, 1:]) - np.maximum(lo, bounds[:, :-1]), 0)
        counts = per_seg[:, :cp] + per_seg[:, ::-1][:, :cp]
    else:
        first = _rr_first_offset(np.asarray(split.extend_indptr[:-1], dtype=np.int64), cp)[req]  # [num_slots, cp]
        counts = (hi - first + cp - 1) // cp - (lo - first + cp - 1) // cp  # offsets == first (mod cp) in [lo, hi)
    out = (req, slot, counts)
    split._cache["slots"] = out
    return out


def compute_owners(split: CPSplit, max_pages: int | None = None) -> torch.Tensor:
    """The rank computing each page slot of each request (plan phase).

    Args:
        split: the plan.
        max_pages: width of the result; default the largest ``ceil((prefix_len + extend_len) / page_size)``.

    Returns:
        int64 CPU ``[num_reqs, max_pages]``: the compute owner of the slot's extend tokens,
        :data:`NO_COMPUTE_OWNER` (-1) for slots without extend tokens, :data:`MULTIPLE_COMPUTE_OWNERS` (-2)
        where several ranks compute tokens of the slot. A page-aligned request has no -2 slot.

    Raises:
        ValueError: ``max_pages`` is smaller than a request's touched slots.
    """
    first, end = _slot_extents(split)
    need = int(end.max()) if split.num_reqs else 0
    if max_pages is None:
        max_pages = need
    check_int("max_pages", max_pages, min_value=0)
    if max_pages < need:
        i = int(np.argmax(end))
        raise ValueError(
            f"max_pages must cover every touched slot, got max_pages={max_pages} but request {i} touches slots "
            f"up to {need - 1} (prefix_len={split.prefix_lens[i]}, extend_len={split.extend_lens[i]}, "
            f"page_size={split.page_size})"
        )
    req, slot, counts = _slot_rank_counts(split)
    computes = counts > 0
    owner = np.where(computes.sum(axis=1) == 1, computes.argmax(axis=1), MULTIPLE_COMPUTE_OWNERS)
    out = np.full((split.num_reqs, max_pages), NO_COMPUTE_OWNER, dtype=np.int64)
    out[req, slot] = owner
    return torch.from_numpy(out)


def _host_table(split: CPSplit, name: str, req_pages: object) -> np.ndarray:
    """Validated host copy (int64 numpy ``[num_reqs, max_pages]``) of a page table covering every touched slot."""
    t = check_tensor(name, req_pages, dtype=_INTEGER_DTYPES, ndim=2)
    if t.shape[0] != split.num_reqs:
        raise ValueError(
            f"{name} must have one row per request ([num_reqs={split.num_reqs}, max_pages]), "
            f"got {name}.shape={list(t.shape)}"
        )
    table = t.detach().to("cpu", torch.int64).numpy()
    req, slot, _ = _slot_rank_counts(split)
    if slot.size and int(slot.max()) >= table.shape[1]:
        i = int(req[np.argmax(slot)])
        raise ValueError(
            f"{name} must have a column for every slot the extend touches, got {name}.shape={list(t.shape)} "
            f"but request {i} touches slot {int(slot.max())}"
        )
    bad = np.flatnonzero(table[req, slot] < 0)
    if bad.size:
        i, s = int(req[bad[0]]), int(slot[bad[0]])
        raise ValueError(
            f"{name} must hold a page for every slot the extend touches, got {name}[{i}, {s}]={int(table[i, s])}"
        )
    return table


def _check_rank(split: CPSplit, rank: int) -> None:
    check_int("rank", rank, min_value=0)
    if rank >= split.cp_size:
        raise ValueError(f"rank must be < cp_size={split.cp_size}, got rank={rank}")


def _check_req_idx(split: CPSplit, req_idx: int | None) -> None:
    if req_idx is not None:
        check_int("req_idx", req_idx, min_value=0)
        if req_idx >= split.num_reqs:
            raise ValueError(f"req_idx must be < num_reqs={split.num_reqs}, got req_idx={req_idx}")


def _check_ownership(split: CPSplit, ownership: object) -> PageOwnership:
    if not isinstance(ownership, PageOwnership):
        raise TypeError(f"ownership must be a PageOwnership, got {type(ownership).__name__}")
    if ownership.cp_size != split.cp_size:
        raise ValueError(f"ownership.cp_size must equal split.cp_size, got {ownership.cp_size} and {split.cp_size}")
    return ownership


def compute_pages(split: CPSplit, rank: int, req_pages: torch.Tensor, *, req_idx: int | None = None) -> torch.Tensor:
    """Logical pages ``rank`` computes (writes at least one extend token of), plan phase.

    Args:
        split: the plan.
        rank: the CP rank.
        req_pages: page table ``[num_reqs, max_pages]`` (integer, ``-1`` padded) covering every touched slot.
        req_idx: only this request (default: all, request by request).

    Returns:
        int64 CPU ``[k]`` in request then slot order. Without a page-aligned split a page may appear in the
        lists of several ranks.

    Raises:
        ValueError: a touched slot of ``req_pages`` is missing or ``-1``; bad ``rank``/``req_idx``.
    """
    _check_rank(split, rank)
    _check_req_idx(split, req_idx)
    table = _host_table(split, "req_pages", req_pages)
    req, slot, counts = _slot_rank_counts(split)
    keep = counts[:, rank] > 0
    if req_idx is not None:
        keep &= req == req_idx
    return torch.from_numpy(table[req[keep], slot[keep]])


def handoff_pages(
    split: CPSplit, rank: int, req_pages: torch.Tensor, ownership: PageOwnership, *, req_idx: int | None = None
) -> torch.Tensor:
    """Pages ``rank`` computes but does not store: their rows must reach the owner (owner-filtered write).

    For a page-aligned request allocated by :func:`dtkv.split.allocate_for_split` only the partly filled first
    page (prefix ending mid-page) can be one, unless ``rank`` was short of free pages (see there).

    Returns:
        int64 CPU ``[k]``, a sub-list of :func:`compute_pages` (same arguments).
    """
    _check_ownership(split, ownership)
    pages = compute_pages(split, rank, req_pages, req_idx=req_idx)
    return pages[ownership.owner(pages) != rank]


def verify_direct_write(
    split: CPSplit, rank: int, pages: torch.Tensor, ownership: PageOwnership, *, req_idx: int | None = None
) -> bool:
    """True only if ``rank`` may write its computed KV rows straight into its own pool (plan phase).

    That needs the request(s) to be page-aligned (one compute owner a page) and every page ``rank`` computes
    to be stored on ``rank``. A fallback, round_robin or ``page_aligned=False`` split is never verified, nor
    is a rank with a handoff page (:func:`handoff_pages`).

    Args:
        split: the plan.
        rank: the CP rank.
        pages: the page table ``req_pages`` ``[num_reqs, max_pages]`` covering every touched slot.
        ownership: the pool's page map (``cp_size`` must match the split's).
        req_idx: check one request only (default: the whole batch, ``split.all_page_aligned``).
    """
    _check_ownership(split, ownership)
    _check_req_idx(split, req_idx)
    aligned = split.all_page_aligned if req_idx is None else bool(split.page_aligned[req_idx])
    computed = compute_pages(split, rank, pages, req_idx=req_idx)
    if not aligned:
        return False
    return bool((ownership.owner(computed) == rank).all())


def local_locs(split: CPSplit, rank: int, req_pages: torch.Tensor) -> torch.Tensor:
    """Token location (``page * page_size + offset``) of each of ``rank``'s local rows (run phase).

    Combine with ``ownership.owner(locs // page_size) == rank`` to tell direct rows from handoff rows.
    Under ``DTKV_DEBUG`` the table is checked first (synchronizes).

    Args:
        req_pages: page table ``[num_reqs, max_pages]`` (integer) on any device.

    Returns:
        int64 ``[split.local(rank).num_tokens]`` on ``req_pages.device``, local order.
    """
    check_tensor("req_pages", req_pages, dtype=_INTEGER_DTYPES, ndim=2)
    if req_pages.shape[0] != split.num_reqs:
        raise ValueError(
            f"req_pages must have one row per request ([num_reqs={split.num_reqs}, max_pages]), "
            f"got req_pages.shape={list(req_pages.shape)}"
        )
    if debug_enabled():
        _host_table(split, "req_pages", req_pages)
    loc = split.local(rank)
    dev = req_pages.device
    pos = loc.positions.to(dev, non_blocking=True)
    req = loc.req_idx.to(dev, non_blocking=True)
    ps = split.page_size
    pages = req_pages.to(torch.int64)[req, pos // ps]
    return pages * ps + pos % ps
