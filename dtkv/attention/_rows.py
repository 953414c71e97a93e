"""A layer's pages as the rows a kernel indexes, without copying pages that are not one run of rows.

A layer of a page-major pool (:class:`dtkv.ShardedKVPool` ``page_major=True``) is ``[P, S, row]`` with its pages
``num_layers`` pages apart: ``kv.reshape(-1, row)`` would copy every page of the layer on every call.
:func:`page_rows` gives instead a row view of the pages' storage from the first page's first row through the last
page's last row (the other layers' rows in between are never indexed) and the indices moved onto it: slot
``p * S + t`` becomes row ``p * step + t`` with ``step`` the pages' distance in rows.

Legend: ``P`` pages, ``S`` rows a page (page size), ``row`` a row's elements, ``N x W`` indices.
"""

from __future__ import annotations

import math

import torch

__all__ = ["page_rows"]


def page_rows(kv: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv`` ``[P, *page, row]`` (each page contiguous, any page stride) and slot ``indices`` (int, ``[N, W]``,
    ``-1`` or past the ``P * S`` slots: none) as ``(rows [T, row], indices)`` that address the same rows.

    Pages one run of rows apart (a layer-major pool, a view): ``kv`` flattened and the indices as they are. Pages
    further apart by a whole number of rows: a strided row view of their storage (no copy) and the slots moved
    onto it, ``-1`` for every slot that was none. Anything else: ``kv.reshape(-1, row)`` (a copy) and the
    indices as they are.
    """
    row = kv.shape[-1]
    per_page = math.prod(kv.shape[1:-1])
    num_pages = kv.shape[0]
    inner_contiguous = kv[0].is_contiguous() if num_pages else True
    if num_pages <= 1 or not inner_contiguous or kv.stride(0) % row or kv.stride(0) == per_page * row:
        return kv.reshape(-1, row), indices
    step = kv.stride(0) // row
    rows = torch.as_strided(kv, ((num_pages - 1) * step + per_page, row), (row, 1))
    slots = num_pages * per_page
    page, offset = indices.div(per_page, rounding_mode="floor"), indices.remainder(per_page)
    moved = torch.where((indices >= 0) & (indices < slots), page * step + offset, torch.full_like(indices, -1))
    return rows, moved
