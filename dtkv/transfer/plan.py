"""``plan_request`` and its :class:`PlanOptions`: how a plan is chosen (what it is: :mod:`dtkv.transfer.descriptors`).

For each (prefill rank, decode rank, buffer) it picks one of four shapes -- direct page runs, or a staging region
packed on the source, the destination or both -- by pricing entries (``PlanOptions.entry_cost_s``) against
local copies (``PlanOptions.copy_bytes_per_s``) within the staging capacity left, in a fixed order so that every
prefill rank computes the same plan. Entries are cut into *layer groups* (:func:`layer_bounds`) sent one
after the other, so that staging copies of one group overlap the transfer of another. Vectorized numpy; no loop
over pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from dtkv._util import cdiv
from dtkv.ownership import PageOwnership
from dtkv.transfer.coalesce import coalesce_entries, expand_runs, page_runs
from dtkv.transfer.descriptors import (
    BufferSpec,
    PeerEntries,
    RankEndpoint,
    RequestPlan,
    SenderPlan,
    StageCopy,
    as_pages,
    check_compatible,
)

__all__ = ["PlanOptions", "check_pages", "disable_staging", "layer_bounds", "plan_request"]

Staging = Literal["auto", "off", "full"]
_STAGING = ("auto", "off", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """How :func:`plan_request` trades entries against local staging copies."""

    staging: Staging = "auto"
    """``"auto"``: stage a side when ``entries * entry_cost_s`` saved exceeds the copy time; ``"off"``: never;
    ``"full"``: stage both sides whenever capacity allows (minimum entries), else as ``"auto"``."""
    entry_cost_s: float = 30e-6
    """Cost of one engine entry (measured 25-40 us on Mooncake 0.3.13 TCP loopback)."""
    copy_bytes_per_s: float = 10e9
    """Local copy bandwidth used to price a staging pack or unpack."""
    meta_sender: int = 0
    """The one prefill rank that sends the replicated metadata row."""
    layer_groups: int = 4
    """Pipeline depth: entries are cut into this many layer groups (at most one per layer), sent one after the
    other, so that staging copies of one group (pack on prefill, unpack on decode) overlap the transfer of
    another. ``1``: one group, the fewest entries. Costs one entry per group where a single one would do; a
    plan that stages nothing uses one group."""

    def __post_init__(self) -> None:
        if isinstance(self.layer_groups, bool) or not isinstance(self.layer_groups, int) or self.layer_groups < 1:
            raise ValueError(f"layer_groups must be an int >= 1, got layer_groups={self.layer_groups!r}")
        if self.staging not in _STAGING:
            raise ValueError(f"staging must be one of {_STAGING}, got staging={self.staging!r}")
        if not self.entry_cost_s >= 0:
            raise ValueError(f"entry_cost_s must be >= 0, got entry_cost_s={self.entry_cost_s}")
        if not self.copy_bytes_per_s > 0:
            raise ValueError(f"copy_bytes_per_s must be > 0, got copy_bytes_per_s={self.copy_bytes_per_s}")


def layer_bounds(num_layers: int, num_groups: int) -> np.ndarray:
    """Layer boundaries of ``min(num_groups, num_layers)`` near-equal layer groups: int64 ``[groups + 1]``."""
    groups = max(1, min(num_groups, num_layers))
    return np.array([g * num_layers // groups for g in range(groups + 1)], dtype=np.int64)


def _map(ownership: PageOwnership, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.from_numpy(pages)
    return ownership.owner(t).numpy(), ownership.local_index(t).numpy()


def check_pages(name: str, pages: np.ndarray, ownership: PageOwnership) -> None:
    """Raise ``ValueError`` unless ``pages`` are distinct logical pages of ``ownership``'s pool."""
    if pages.size == 0:
        return
    bad = (pages < 0) | (pages >= ownership.num_pages)
    if bad.any():
        raise ValueError(
            f"{name} must hold logical pages in [0, {ownership.num_pages}), got {name} containing {int(pages[bad][0])}"
        )
    if np.unique(pages).size != pages.size:
        vals, counts = np.unique(pages, return_counts=True)
        raise ValueError(f"{name} must not repeat a page, got page {int(vals[counts > 1][0])} more than once")


def _align(n: int, buf: BufferSpec) -> int:
    """Start of a staging region at or after byte ``n``: 8-byte aligned for pages of whole words (fast copies),
    else aligned to the element size."""
    align = 8 if buf.page_bytes % 8 == 0 else buf.elem_bytes
    return cdiv(n, align) * align


def plan_request(
    src_pages: object,
    dst_pages: object,
    *,
    prefill: Sequence[RankEndpoint],
    decode: Sequence[RankEndpoint],
    options: PlanOptions | None = None,
    src_meta_slot: int | None = None,
    dst_meta_slot: int | None = None,
) -> RequestPlan:
    """Plan the transfer of one request from every prefill rank to every decode rank (host-side, pure).

    Args:
        src_pages: int ``[num_positions]``: the request's logical pages in the prefill pool, in token order.
        dst_pages: int ``[num_positions]``: the logical pages reserved for it in the decode pool.
        prefill: every prefill rank's endpoint, rank order.
        decode: every decode rank's endpoint, rank order (``staging_bytes=0`` disables decode staging).
        options: staging policy and the metadata sender (default :class:`PlanOptions`).
        src_meta_slot: metadata row to send from ``options.meta_sender``'s rows; ``None`` sends none.
        dst_meta_slot: row that receives it on every decode rank (given together with ``src_meta_slot``).

    Returns:
        The :class:`RequestPlan`; ``plan.senders[r]`` is what prefill rank ``r`` executes.

    Raises:
        ValueError: page lists of different lengths, pages out of range or repeated, inconsistent endpoints.
    """
    opts = options or PlanOptions()
    check_compatible(prefill, decode)
    src = as_pages("src_pages", src_pages)
    dst = as_pages("dst_pages", dst_pages)
    if src.shape != dst.shape:
        raise ValueError(f"src_pages and dst_pages must have equal lengths, got {src.shape[0]} and {dst.shape[0]}")
    own_p, own_d = prefill[0].ownership, decode[0].ownership
    check_pages("src_pages", src, own_p)
    check_pages("dst_pages", dst, own_d)
    meta = _check_meta(prefill, decode, opts, src_meta_slot, dst_meta_slot)
    src_owner, src_local = _map(own_p, src)
    dst_owner, dst_local = _map(own_d, dst)
    num_layers = prefill[0].num_layers
    bounds = layer_bounds(num_layers, opts.layer_groups)
    num_groups = int(bounds.shape[0]) - 1
    group_of_layer = np.searchsorted(bounds, np.arange(num_layers), side="right") - 1
    names = [b.name for b in prefill[0].buffers]
    positions = np.arange(src.shape[0], dtype=np.int64)
    src_used = [0] * len(prefill)
    dst_used = [0] * len(decode)
    senders, min_entries, staged = [], 0, 0
    for ep_p in prefill:
        r = ep_p.rank
        mine = positions[src_owner == r]
        peers, pack, unpack = [], [], {}
        for ep_d in decode:
            d = ep_d.rank
            sel = mine[dst_owner[mine] == d]
            k = int(sel.shape[0])
            parts = []
            for name in names:
                if k == 0:
                    break
                bs, bd = ep_p.buffer(name), ep_d.buffer(name)
                nbytes = num_layers * k * bs.page_bytes
                src_off, dst_off = _align(src_used[r], bs), _align(dst_used[d], bs)
                mode, rel = _choose(
                    src_local[sel], dst_local[sel], bs, bd, group_of_layer, opts,
                    src_off + nbytes <= ep_p.staging_bytes, dst_off + nbytes <= ep_d.staging_bytes,
                )  # fmt: skip
                src_base, dst_base = bs.addr, bd.addr
                if mode[0]:
                    pack.append(StageCopy(name=name, offset=src_off, local_pages=src_local[sel]))
                    src_base = ep_p.staging_addr + src_off
                    src_used[r] = src_off + nbytes
                    staged += nbytes
                if mode[1]:
                    copy = StageCopy(name=name, offset=dst_off, local_pages=dst_local[sel])
                    unpack.setdefault(d, []).append(copy)
                    dst_base = ep_d.staging_addr + dst_off
                    dst_used[d] = dst_off + nbytes
                    staged += nbytes
                parts.append((rel[0] + src_base, rel[1] + dst_base, rel[2], rel[3]))
            has_meta = meta is not None and r == opts.meta_sender
            if has_meta:
                row = ep_p.meta_row_bytes
                parts.append(
                    (
                        np.array([ep_p.meta_addr + src_meta_slot * row], dtype=np.int64),
                        np.array([ep_d.meta_addr + dst_meta_slot * row], dtype=np.int64),
                        np.array([row], dtype=np.int64),
                        np.array([num_groups - 1], dtype=np.int64),
                    )
                )
                min_entries += 1
            if not parts:
                continue
            min_entries += 1 if k else 0
            s, t, n, g = coalesce_entries(*(np.concatenate(x) for x in zip(*parts)))
            peers.append(
                PeerEntries(
                    decode_rank=d,
                    session=ep_d.session,
                    src=s,
                    dst=t,
                    length=n,
                    positions=sel,
                    dst_pages=dst[sel],
                    meta=has_meta,
                    group_indptr=np.searchsorted(g, np.arange(num_groups + 1)).astype(np.int64),
                )
            )
        senders.append(
            SenderPlan(
                rank=r,
                positions=mine,
                peers=tuple(peers),
                pack=tuple(pack),
                unpack={d: tuple(c) for d, c in unpack.items()},
            )
        )
    if staged == 0 and num_groups > 1:  # no copy to overlap: one layer group, the fewest entries and calls
        return plan_request(
            src,
            dst,
            prefill=prefill,
            decode=decode,
            options=replace(opts, layer_groups=1),
            src_meta_slot=src_meta_slot,
            dst_meta_slot=dst_meta_slot,
        )
    return RequestPlan(
        num_positions=int(src.shape[0]),
        senders=tuple(senders),
        min_entries=min_entries,
        staged_bytes=staged,
        layer_bounds=bounds,
    )


def _check_meta(prefill, decode, opts, src_slot, dst_slot) -> bool | None:
    if (src_slot is None) != (dst_slot is None):
        raise ValueError(
            f"src_meta_slot and dst_meta_slot must be given together, got src_meta_slot={src_slot}, "
            f"dst_meta_slot={dst_slot}"
        )
    if src_slot is None:
        return None
    if not 0 <= opts.meta_sender < len(prefill):
        raise ValueError(f"meta_sender must be a prefill rank in [0, {len(prefill)}), got {opts.meta_sender}")
    sender = prefill[opts.meta_sender]
    for ep, slot, what in [(sender, src_slot, "src_meta_slot")] + [(ep, dst_slot, "dst_meta_slot") for ep in decode]:
        if ep.meta_num_rows == 0:
            raise ValueError(f"{what} needs metadata rows on {ep.role} rank {ep.rank}, which registered none")
        if not 0 <= slot < ep.meta_num_rows:
            raise ValueError(f"{what} must be in [0, {ep.meta_num_rows}), got {what}={slot}")
        if ep.meta_row_bytes != sender.meta_row_bytes:
            raise ValueError(
                f"meta_row_bytes must match, got {sender.meta_row_bytes} (prefill {sender.rank}) and "
                f"{ep.meta_row_bytes} ({ep.role} {ep.rank})"
            )
    return True


def _choose(s_loc, d_loc, bs, bd, group_of_layer, opts, fits_src, fits_dst):
    """Pick (src staged, dst staged) for one (sender, receiver, buffer) triple; entries relative to bases,
    with the layer group of each.

    A staging region is layer-major (``[num_layers, k, *page_shape]``) whatever the pool's layout; a range that
    covers every layer (page-major on both sides, neither staged) is filed under group 0: it needs no staging copy,
    so its group only orders it."""
    k = int(s_loc.shape[0])
    num_layers = int(group_of_layer.shape[0])
    nbytes = num_layers * k * bs.page_bytes
    modes = [(False, False)]
    if opts.staging != "off":
        modes += [
            m for m in ((True, False), (False, True), (True, True)) if (fits_src or not m[0]) and (fits_dst or not m[1])
        ]
    if opts.staging == "full" and (True, True) in modes:
        modes = [(True, True)]
    best = None
    staged_idx = np.arange(k, dtype=np.int64)
    for m in modes:
        a, a_rows = (staged_idx, k) if m[0] else (s_loc, bs.num_local_pages)
        b, b_rows = (staged_idx, k) if m[1] else (d_loc, bd.num_local_pages)
        src, dst, length, layer = expand_runs(
            page_runs(a, b), num_layers=num_layers, page_bytes=bs.page_bytes, src_rows=a_rows, dst_rows=b_rows,
            src_page_major=bs.page_major and not m[0], dst_page_major=bd.page_major and not m[1],
        )  # fmt: skip
        rel = coalesce_entries(src, dst, length, group_of_layer[layer])
        cost = rel[0].shape[0] * opts.entry_cost_s + (m[0] + m[1]) * nbytes / opts.copy_bytes_per_s
        if best is None or cost < best[0]:
            best = (cost, m, rel)
    return best[1], best[2]


def disable_staging(endpoints: Sequence[RankEndpoint]) -> list[RankEndpoint]:
    """Copies of ``endpoints`` with staging turned off (a receiver whose staging is busy)."""
    return [replace(ep, staging_bytes=0) for ep in endpoints]
