"""How the reference model moves KV rows in and out of pools: every byte goes through ``dtkv.ops``.

- :func:`write_rows`: store bf16 rows at logical token locations, owner-filtered (``direct=False``) or as a
  compute-owner direct write (``direct=True``), quantizing on the way for fp8 layouts.
- :func:`token_rows`: a full view (or a replicated pool) -> float64 rows ``[num_view_pages * page_size, C]``
  in view-token order, dequantized: what an attention kernel reads through a remapped page table.
"""

from __future__ import annotations

import torch

from dtkv import ops
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.ownership import OwnershipSpec, PageOwnership

__all__ = ["token_rows", "write_rows"]


def write_rows(
    pool: torch.Tensor,
    layout: KVLayout,
    rows: torch.Tensor,
    locs: torch.Tensor,
    ownership: PageOwnership | OwnershipSpec,
    rank: int,
    *,
    direct: bool = False,
    page_aligned: bool = False,
) -> None:
    """Write bf16 ``rows`` ``[n, C]`` at logical ``locs`` ``[n]`` (``-1`` skipped) into this rank's ``pool``."""
    if isinstance(layout, MLALatentLayout):
        rows = rows.to(layout.dtype)
        if direct:
            ops.direct_write(pool, rows, locs, ownership, rank, page_aligned=page_aligned)
        else:
            ops.write_owned(pool, rows, locs, ownership, rank)
    elif isinstance(layout, MLAFp8Layout):
        if direct and not page_aligned:
            raise ValueError("direct=True needs page_aligned=True (compute-owner writes need a page-aligned split)")
        ops.quantize_write_mla_fp8(pool, rows, locs, ownership, rank, layout=layout, direct=direct)
    elif isinstance(layout, IndexerFp8Layout):
        if direct and not page_aligned:
            raise ValueError("direct=True needs page_aligned=True (compute-owner writes need a page-aligned split)")
        ops.quantize_write_indexer_fp8(pool, rows, locs, ownership, rank, layout=layout, direct=direct)
    else:
        raise TypeError(f"layout must be an MLA or indexer layout, got {type(layout).__name__}")


def token_rows(view: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Dequantized float64 rows of every token slot of a view ``[V, *page_shape]``: ``[V * page_size, C]``."""
    ps = layout.page_size
    if isinstance(layout, MLALatentLayout):
        return view.reshape(-1, layout.row_dim).to(torch.float64)
    if isinstance(layout, MLAFp8Layout):
        return ops.dequantize_mla_fp8(view.reshape(-1, layout.row_bytes), layout).to(torch.float64)
    if isinstance(layout, IndexerFp8Layout):
        return ops.dequantize_indexer_pages(view, layout).reshape(view.shape[0] * ps, layout.head_dim).to(torch.float64)
    raise TypeError(f"layout must be an MLA or indexer layout, got {type(layout).__name__}")
