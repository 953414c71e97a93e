"""Materialization scratch arithmetic, on plain ints: importable without kernels (:mod:`dtkv.capacity` uses it).

:func:`scratch_bytes` is exported by :mod:`dtkv.materialize`, whose :class:`~dtkv.materialize.Materializer`
allocates that scratch.
"""

from __future__ import annotations

from collections.abc import Mapping

from dtkv._util import cdiv
from dtkv.layouts import KVLayout, total_page_bytes

__all__ = ["scratch_bytes"]


def scratch_bytes(
    layouts: Mapping[str, KVLayout], *, max_pages: int, cp: int, prefetch: bool = True, slack_pages: int | None = None
) -> int:
    """Bytes of materialization scratch on one rank for batches reading up to ``max_pages`` pages.

    Per layout: the view (``cp * M`` pages) plus the send buffers (``M`` pages), with
    ``M = ceil(max_pages / cp) + slack_pages`` (owner-balanced allocation keeps per-rank counts within about a
    page per request; the default slack is ``cp`` pages). Doubled when ``prefetch`` keeps two layers live. An
    upper bound: send buffers are not allocated where the pool's pages already sit in send order.
    """
    slack = cp if slack_pages is None else slack_pages
    m = cdiv(max_pages, cp) + slack
    per_layer = (cp * m + m) * total_page_bytes(layouts)
    return per_layer * (2 if prefetch else 1)
