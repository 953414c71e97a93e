"""Rows in and out of the pools for every model: every stored byte goes through :mod:`dtkv.ops`.

- :func:`write_rows`: store rows at logical token locations, owner-filtered (``direct=False``: each rank keeps the
  rows of the pages it stores, whoever computed them) or as a compute-owner direct write (``direct=True``: this
  rank's own rows into its own pages, page-aligned split); fp8 layouts quantize on the way (fused ops).
- :func:`read_rows`: a full view (or a whole pool) ``[V, *page_shape]`` -> rows ``[V * page_size, C]`` in view-slot
  order, dequantized to a compute dtype: what attention reads through remapped indices.

``C`` is ``kv_lora_rank + rope_dim`` for MLA layouts (an indexer stored as bf16/fp32 rows is an
``MLALatentLayout`` with ``rope_dim=0``) and ``head_dim`` for :class:`dtkv.IndexerFp8Layout`.
"""

from __future__ import annotations

import torch

from dtkv import ops
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.ownership import OwnershipSpec, PageOwnership

__all__ = ["read_rows", "write_rows"]


def write_rows(
    pool: torch.Tensor,
    layout: KVLayout,
    rows: torch.Tensor,
    locs: torch.Tensor,
    ownership: PageOwnership | OwnershipSpec,
    rank: int,
    *,
    direct: bool = False,
) -> None:
    """Write ``rows`` ``[N, C]`` (any float dtype) at logical ``locs`` int64 ``[N]`` (``-1`` skipped) into ``pool``.

    ``direct=True`` is the compute-owner write of a page-aligned split (every location on a page ``rank`` stores;
    validated on the host in eager mode, see :func:`dtkv.ops.direct_write`).
    """
    if isinstance(layout, MLALatentLayout):
        rows = rows.to(layout.dtype)
        if direct:
            ops.direct_write(pool, rows, locs, ownership, rank)
        else:
            ops.write_owned(pool, rows, locs, ownership, rank)
    elif isinstance(layout, MLAFp8Layout):
        ops.quantize_write_mla_fp8(pool, rows, locs, ownership, rank, layout=layout, direct=direct)
    elif isinstance(layout, IndexerFp8Layout):
        ops.quantize_write_indexer_fp8(pool, rows, locs, ownership, rank, layout=layout, direct=direct)
    else:
        raise TypeError(f"layout must be an MLA or indexer layout, got {type(layout).__name__}")


def read_rows(view: torch.Tensor, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """Rows of every token slot of ``view`` ``[V, *layout.page_shape]``: ``[V * page_size, C]`` of ``dtype``."""
    ps = layout.page_size
    if isinstance(layout, MLALatentLayout):
        return view.reshape(view.shape[0] * ps, layout.row_dim).to(dtype)
    if isinstance(layout, MLAFp8Layout):
        return ops.dequantize_mla_fp8(view.reshape(view.shape[0] * ps, layout.row_bytes), layout).to(dtype)
    if isinstance(layout, IndexerFp8Layout):
        return ops.dequantize_indexer_pages(view, layout).reshape(view.shape[0] * ps, layout.head_dim).to(dtype)
    raise TypeError(f"layout must be an MLA or indexer layout, got {type(layout).__name__}")
