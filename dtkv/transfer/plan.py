"""``plan_request``: the planner behind the descriptors (conventions in :mod:`dtkv.transfer.descriptors`).

For each (prefill rank, decode rank, buffer) it picks one of four shapes -- direct page runs, or a staging region
packed on the source, the destination or both -- by pricing entries (``PlanOptions.entry_cost_s``) against
local copies (``PlanOptions.copy_bytes_per_s``) within the staging capacity left, in a fixed order so that every
prefill rank computes the same plan. Vectorized numpy; no loop over pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from dtkv.ownership import PageOwnership
from dtkv.transfer.coalesce import coalesce_entries, expand_layers, layer_bounds, page_runs
from dtkv.transfer.descriptors import (
    BufferSpec,
    PeerEntries,
    PlanOptions,
    RankEndpoint,
    RequestPlan,
    SenderPlan,
    StageCopy,
    as_pages,
    check_compatible,
)

__all__ = ["disable_staging", "plan_request"]


def _map(ownership: PageOwnership, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.from_numpy(pages)
    return ownership.owner(t).numpy(), ownership.local_index(t).numpy()


def _check_range(name: str, pages: np.ndarray, ownership: PageOwnership) -> None:
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
    return -(-n // align) * align


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
    _check_range("src_pages", src, own_p)
    _check_range("dst_pages", dst, own_d)
    meta = _check_meta(prefill, decode, opts, src_meta_slot, dst_meta_slot)
    src_owner, src_local = _map(own_p, src)
    dst_owner, dst_local = _map(own_d, dst)
    num_layers = prefill[0].num_layers
    bounds = layer_bounds(num_layers, opts.layer_chunks)
    num_chunks = int(bounds.shape[0]) - 1
    chunk_of_layer = np.searchsorted(bounds, np.arange(num_layers), side="right") - 1
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
                    src_local[sel], dst_local[sel], bs, bd, chunk_of_layer, opts,
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
                        np.array([num_chunks - 1], dtype=np.int64),
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
                    chunk_indptr=np.searchsorted(g, np.arange(num_chunks + 1)).astype(np.int64),
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
    if staged == 0 and num_chunks > 1:  # no copy to overlap: one layer group, the fewest entries and calls
        return plan_request(
            src,
            dst,
            prefill=prefill,
            decode=decode,
            options=replace(opts, layer_chunks=1),
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


def _choose(s_loc, d_loc, bs, bd, chunk_of_layer, opts, fits_src, fits_dst):
    """Pick (src staged, dst staged) for one (sender, receiver, buffer) triple; entries relative to bases,
    with the layer group of each."""
    k = int(s_loc.shape[0])
    num_layers = int(chunk_of_layer.shape[0])
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
        runs = page_runs(a, b)
        expanded = expand_layers(
            runs, num_layers=num_layers, page_bytes=bs.page_bytes, src_rows=a_rows, dst_rows=b_rows
        )
        rel = coalesce_entries(*expanded, np.repeat(chunk_of_layer, runs[0].shape[0]))
        cost = rel[0].shape[0] * opts.entry_cost_s + (m[0] + m[1]) * nbytes / opts.copy_bytes_per_s
        if best is None or cost < best[0]:
            best = (cost, m, rel)
    return best[1], best[2]


def disable_staging(endpoints: Sequence[RankEndpoint]) -> list[RankEndpoint]:
    """Copies of ``endpoints`` with staging turned off (a receiver whose staging is busy)."""
    return [replace(ep, staging_bytes=0) for ep in endpoints]
