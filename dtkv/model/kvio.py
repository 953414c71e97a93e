"""Deprecated (one release): :mod:`dtkv.runtime.kvio` moves every model's rows in and out of the pools.

:func:`write_rows` and :func:`token_rows` keep the reference model's 0.1 signatures.
"""

from __future__ import annotations

import torch

from dtkv._util import warn_deprecated
from dtkv.layouts import KVLayout
from dtkv.runtime import kvio

__all__ = ["token_rows", "write_rows"]


def write_rows(pool, layout: KVLayout, rows, locs, ownership, rank: int, *, direct=False, page_aligned=False) -> None:
    """Deprecated: :func:`dtkv.runtime.kvio.write_rows` (``direct=True`` needs ``page_aligned=True`` here)."""
    warn_deprecated("dtkv.model.kvio.write_rows", "dtkv.runtime.kvio.write_rows")
    if direct and not page_aligned:
        raise ValueError("direct=True needs page_aligned=True (compute-owner writes need a page-aligned split)")
    kvio.write_rows(pool, layout, rows, locs, ownership, rank, direct=direct)


def token_rows(view: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Deprecated: ``dtkv.runtime.kvio.read_rows(view, layout, torch.float64)``."""
    warn_deprecated("dtkv.model.kvio.token_rows", "dtkv.runtime.kvio.read_rows(view, layout, torch.float64)")
    return kvio.read_rows(view, layout, torch.float64)
