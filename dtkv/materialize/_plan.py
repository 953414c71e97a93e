"""The materialization plan of one batch (host side) and its cross-rank agreement."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dtkv._agree import agree
from dtkv._collectives import cpu_channel
from dtkv._scratch import scratch_bytes as scratch_bytes  # light home: dtkv.capacity imports no kernels
from dtkv._util import as_int_array, unique_in_order
from dtkv.ops import PackPlan, plan_pack
from dtkv.ownership import OwnershipSpec, PageOwnership, ownership_spec

__all__ = ["MaterializeError", "MaterializePlan", "agree_plan", "plan_materialize", "scratch_bytes"]


class MaterializeError(RuntimeError):
    """A full view cannot be (or was not) assembled correctly.

    Raised on every rank of the CP group together: when the ranks' plans differ or one rank's planning failed
    (:func:`plan_materialize` with ``group``, or the first collective use of a plan), and by the ``DTKV_DEBUG``
    check when a view differs from the owners' bytes.
    """


@dataclass(frozen=True, kw_only=True, eq=False)
class MaterializePlan:
    """Host-built description of one batch's full view on one rank (tensors live on the pool's device).

    Attributes:
        ownership, rank: the pool's page map and this rank.
        spec: ``ownership`` as plain ints (what compiled code passes to the ops; every torch version traces it).
        history, current: the :class:`dtkv.ops.PackPlan` of each page group (owner-major send lists).
        pages: int64 ``[k]`` every logical page the batch reads (history first), unique.
        page_map: int32 ``[num_pages]`` logical page -> view row; ``-1`` for pages the batch does not read.
        write_pages: int64 ``[w]`` pages the caller writes into the view itself (``write_current=True``), else empty.
        history_slice, current_slice: the first local page of a run of ``rows_per_rank`` pool pages that holds this
            rank's send rows in order (the send buffer is then a slice of the pool: no pack), or ``None``.
        digest: 16 bytes naming the plan's page lists and ownership, identical on every rank of a valid batch.
    """

    ownership: PageOwnership
    rank: int
    spec: OwnershipSpec
    history: PackPlan
    current: PackPlan
    pages: torch.Tensor
    page_map: torch.Tensor
    write_pages: torch.Tensor
    history_slice: int | None
    current_slice: int | None
    digest: bytes

    @property
    def num_history_rows(self) -> int:
        return self.history.num_gathered_rows

    @property
    def num_view_pages(self) -> int:
        return self.history.num_gathered_rows + self.current.num_gathered_rows

    @property
    def history_rows_per_rank(self) -> int:
        """Send rows of every rank for the history group (0: the group is empty, nothing is gathered)."""
        return self.history.num_gathered_rows // self.ownership.cp_size

    @property
    def current_rows_per_rank(self) -> int:
        """Send rows of every rank for the current group (0: the group is empty, nothing is gathered)."""
        return self.current.num_gathered_rows // self.ownership.cp_size

    @property
    def scratch_pages(self) -> int:
        """Pages of scratch one layer needs on this rank: the view plus both send buffers."""
        return self.num_view_pages + self.history_rows_per_rank + self.current_rows_per_rank

    @property
    def agreed(self) -> bool:
        """True once the plan's digest was checked across the CP group (see :func:`agree_plan`)."""
        return bool(getattr(self, "_agreed", False))


def _check_rank(rank: object, cp_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got rank={rank!r} ({type(rank).__name__})")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size={cp_size}), got rank={rank}")
    return rank


def _slice_start(send_row: torch.Tensor, count: int, rows_per_rank: int, num_local_pages: int) -> int | None:
    """First local page of a pool run that can stand in for the send buffer (rows past ``count`` are padding)."""
    if rows_per_rank == 0:
        return None
    start = int(send_row[0]) if count else 0
    if start + rows_per_rank > num_local_pages:
        return None
    if count and not torch.equal(send_row[:count], torch.arange(start, start + count)):
        return None
    return start


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host-device synchronization: a pageable ``.to("cuda")`` waits for
    every kernel queued on the stream, which in chunked prefill stalls the next step's planning behind the current
    step; a copy from pinned memory does not."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _digest(ownership: PageOwnership, h: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> bytes:
    d = hashlib.blake2b(digest_size=16)
    d.update(f"{ownership.cp_size},{ownership.num_pages},{ownership.scheme};".encode())
    for t in (h, c, w):
        d.update(t.numel().to_bytes(8, "little"))
        d.update(t.numpy().tobytes())
    return d.digest()


def _build(
    history_pages, current_pages, ownership: PageOwnership, rank: int, device, write_current: bool
) -> MaterializePlan:
    if not isinstance(ownership, PageOwnership):
        raise TypeError(f"ownership must be a dtkv.PageOwnership, got {type(ownership).__name__}")
    _check_rank(rank, ownership.cp_size)
    h = torch.from_numpy(as_int_array("history_pages", history_pages, ndim=None))  # floats/bools refused
    c = torch.from_numpy(as_int_array("current_pages", current_pages, ndim=None))
    ownership.check_pages("history_pages", h)
    ownership.check_pages("current_pages", c)
    c = unique_in_order(c[c >= 0])
    h = unique_in_order(h[h >= 0])
    h = h[~torch.isin(h, c)]
    w = torch.zeros(0, dtype=torch.int64)
    if write_current:  # current pages travel with the history; the caller writes this step's rows into the view
        h, w, c = torch.cat((h, c)), c, c[:0]
    hist, cur = plan_pack(h, ownership, device="cpu"), plan_pack(c, ownership, device="cpu")
    slices = []
    for gp in (hist, cur):
        m = gp.num_gathered_rows // ownership.cp_size
        slices.append(_slice_start(gp.send_local_idx[rank], gp.counts[rank], m, ownership.num_local_pages(rank)))
    page_map = torch.where(cur.page_map >= 0, cur.page_map + hist.num_gathered_rows, hist.page_map)
    dev = torch.device(device)

    def to_dev(gp: PackPlan) -> PackPlan:
        return replace(gp, send_local_idx=_to_device(gp.send_local_idx, dev), page_map=_to_device(gp.page_map, dev),
                       rows=_to_device(gp.rows, dev))  # fmt: skip

    return MaterializePlan(
        ownership=ownership,
        rank=rank,
        spec=ownership_spec(ownership),
        history=to_dev(hist),
        current=to_dev(cur),
        pages=_to_device(torch.cat((h, c)), dev),
        page_map=_to_device(page_map, dev),
        write_pages=_to_device(w, dev),
        history_slice=slices[0],
        current_slice=slices[1],
        digest=_digest(ownership, h, c, w),
    )


def plan_materialize(
    history_pages: torch.Tensor | Sequence[int],
    current_pages: torch.Tensor | Sequence[int],
    ownership: PageOwnership,
    rank: int,
    *,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    write_current: bool = False,
) -> MaterializePlan:
    """Plan the full view of a batch (plan phase: host work; not for compiled code).

    Args:
        history_pages: logical pages read but not written this step (prefetchable); ``-1``/repeats dropped.
        current_pages: logical pages written this step; a page in both groups counts as current.
        ownership: the pool's page map.
        rank: this rank, in ``[0, ownership.cp_size)``.
        device: where the plan's tensors live (the pool's device).
        group: the CP group. When given, the call is collective (:func:`dtkv._agree.agree` on a CPU channel, so
            it never waits for the GPU; per batch: hashing the page lists, 8 bytes per page, and one 48-byte
            all-gather per rank when the ranks agree): a rank's invalid input raises that error on every rank, and
            plans that differ raise :class:`MaterializeError` on every rank -- instead of a collective hanging or
            aborting later. Without it the check runs at the plan's first collective use (:class:`Materializer`,
            eager :func:`gather_view`).
        write_current: the caller writes this step's rows into the view itself (every rank holds them, e.g. after
            the all-gather of an owner-filtered write). Current pages are then gathered with the history, a layer
            ahead (their earlier tokens come from the owners), nothing is gathered after the writes, and the
            caller writes the step's rows at ``dtkv.ops.remap(locs, plan.page_map, page_size=S)`` once
            :meth:`Materializer.view` returned.

    Raises:
        TypeError / ValueError: ``rank`` is not in ``[0, cp_size)``, a page is not an int (floats and bools are
            refused, never truncated) or is outside ``[0, num_pages)`` -- with
            ``group``, on every rank, naming the failing ranks (:func:`dtkv._agree.agree`).
        MaterializeError: (with ``group``) on every rank, when the plans differ, naming the first differing size
            (or the digest) and each rank's value.
    """
    if group is None:
        return _build(history_pages, current_pages, ownership, rank, device, write_current)
    plan, error = None, None
    try:
        plan = _build(history_pages, current_pages, ownership, rank, device, write_current)
        if dist.get_world_size(group) != ownership.cp_size:
            raise ValueError(
                f"ownership.cp_size must equal the group size, got cp_size={ownership.cp_size}, "
                f"group size={dist.get_world_size(group)}"
            )
        if rank != dist.get_rank(group):
            raise ValueError(f"rank must be this process's rank in group ({dist.get_rank(group)}), got rank={rank}")
    except (TypeError, ValueError) as e:
        error = e
    _agree_plan(plan, group, error)
    return plan


def _summary(plan: MaterializePlan | None) -> dict[str, object] | None:
    """What the ranks compare: sizes first (they name the difference best), then the digest of the page lists."""
    if plan is None:
        return None
    return {
        "history_pages": int(plan.history.rows.numel()),
        "current_pages": int(plan.current.rows.numel()),
        "pages_written_by_caller": int(plan.write_pages.numel()),
        "rows_per_rank": [plan.history_rows_per_rank, plan.current_rows_per_rank],
        "~digest": plan.digest.hex(),
    }


def _agree_plan(plan: MaterializePlan | None, group: dist.ProcessGroup, error: Exception | None) -> None:
    """Fail together (:func:`dtkv._agree.agree`) on the CPU channel of ``group``; marks the plan agreed."""
    agree(error, cpu_channel(group), what="materialization plan", value=_summary(plan), mismatch_error=MaterializeError)
    object.__setattr__(plan, "_agreed", True)


def agree_plan(plan: MaterializePlan, group: dist.ProcessGroup | None) -> None:
    """Check once (collectively) that every rank of ``group`` holds a plan with the same page lists.

    A no-op for a plan already agreed, and without a group. Called by :class:`Materializer` and eager
    :func:`gather_view`; every rank must reach it.

    Raises:
        MaterializeError: on every rank, when the plans differ.
    """
    if plan.agreed or group is None or dist.get_world_size(group) == 1:
        return
    _agree_plan(plan, group, None)
