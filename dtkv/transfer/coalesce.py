"""Entry coalescing: page runs contiguous on both sides, byte ranges per pool layout, byte-range merging, batching.

An *entry* is one ``(src address, dst address, length)`` triple handed to the transfer engine; on Mooncake's TCP
transport each costs tens of microseconds whatever its size, so the planner makes as few as it can:

1. :func:`page_runs` pairs up source and destination page indices and cuts maximal runs contiguous on both sides
   (sorted by source index, which makes the runs maximal for the given pairs).
2. :func:`expand_runs` turns runs into byte ranges of the two sides' buffers: per layer between layer-major
   buffers ``[num_layers, rows, page_bytes]`` (:func:`expand_layers`), one per run covering every layer between
   page-major buffers ``[rows, num_layers, page_bytes]``, one per page and layer between a layer-major and a
   page-major buffer.
3. :func:`coalesce_entries` merges byte ranges contiguous on both sides (across layers and buffers as well).
4. :func:`split_batches` cuts a peer's entries into calls of at most ``max_entries`` (the 0.3.13 TCP limit).

All functions are vectorized numpy over int64 arrays; none loops over pages in Python.
"""

from __future__ import annotations

import numpy as np

__all__ = ["coalesce_entries", "expand_layers", "expand_runs", "page_runs", "split_batches"]

_EMPTY = np.zeros(0, dtype=np.int64)


def page_runs(src_idx: np.ndarray, dst_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of page pairs contiguous on both sides.

    Args:
        src_idx: int64 ``[k]``, distinct source page indices.
        dst_idx: int64 ``[k]``, the destination index of each source page.

    Returns:
        ``(src_start, dst_start, num_pages)``, each int64 ``[num_runs]``: run ``j`` copies source pages
        ``src_start[j] + t`` to destination pages ``dst_start[j] + t`` for ``0 <= t < num_pages[j]``.
    """
    k = int(src_idx.shape[0])
    if k == 0:
        return _EMPTY, _EMPTY, _EMPTY
    order = np.argsort(src_idx, kind="stable")
    s = src_idx[order]
    d = dst_idx[order]
    starts = np.concatenate(([0], np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1))
    lengths = np.diff(np.concatenate((starts, [k])))
    return s[starts], d[starts], lengths.astype(np.int64)


def expand_layers(
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    num_layers: int,
    page_bytes: int,
    src_rows: int,
    dst_rows: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges of page runs in every layer of ``[num_layers, rows, page_bytes]`` buffers (offsets from 0).

    Layer ``l``, page ``j`` of a side with ``rows`` pages per layer starts at byte ``(l * rows + j) * page_bytes``.

    Returns:
        ``(src_offset, dst_offset, length)``, int64 ``[num_layers * num_runs]``, layer-major (entry ``i`` is in
        layer ``i // num_runs``).
    """
    s0, d0, n = runs
    layer = np.arange(num_layers, dtype=np.int64)[:, None]
    src = ((layer * src_rows + s0[None, :]) * page_bytes).ravel()
    dst = ((layer * dst_rows + d0[None, :]) * page_bytes).ravel()
    length = np.broadcast_to(n[None, :] * page_bytes, (num_layers, n.shape[0])).ravel()
    return src, dst, np.ascontiguousarray(length)


def expand_runs(
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    num_layers: int,
    page_bytes: int,
    src_rows: int,
    dst_rows: int,
    src_page_major: bool = False,
    dst_page_major: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges of page runs between two buffers of either layout (offsets from each buffer's start).

    Layer ``l``, page ``j`` starts at byte ``(l * rows + j) * page_bytes`` of a layer-major side
    ``[num_layers, rows, page_bytes]`` and at byte ``(j * num_layers + l) * page_bytes`` of a page-major side
    ``[rows, num_layers, page_bytes]``. The ranges are those contiguous on both sides by construction:

    - both layer-major: one per run and layer, ``n * page_bytes`` (:func:`expand_layers`);
    - both page-major: one per run, ``n * num_layers * page_bytes``, covering every layer;
    - one of each: one per page and layer, ``page_bytes``.

    :func:`coalesce_entries` then merges what continues on both sides anyway (whole rows of a layer-major side,
    one-layer page-major sides, ...).

    Returns:
        ``(src_offset, dst_offset, length, layer)``, int64 ``[num_entries]``; ``layer`` is the first layer of each
        range (0 for a range covering every layer).
    """
    s0, d0, n = runs
    if not src_page_major and not dst_page_major:
        src, dst, length = expand_layers(
            runs, num_layers=num_layers, page_bytes=page_bytes, src_rows=src_rows, dst_rows=dst_rows
        )
        return src, dst, length, np.repeat(np.arange(num_layers, dtype=np.int64), s0.shape[0])
    if src_page_major and dst_page_major:
        span = num_layers * page_bytes
        return s0 * span, d0 * span, n * span, np.zeros(s0.shape[0], dtype=np.int64)
    # mixed: every page of every run, then every layer of it
    k = int(n.sum())
    within = np.arange(k, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    s, d = np.repeat(s0, n) + within, np.repeat(d0, n) + within
    layer = np.arange(num_layers, dtype=np.int64)[:, None]

    def at(pages: np.ndarray, rows: int, page_major: bool) -> np.ndarray:
        return ((pages[None, :] * num_layers + layer) if page_major else (layer * rows + pages[None, :])) * page_bytes

    src = at(s, src_rows, src_page_major).ravel()
    dst = at(d, dst_rows, dst_page_major).ravel()
    return src, dst, np.full(src.shape[0], page_bytes, dtype=np.int64), np.repeat(layer[:, 0], k)


def coalesce_entries(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, group: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Merge entries whose byte ranges continue each other on both sides; sorted by (group, source address).

    Entry ``b`` extends entry ``a`` when ``src[a] + length[a] == src[b]`` and ``dst[a] + length[a] == dst[b]``
    (and both have the same ``group``, e.g. the layer group). Zero-length entries are dropped.

    Returns:
        ``(src, dst, length)``, plus the ``group`` of each merged entry when ``group`` is given.
    """
    keep = length > 0
    src, dst, length = src[keep], dst[keep], length[keep]
    grp = np.zeros(src.shape[0], dtype=np.int64) if group is None else group[keep]
    if src.shape[0] > 1:
        order = np.lexsort((dst, src, grp))
        src, dst, length, grp = src[order], dst[order], length[order], grp[order]
        cont = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:]) & (grp[:-1] == grp[1:])
        starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
        src, dst, grp, length = src[starts], dst[starts], grp[starts], np.add.reduceat(length, starts)
    out = (src.astype(np.int64), dst.astype(np.int64), length.astype(np.int64))
    return out if group is None else (*out, grp.astype(np.int64))


def split_batches(num_entries: int, max_entries: int) -> list[slice]:
    """Slices of at most ``max_entries`` covering ``range(num_entries)`` (no slice when there is nothing)."""
    if max_entries < 1:
        raise ValueError(f"max_entries must be >= 1, got max_entries={max_entries}")
    return [slice(i, min(i + max_entries, num_entries)) for i in range(0, num_entries, max_entries)]
