"""Plan phase of a :class:`dtkv.decode.DecodeStep`: one padded int32 plan per step, copied to the device in one copy.

Legend: ``B`` queries of the bucket (one per request; padding rows decode nothing), ``M`` page slots per request,
``L`` pages one query scores, ``V`` pages one rank sends to a full view, ``S`` page size.

The step's kernels read only these tensors (views of one int32 buffer), so a CUDA graph captured once replays any
plan that fits the bucket: new positions, new pages, a new batch, a new top-k. Fields:

================  ============  ===================================================================================
field             shape         meaning
================  ============  ===================================================================================
``new_locs``      ``[B]``       logical token location of each query's new row (written by its page's owner), -1
``query_pos``     ``[B]``       position of the query (keys after it are masked); -1: a padding row
``page_ids``      ``[B, L]``    pages the query scores, as rows of the pages it reads (this rank's pool, or the
                                full view); -1 padding
``page_slots``    ``[B, L]``    each one's page slot in its request (position // S); -1 padding
``page_map``      ``[B * M]``   (request, slot) -> row of the pages attention reads, -1 where not there: what turns
                                a selected position into the kernel's token slot
``send_idx``      ``[V]``       full view only: this rank's local pages of the batch, in view order; -1 padding
================  ============  ===================================================================================

Every check is computed from what every rank holds (the page tables, the lengths, the ownership), so a plan that
does not fit raises on every rank together, before any collective.

Modes: ``sharded`` (and ``replicated``, a pool every rank holds whole: ``cp_size`` 1) score the rank's own pages;
``full_view`` scores every page of the view, whose rows are rank ``c``'s send list at ``[c * V, (c + 1) * V)``.

**Row by row** (:class:`RowCache`, ``sharded`` and ``replicated``): a decode step's requests keep their pages from
one step to the next and gain one every ``S`` tokens, so a plan whose rows carry an identity (``keys``: the
runtime's request ids) rebuilds only the rows whose request or page count changed (through
:func:`build_bucket_plan` over those rows, checked alike) and writes every row's position and new location: host
work in the rows that changed, not in the batch's pages (a 16 x 128K-token batch holds 32K of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtkv._checks import check_int
from dtkv.decode.plan import _page_table, plan_decode
from dtkv.decode.topk import MAX_POSITION
from dtkv.ownership import PageOwnership

__all__ = ["BucketLayout", "RowCache", "build_bucket_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketLayout:
    """Capacities of one bucket and the offsets of each field in the int32 plan buffer."""

    batch: int
    """``B``: query rows."""
    max_pages: int
    """``M``: page slots per request."""
    scored_pages: int
    """``L``: pages one query scores."""
    send_pages: int
    """``V``: pages one rank sends to a full view (0 outside full view)."""

    @property
    def sizes(self) -> dict[str, int]:
        b, m, ll = self.batch, self.max_pages, self.scored_pages
        return {"new_locs": b, "query_pos": b, "page_ids": b * ll, "page_slots": b * ll, "page_map": b * m,
                "send_idx": self.send_pages}  # fmt: skip

    @property
    def numel(self) -> int:
        return sum(self.sizes.values())

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields as views of ``buf`` (int32 ``[numel]``)."""
        out, off = {}, 0
        for name, n in self.sizes.items():
            out[name] = buf[off : off + n]
            off += n
        b, ll = self.batch, self.scored_pages
        out["page_ids"] = out["page_ids"].view(b, ll)
        out["page_slots"] = out["page_slots"].view(b, ll)
        return out


def _fit(name: str, got: int, cap: int, what: str) -> None:
    if got > cap:
        raise ValueError(f"{name} must be <= {cap} (the step's {what}), got {got}: use a larger bucket")


def _fit_every_rank(table: torch.Tensor, need: list[int], ownership: PageOwnership, cap: int) -> None:
    """Every rank's largest per-request page count against the bucket, computed on every rank from the same tables:
    a step too large for one rank raises on all of them (none is left waiting in a collective)."""
    if not need:
        return
    width = max(need)
    used = torch.arange(width)[None, :] < torch.tensor(need, dtype=torch.int64)[:, None]
    owners = torch.where(
        used, ownership.owner(table[:, :width].clamp(min=0)), torch.full_like(used, -1, dtype=torch.int64)
    )
    counts = torch.stack([(owners == r).sum(1) for r in range(ownership.cp_size)])  # [C, n]
    worst = int(counts.max())
    if worst > cap:
        r, b = divmod(int(counts.argmax()), counts.shape[1])
        raise ValueError(
            f"request {b} keeps {worst} pages on rank {r}, more than the step's scored_pages={cap}: use a larger "
            "bucket (scored_pages)"
        )


def build_bucket_plan(
    layout: BucketLayout,
    mode: str,
    page_tables: Sequence[Sequence[int]] | torch.Tensor,
    seq_lens: Sequence[int],
    ownership: PageOwnership,
    rank: int,
    *,
    page_size: int,
    topk: int,
) -> torch.Tensor:
    """The padded int32 plan of one step (host; checks every request like :func:`dtkv.decode.plan_decode`).

    Args:
        layout: the bucket.
        mode: ``"sharded"``, ``"replicated"`` or ``"full_view"`` (a full view of a group of one is the pool: plan it
            as ``"sharded"``).
        page_tables, seq_lens: as :func:`dtkv.decode.plan_decode` (``seq_lens`` count the token being decoded).
        ownership, rank: the pool's page map and this rank.

    Returns:
        int32 ``[layout.numel]`` (CPU).

    Raises:
        ValueError / TypeError: what :func:`plan_decode` rejects, or a plan larger than the bucket (naming it).
    """
    n = len(seq_lens)
    _fit("len(seq_lens)", n, layout.batch, "batch bucket")
    plan = plan_decode(page_tables, seq_lens, ownership, rank, page_size=page_size, topk=topk)
    table = _page_table(page_tables)
    need = [-(-int(x) // page_size) for x in seq_lens]
    _fit("the longest request's pages", max(need, default=0), layout.max_pages, "max_pages")
    buf = torch.full((layout.numel,), -1, dtype=torch.int32)
    f = layout.views(buf)
    f["new_locs"][:n] = plan.new_locs.to(torch.int32)
    f["query_pos"][:n] = plan.query_pos.to(torch.int32)
    m = layout.max_pages
    pmap = f["page_map"].view(layout.batch, m)
    if mode != "full_view":
        _fit_every_rank(table, need, ownership, layout.scored_pages)
        width = int((plan.owned_slots >= 0).sum(1).max()) if n else 0
        f["page_ids"][:n, :width] = plan.owned_local_pages[:, :width].to(torch.int32)
        f["page_slots"][:n, :width] = plan.owned_slots[:, :width].to(torch.int32)
        cols = min(plan.slot_local_page.shape[1], m)
        pmap[:n, :cols] = plan.slot_local_page[:, :cols].to(torch.int32)
        return buf
    # full view: every page of the batch; rank c's pages fill view rows [c * V, c * V + count_c)
    v = layout.send_pages
    width = max(need, default=0)
    _fit("the longest request's pages", width, layout.scored_pages, "scored_pages")
    used = torch.arange(width)[None, :] < torch.tensor(need, dtype=torch.int64)[:, None]
    pages = table[:n, :width][used]
    uniq, inv = torch.unique(pages, return_inverse=True)
    owners = ownership.owner(uniq)
    order = torch.argsort(owners, stable=True)
    counts = torch.bincount(owners, minlength=ownership.cp_size)
    starts = torch.cumsum(counts, 0) - counts
    within = torch.empty_like(order)
    within[order] = torch.arange(order.numel()) - starts[owners[order]]
    if counts.numel() and int(counts.max()) > v:
        c = int(counts.argmax())
        _fit(f"the batch's pages on rank {c}", int(counts[c]), v, "send_pages")
    rows = (owners * v + within).to(torch.int32)
    f["page_ids"][:n, :width][used] = rows[inv]
    f["page_slots"][:n, :width][used] = torch.arange(width, dtype=torch.int32).expand(n, width)[used]
    pmap[:n, :width][used] = rows[inv]
    mine = uniq[owners == rank]
    f["send_idx"][: mine.numel()] = ownership.local_index(mine).to(torch.int32)
    return buf


class RowCache:
    """The plan image of a bucket, kept between steps and rebuilt row by row (see the module docstring)."""

    def __init__(self, layout: BucketLayout, mode: str) -> None:
        if mode not in ("sharded", "replicated"):
            raise ValueError(f"mode must be 'sharded' or 'replicated' (row by row), got mode={mode!r}")
        self.layout, self.mode = layout, mode
        self.image = torch.full((layout.numel,), -1, dtype=torch.int32)
        self.fields = layout.views(self.image)
        self._rows: list[tuple | None] = [None] * layout.batch
        self.rebuilt = 0
        """Rows rebuilt by the last :meth:`update` (the others kept their page fields)."""

    def update(
        self,
        page_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        keys: Sequence[object],
        ownership: PageOwnership,
        rank: int,
        *,
        page_size: int,
        topk: int,
    ) -> torch.Tensor:
        """The plan of this step (int32 ``[layout.numel]``, the cache's own image: copy it before the next call).

        Row ``b`` keeps its page fields when ``keys[b]``, its page count, its last page and the pages its length
        needs equal those of the row the last call built there (a request's pages only grow between decode steps);
        it is rebuilt otherwise.

        Raises:
            ValueError / TypeError: as :func:`build_bucket_plan` (rows rebuilt), a length that its pages do not
            cover or that exceeds the key format, a step larger than the bucket; the image is then rebuilt whole at
            the next call.
        """
        lay, f, ps = self.layout, self.fields, page_size
        n = len(seq_lens)
        _fit("len(seq_lens)", n, lay.batch, "batch bucket")
        if len(page_tables) != n or len(keys) != n:
            raise ValueError(
                f"page_tables, seq_lens and keys must have one entry per request, got {len(page_tables)}, {n} and "
                f"{len(keys)}"
            )
        try:
            lens = [check_int(f"seq_lens[{b}]", x, min_value=1) for b, x in enumerate(seq_lens)]
            ident = [(keys[b], len(page_tables[b]), page_tables[b][-1] if len(page_tables[b]) else -1,
                      -(-lens[b] // ps)) for b in range(n)]  # fmt: skip
            changed = [b for b in range(n) if self._rows[b] != ident[b]]
            for b, x in enumerate(lens):
                if x - 1 > MAX_POSITION:
                    raise ValueError(
                        f"seq_lens[{b}] must be <= {MAX_POSITION + 1} (positions travel in 32 bits), got {x}"
                    )
                if -(-x // ps) > len(page_tables[b]):
                    raise ValueError(
                        f"page_tables[{b}] must hold ceil(seq_lens[{b}] / page_size) = {-(-x // ps)} pages for "
                        f"seq_lens[{b}]={x}, got {len(page_tables[b])}"
                    )
            pmap = f["page_map"].view(lay.batch, lay.max_pages)
            if changed:
                sub_layout = BucketLayout(batch=len(changed), max_pages=lay.max_pages, scored_pages=lay.scored_pages,
                                          send_pages=0)  # fmt: skip
                sub = build_bucket_plan(
                    sub_layout, self.mode, [page_tables[b] for b in changed], [lens[b] for b in changed], ownership,
                    rank, page_size=ps, topk=topk,
                )  # fmt: skip
                sf = sub_layout.views(sub)
                idx = torch.tensor(changed, dtype=torch.int64)
                f["page_ids"][idx] = sf["page_ids"]
                f["page_slots"][idx] = sf["page_slots"]
                pmap[idx] = sf["page_map"].view(len(changed), lay.max_pages)
            for b in range(n, lay.batch):  # rows no request holds now: padding
                if self._rows[b] is not None:
                    f["page_ids"][b] = -1
                    f["page_slots"][b] = -1
                    pmap[b] = -1
        except BaseException:
            self._rows = [None] * lay.batch
            raise
        for b in changed:
            self._rows[b] = ident[b]
        for b in range(n, lay.batch):
            self._rows[b] = None
        pos = [x - 1 for x in lens]
        f["query_pos"][:n] = torch.tensor(pos, dtype=torch.int32)
        f["new_locs"][:n] = torch.tensor(
            [page_tables[b][p // ps] * ps + p % ps for b, p in enumerate(pos)], dtype=torch.int32
        )
        f["query_pos"][n:] = -1
        f["new_locs"][n:] = -1
        self.rebuilt = len(changed)
        return self.image
