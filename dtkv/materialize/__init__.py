"""Full-view materialization: let unmodified attention kernels read a sharded pool.

For one batch the logical pages it reads are known on every rank, in two groups: *history* pages (entirely
before every request's prefix end: not written this step, so they can be gathered a layer ahead) and *current*
pages (touched by this step's writes, gathered after them). :func:`plan_materialize` (host, once per batch)
decides which owned pages each rank sends. Per layer each rank sends its pages of a group, padded to the
group's largest per-rank count (``rows_per_rank``), and the ranks all-gather them. The view is owner-major per
group::

    view rows [0, cp*Mh)                   history: row r*Mh + m = rank r's m-th history page
    view rows [cp*Mh, cp*Mh + cp*Mc)       current: row cp*Mh + r*Mc + m = rank r's m-th current page

so no reordering copy follows a collective; page tables, token locations and top-k indices are remapped into
view coordinates with ``plan.page_map`` (:func:`dtkv.ops.remap`). The page-table format is defined in
:mod:`dtkv.page_table`.

Entry points:

- :func:`plan_materialize` -> :class:`MaterializePlan` (plan; with ``group=`` the ranks check that they planned
  the same pages and fail together with :class:`MaterializeError` otherwise).
- :func:`gather_view` (run; functional collectives and registered ops, compiles with ``fullgraph=True``).
- :class:`Materializer` (run, eager): preallocated double-buffered views, the history gather of layer ``l + 1``
  in flight while layer ``l`` computes, a gather backend chosen by size and topology (all-gather, or the copy
  engines over NVLink through symmetric memory), no pack where the pool's pages already sit in send order, and
  :meth:`Materializer.capture` for CUDA graphs.
- :func:`scratch_bytes` (sizing) and :func:`check_view` (the synchronizing ``DTKV_DEBUG`` check).

Every path produces the same bytes in every row a page maps to.
"""

from __future__ import annotations

from dtkv.materialize._gather import COPY_ENGINE_MIN_BYTES, GatherBackend
from dtkv.materialize._materializer import Materializer
from dtkv.materialize._plan import MaterializeError, MaterializePlan, agree_plan, plan_materialize, scratch_bytes
from dtkv.materialize._views import check_view, gather_view

__all__ = [
    "COPY_ENGINE_MIN_BYTES",
    "GatherBackend",
    "MaterializeError",
    "MaterializePlan",
    "Materializer",
    "agree_plan",
    "check_view",
    "gather_view",
    "plan_materialize",
    "scratch_bytes",
]
