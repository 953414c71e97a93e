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
layer-major buffer ``[num_layers, num_local_pages, *page_shape]`` holds ``(layer l, local page j)`` at byte
``addr + (l * num_local_pages + j) * page_bytes``; a page-major one ``[num_local_pages, num_layers, *page_shape]``
(:attr:`BufferSpec.page_major`) at byte ``addr + (j * num_layers + l) * page_bytes`` (the two
:class:`dtkv.ShardedKVPool` layouts). A run of pages contiguous on both sides costs one entry per layer between
layer-major buffers, one entry for every layer between page-major buffers, and one per page and layer between a
layer-major and a page-major buffer (either side may use either layout).

Staging: for a (prefill rank, decode rank, buffer) triple the planner may pack the owned pages, in position
order, into a registered staging region ``[num_layers, k, *page_shape]`` (layer-major whatever the pool's
layout) on the source, the destination, or
both, when the entries saved pay for the local copies (:class:`PlanOptions`). With both sides staged a pair of
ranks needs a single entry, which is the minimum any plan can reach (:attr:`RequestPlan.min_entries`).

Replicated payloads (a per-request metadata row) have exactly one sender, ``PlanOptions.meta_sender``, which
writes the row to every decode rank.

:func:`dtkv.transfer.plan_request` (in :mod:`dtkv.transfer.plan`, with its :class:`dtkv.transfer.PlanOptions`) is
a pure function of the request's page lists and the exchanged :class:`RankEndpoint` s: every prefill rank computes
the same plan and executes its own :class:`SenderPlan`. The entry arithmetic (page runs, layer expansion, merging,
batching) is in :mod:`dtkv.transfer.coalesce`. This module holds only what a plan *is*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from dtkv._util import as_int_array
from dtkv.ownership import PageOwnership

__all__ = [
    "BufferSpec",
    "PeerEntries",
    "RankEndpoint",
    "RequestPlan",
    "SenderPlan",
    "StageCopy",
    "as_pages",
    "check_compatible",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferSpec:
    """One registered pool buffer of one rank: ``[num_layers, num_local_pages, *page_shape]`` (layer-major) or
    ``[num_local_pages, num_layers, *page_shape]`` (``page_major``), contiguous."""

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
    page_major: bool = False
    """Whether a page's layers lie next to each other (``[num_local_pages, num_layers, ...]``); may differ between
    ranks and sides (the planner pairs any two layouts)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEndpoint:
    """What one rank publishes at bootstrap: transfer session, page map, buffers, staging and metadata rows."""

    role: Literal["prefill", "decode"]
    """Which side the rank is on."""
    rank: int
    """CP rank within its side."""
    session: str
    """Transfer-engine address of the process hosting this rank (Mooncake: ``"ip:rpc_port"``)."""
    incarnation: int = 0
    """Random id of the process instance hosting the rank (a restarted rank publishes a new one)."""
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
    """Whether the entries include the replicated metadata row (in the last layer group)."""
    group_indptr: np.ndarray | None = None
    """int64 ``[num_layer_groups + 1]``: entries of layer group ``g`` are
    ``[group_indptr[g], group_indptr[g + 1])`` (``None``: one group)."""

    @property
    def num_entries(self) -> int:
        return int(self.length.shape[0])

    def group(self, g: int | None) -> slice:
        """The entries of layer group ``g`` (all of them for ``None``)."""
        if g is None or self.group_indptr is None:
            return slice(0, self.num_entries)
        return slice(int(self.group_indptr[g]), int(self.group_indptr[g + 1]))

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
    """Copies into this rank's staging buffer, one layer group at a time, before the group is sent."""
    unpack: dict[int, tuple[StageCopy, ...]] = field(default_factory=dict)
    """decode rank -> copies out of its staging buffer, one layer group at a time, once the group landed."""

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
    """int64 ``[num_layer_groups + 1]``: layer group ``g`` covers layers ``[layer_bounds[g], layer_bounds[g + 1])``."""

    @property
    def num_layer_groups(self) -> int:
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
    """A 1-D int64 numpy copy of a page list (list, numpy array or integer tensor): :func:`dtkv._util.as_int_array`."""
    return as_int_array(name, pages, shape_hint="[num_positions]")


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
            if b.page_bytes != ref_bufs[name].page_bytes:
                raise ValueError(
                    f"page_bytes of buffer {name!r} must match on every rank, got {ref_bufs[name].page_bytes} "
                    f"(prefill 0) and {b.page_bytes} ({ep.role} {ep.rank})"
                )
            want = ep.ownership.num_local_pages(ep.rank)
            if b.num_local_pages != want:
                raise ValueError(
                    f"num_local_pages of buffer {name!r} must be the {want} pages its ownership gives "
                    f"{ep.role} rank {ep.rank}, got num_local_pages={b.num_local_pages}"
                )
