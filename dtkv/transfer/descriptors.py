"""Placement-aware page descriptors: which bytes each prefill CP rank writes where on decode.

Vocabulary (per request):

- *position* ``i``, ``0 <= i < num_positions``: the request's ``i``-th page (token ``t`` is at position
  ``t // page_size``; the last page may be partial and is sent whole).
- ``src_pages[i]``: the logical page of position ``i`` in the prefill pool, stored on prefill rank
  ``src_ownership.owner(src_pages[i])`` at local page ``src_ownership.local_index(src_pages[i])``.
- ``dst_pages[i]``: the logical page of position ``i`` in the decode pool, stored on decode rank
  ``dst_ownership.owner(dst_pages[i])`` (a non-CP decode is ``PageOwnership(1, num_pages)``).

Each position has one source and one destination, so it is sent exactly once, by its prefill owner, to its
decode owner, for every layer and every buffer (e.g. the MLA ``"kv"`` and the indexer ``"index"`` pools). A
buffer of ``[num_layers, num_local_pages, *page_shape]`` holds ``(layer l, local page j)`` at byte
``addr + (l * num_local_pages + j) * page_bytes`` (the :class:`dtkv.ShardedKVPool` layout).

Staging: for a (prefill rank, decode rank, buffer) triple the planner may pack the owned pages, in position
order, into a registered staging region ``[num_layers, k, *page_shape]`` on the source, the destination, or
both, when the entries saved pay for the local copies (:class:`PlanOptions`). With both sides staged a pair of
ranks needs a single entry, which is the minimum any plan can reach (:attr:`RequestPlan.min_entries`).

Replicated payloads (a per-request metadata row) have exactly one sender, ``PlanOptions.meta_sender``, which
writes the row to every decode rank.

:func:`plan_request` is a pure function of the request's page lists and the exchanged
:class:`RankEndpoint`\\ s: every prefill rank computes the same plan and executes its own
:class:`SenderPlan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

from dtkv.ownership import PageOwnership
from dtkv.transfer.coalesce import coalesce_entries, expand_layers, layer_bounds, page_runs

__all__ = [
    "BufferSpec",
    "PeerEntries",
    "PlanOptions",
    "RankEndpoint",
    "RequestPlan",
    "SenderPlan",
    "StageCopy",
    "as_pages",
    "check_compatible",
    "disable_staging",
    "plan_request",
]

Staging = Literal["auto", "off", "full"]
_STAGING = ("auto", "off", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferSpec:
    """One registered pool buffer ``[num_layers, num_local_pages, *page_shape]`` of one rank."""

    name: str
    """Buffer name (``"kv"``, ``"index"``, ...); equal names are paired across the two sides."""
    addr: int
    """Base address (``tensor.data_ptr()``)."""
    num_local_pages: int
    """Pages per layer stored on this rank."""
    page_bytes: int
    """Bytes of one page."""
    elem_bytes: int = 1
    """Element size of the buffer's dtype (staging regions start at a multiple of it)."""
    layout_key: str
    """Canonical description of the :class:`dtkv.KVLayout`; must match across every rank of both sides."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEndpoint:
    """What one rank publishes at bootstrap: transfer session, page map, buffers, staging and metadata rows."""

    role: Literal["prefill", "decode"]
    """Which side the rank is on."""
    rank: int
    """CP rank within its side."""
    session: str
    """Transfer-engine address of the process hosting this rank (Mooncake: ``"ip:rpc_port"``)."""
    ownership: PageOwnership
    """The page map of this side's pool (``cp_size`` = number of ranks of this side)."""
    num_layers: int
    """Layers stored in every buffer."""
    buffers: tuple[BufferSpec, ...]
    """The pool buffers, sorted by name."""
    staging_addr: int = 0
    """Base address of the registered staging buffer (0 when none)."""
    staging_bytes: int = 0
    """Capacity of the staging buffer in bytes (0 disables staging on this rank)."""
    meta_addr: int = 0
    """Base address of the registered metadata rows ``[meta_num_rows, meta_row_bytes]`` (0 when none)."""
    meta_row_bytes: int = 0
    """Bytes of one metadata row."""
    meta_num_rows: int = 0
    """Number of metadata rows (slots)."""

    def buffer(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"name must be one of {[b.name for b in self.buffers]}, got name={name!r}")


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
    layer_chunks: int = 1
    """Pipeline depth: entries are cut into this many layer groups, sent one after the other, so that staging
    copies of one group (pack on prefill, unpack on decode) overlap the transfer of another. ``1``: one group."""

    def __post_init__(self) -> None:
        if isinstance(self.layer_chunks, bool) or not isinstance(self.layer_chunks, int) or self.layer_chunks < 1:
            raise ValueError(f"layer_chunks must be an int >= 1, got layer_chunks={self.layer_chunks!r}")
        if self.staging not in _STAGING:
            raise ValueError(f"staging must be one of {_STAGING}, got staging={self.staging!r}")
        if not self.entry_cost_s >= 0:
            raise ValueError(f"entry_cost_s must be >= 0, got entry_cost_s={self.entry_cost_s}")
        if not self.copy_bytes_per_s > 0:
            raise ValueError(f"copy_bytes_per_s must be > 0, got copy_bytes_per_s={self.copy_bytes_per_s}")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StageCopy:
    """A local copy between a pool buffer and a staging region ``[num_layers, k, *page_shape]``.

    On prefill it packs ``buffer[:, local_pages]`` into the region; on decode it unpacks the region into
    ``buffer[:, local_pages]``. Pages are in position order.
    """

    name: str
    offset: int
    """Byte offset of the region in the staging buffer."""
    local_pages: np.ndarray
    """int64 ``[k]``: local page indices in the pool buffer."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PeerEntries:
    """Entries from one prefill rank to one decode rank, coalesced (int64 arrays ``[num_entries]``)."""

    decode_rank: int
    session: str
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    positions: np.ndarray
    """int64 ``[k]``: the request positions carried (ascending)."""
    dst_pages: np.ndarray
    """int64 ``[k]``: their decode logical pages (for error messages)."""
    meta: bool = False
    """Whether the entries include the replicated metadata row (in the last chunk)."""
    chunk_indptr: np.ndarray | None = None
    """int64 ``[num_chunks + 1]``: entries of layer group ``c`` are ``[chunk_indptr[c], chunk_indptr[c + 1])``
    (``None``: one group)."""

    @property
    def num_entries(self) -> int:
        return int(self.length.shape[0])

    def chunk(self, c: int | None) -> slice:
        """The entries of layer group ``c`` (all of them for ``None``)."""
        if c is None or self.chunk_indptr is None:
            return slice(0, self.num_entries)
        return slice(int(self.chunk_indptr[c]), int(self.chunk_indptr[c + 1]))

    @property
    def num_bytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SenderPlan:
    """One prefill rank's share of a request."""

    rank: int
    positions: np.ndarray
    """int64: positions this rank owns and sends, ascending (the explicit logical positions)."""
    peers: tuple[PeerEntries, ...]
    pack: tuple[StageCopy, ...]
    """Copies into this rank's staging buffer, done before any entry is sent."""
    unpack: dict[int, tuple[StageCopy, ...]] = field(default_factory=dict)
    """decode rank -> copies out of its staging buffer, done after every sender finished."""

    @property
    def num_entries(self) -> int:
        return sum(p.num_entries for p in self.peers)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.peers)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RequestPlan:
    """Every sender's plan for one request, plus the entry count any plan needs at least."""

    num_positions: int
    senders: tuple[SenderPlan, ...]
    min_entries: int
    """One entry per (prefill rank, decode rank) pair exchanging pages, plus one per metadata row sent."""
    staged_bytes: int
    """Bytes copied through staging regions (packs plus unpacks)."""
    layer_bounds: np.ndarray
    """int64 ``[num_chunks + 1]``: layer group ``c`` covers layers ``[layer_bounds[c], layer_bounds[c + 1])``."""

    @property
    def num_chunks(self) -> int:
        return int(self.layer_bounds.shape[0]) - 1

    @property
    def num_entries(self) -> int:
        return sum(s.num_entries for s in self.senders)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.senders)

    def unpack_for(self, decode_rank: int) -> list[StageCopy]:
        return [c for s in self.senders for c in s.unpack.get(decode_rank, ())]

    def summary(self) -> dict[str, int]:
        return {
            "positions": self.num_positions,
            "entries": self.num_entries,
            "min_entries": self.min_entries,
            "bytes": self.num_bytes,
            "staged_bytes": self.staged_bytes,
        }


def as_pages(name: str, pages: object) -> np.ndarray:
    """A 1-D int64 numpy copy of a page list (list, numpy array or integer tensor)."""
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {name}.dtype={pages.dtype}")
        arr = pages.detach().cpu().numpy()
    else:
        arr = np.asarray(pages)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {name}.shape={list(arr.shape)}")
    return arr.astype(np.int64, copy=True)


def check_compatible(prefill: Sequence[RankEndpoint], decode: Sequence[RankEndpoint]) -> None:
    """Raise ``ValueError`` unless the endpoints describe two consistent sides with matching buffers."""
    for role, eps in (("prefill", prefill), ("decode", decode)):
        if not eps:
            raise ValueError(f"{role} must list at least one RankEndpoint, got none")
        own = eps[0].ownership
        for r, ep in enumerate(eps):
            if ep.role != role or ep.rank != r:
                raise ValueError(f"{role}[{r}] must be the {role} endpoint of rank {r}, got {ep.role} rank {ep.rank}")
            if ep.ownership != own:
                raise ValueError(f"{role} ranks must share one ownership, got {own!r} and {ep.ownership!r} (rank {r})")
        if own.cp_size != len(eps):
            raise ValueError(f"{role} ownership.cp_size must equal its {len(eps)} endpoints, got {own.cp_size}")
    ref = prefill[0]
    ref_bufs = {b.name: b for b in ref.buffers}
    for ep in (*prefill, *decode):
        if ep.num_layers != ref.num_layers:
            raise ValueError(
                f"num_layers must match on every rank, got {ref.num_layers} (prefill 0) and "
                f"{ep.num_layers} ({ep.role} {ep.rank})"
            )
        bufs = {b.name: b for b in ep.buffers}
        if sorted(bufs) != sorted(ref_bufs):
            raise ValueError(
                f"buffer names must match on every rank, got {sorted(ref_bufs)} (prefill 0) and "
                f"{sorted(bufs)} ({ep.role} {ep.rank})"
            )
        for name, b in bufs.items():
            if b.layout_key != ref_bufs[name].layout_key:
                raise ValueError(
                    f"layout of buffer {name!r} must match on every rank, got {ref_bufs[name].layout_key} "
                    f"(prefill 0) and {b.layout_key} ({ep.role} {ep.rank})"
                )


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
