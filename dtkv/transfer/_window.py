"""The host side of a staged hand-off (:mod:`dtkv.transfer.handoff`): one rank's pinned window over its pool and its
copies, the rounds, and what both hand-off sides share.

A window holds ``2 * round_pages`` pages per layer and buffer (two slots); a round's positions owned by a rank fill
its slot from the slot's first page in position order. On CUDA the copies run on a side stream of the window, each
slot's last copy recorded as an event that the next use of the slot waits for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np
import torch

from dtkv._checks import check_int
from dtkv.ownership import PageOwnership
from dtkv.transfer.descriptors import as_pages
from dtkv.transfer.memory import needs_host_staging
from dtkv.transfer.plan import check_pages
from dtkv.transfer.protocol import check_request_id
from dtkv.transfer.shard import KVShard

__all__ = ["DEFAULT_WINDOW_BYTES", "HandoffSide", "default_round_pages", "round_request_id", "round_tokens"]

DEFAULT_WINDOW_BYTES = 512 << 20
"""Host memory per staging rank that :func:`default_round_pages` sizes the window for (two slots)."""


def default_round_pages(layouts: Mapping, num_layers: int, window_bytes: int = DEFAULT_WINDOW_BYTES) -> int:
    """Positions per round such that a window of two slots fits ``window_bytes`` (at least 1).

    Args:
        layouts: name -> :class:`dtkv.KVLayout` of every pool buffer.
        num_layers: layers stored in every buffer.
    """
    per_page = num_layers * sum(lay.page_bytes for lay in layouts.values())
    return max(1, int(window_bytes) // (2 * per_page))


def round_request_id(request_id: str, k: int) -> str:
    """The protocol request id of round ``k`` of ``request_id``."""
    return f"{request_id}#{k}"


def _rounds(n: int, round_pages: int) -> list[slice]:
    """Position ranges of the rounds of a request of ``n`` positions (one empty round when ``n == 0``)."""
    return [slice(s, min(s + round_pages, n)) for s in range(0, max(n, 1), round_pages)]


def round_tokens(num_tokens: int | None, sl: slice, page_size: int) -> int | None:
    """Tokens of the positions ``sl`` of a request of ``num_tokens`` tokens (``None`` stays ``None``)."""
    if num_tokens is None:
        return None
    return max(0, min(num_tokens, sl.stop * page_size) - sl.start * page_size)


class _Window:
    """One rank's pinned host window over its pool shard: ``2 * round_pages`` pages per layer and buffer."""

    def __init__(self, pool: KVShard, round_pages: int, ownership: PageOwnership, meta_rows: tuple[int, int]) -> None:
        self.pool = pool
        self.rank = pool.rank
        self.round_pages = round_pages
        self.device = next(iter(pool.buffers.values())).device
        pin = self.device.type == "cuda"
        buffers = {
            name: torch.zeros((pool.num_layers, 2 * round_pages, *lay.page_shape), dtype=lay.dtype, pin_memory=pin)
            for name, lay in pool.layouts.items()
        }
        self.host = KVShard(
            buffers, pool.layouts, ownership, pool.rank, meta_num_rows=meta_rows[0], meta_row_bytes=meta_rows[1]
        )
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.events: dict[int, torch.cuda.Event] = {}
        """slot -> the event recorded after its last copy (CUDA)."""

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        """``[num_layers, pages, page_bytes]`` view of a buffer ``[num_layers, pages, *page_shape]`` of either
        layout (a view, never a copy: the scatter writes through it)."""
        return t.view(torch.uint8).view(t.shape[0], t.shape[1], -1)

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def follow_compute(self) -> None:
        """Order the side stream after the work queued so far on the current stream (the pool's writes)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def gather(self, slot: int, pool_local: np.ndarray) -> None:
        """Copy the pool's local pages ``pool_local`` (every layer and buffer) into ``slot``, in order (async)."""
        start, c = slot * self.round_pages, int(pool_local.shape[0])
        if c == 0:
            return
        with self._stream():
            idx = torch.from_numpy(pool_local).to(self.device)
            for name, buf in self.pool.buffers.items():
                src, dst = self._bytes(buf), self._bytes(self.host.buffers[name])
                picked = src.index_select(1, idx)  # [num_layers, c, page_bytes] on the pool's device
                if self.stream is None:
                    dst[:, start : start + c].copy_(picked)
                else:
                    for layer in range(dst.shape[0]):  # each a contiguous device-to-host copy into pinned memory
                        dst[layer, start : start + c].copy_(picked[layer], non_blocking=True)
            self._record(slot)

    def scatter(self, slot: int, pool_local: np.ndarray) -> None:
        """Copy ``slot``'s first pages into the pool's local pages ``pool_local`` (every layer and buffer; async)."""
        start, c = slot * self.round_pages, int(pool_local.shape[0])
        if c == 0:
            return
        with self._stream():
            idx = torch.from_numpy(pool_local).to(self.device)
            for name, buf in self.pool.buffers.items():
                src, dst = self._bytes(self.host.buffers[name]), self._bytes(buf)
                if self.stream is None:
                    dst.index_copy_(1, idx, src[:, start : start + c])
                    continue
                landed = torch.empty((src.shape[0], c, src.shape[2]), dtype=torch.uint8, device=self.device)
                for layer in range(src.shape[0]):
                    landed[layer].copy_(src[layer, start : start + c], non_blocking=True)
                dst.index_copy_(1, idx, landed)
            self._record(slot)

    def _record(self, slot: int) -> None:
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.events[slot] = ev

    def wait(self, slot: int) -> None:
        """Block until the copies of ``slot`` have run (host side)."""
        ev = self.events.pop(slot, None)
        if ev is not None:
            ev.synchronize()

    def wait_all(self) -> None:
        for slot in list(self.events):
            self.wait(slot)


def _placement(own: PageOwnership, pages: np.ndarray, window: PageOwnership, slot_base: int):
    """Where a round's pages go in the window: ``(window logical page per position, owner, pool local index,
    window local index)``; each rank's positions fill its slot from ``slot_base`` in position order."""
    t = torch.from_numpy(pages)
    owner, local = own.owner(t).numpy(), own.local_index(t).numpy()
    order = np.argsort(owner, kind="stable")
    sorted_owner = owner[order]
    rank_pos = np.empty_like(owner)
    rank_pos[order] = np.arange(owner.shape[0]) - np.searchsorted(sorted_owner, sorted_owner, side="left")
    win_local = slot_base + rank_pos
    win_pages = window.global_page(torch.from_numpy(owner), torch.from_numpy(win_local)).numpy()
    return win_pages.astype(np.int64), owner, local, win_local


class HandoffSide:
    """What both hand-off sides share: the pool shards, the staging decision, the windows, the rounds."""

    def __init__(self, shards, engine, round_pages: int | None, staged: bool | None) -> None:
        shard_list = [shards] if isinstance(shards, KVShard) else list(shards)
        if not shard_list:
            raise ValueError("shards must hold at least one KVShard, got none")
        self.pools = {s.rank: s for s in shard_list}
        first = shard_list[0]
        if round_pages is None:
            round_pages = default_round_pages(first.layouts, first.num_layers)
        check_int("round_pages", round_pages, min_value=1)
        self.round_pages = int(round_pages)
        tensors = [t for s in shard_list for t in s.registered_tensors()]
        self.staged = needs_host_staging(tensors, engine) if staged is None else bool(staged)
        """Whether this side hands its pages over through the host window (else in place)."""
        self.ownership = first.ownership
        self.page_size = first.page_size
        self.windows: dict[int, _Window] = {}
        if self.staged:
            cp = self.ownership.cp_size
            window_own = PageOwnership(cp, cp * 2 * self.round_pages, "block")
            meta = (0, 0) if first.meta is None else (int(first.meta.shape[0]), int(first.meta.shape[1]))
            self.windows = {r: _Window(s, self.round_pages, window_own, meta) for r, s in self.pools.items()}
            self.window_ownership = window_own

    def engine_shards(self) -> list[KVShard]:
        """The shards the engine registers: the windows when staged, else the pools themselves."""
        return [w.host for w in self.windows.values()] if self.staged else list(self.pools.values())

    def check(self, request_id: str, pages: object, name: str) -> tuple[np.ndarray, list[slice]]:
        request_id = check_request_id(request_id)
        arr = as_pages(name, pages)
        check_pages(name, arr, self.ownership)
        rounds = _rounds(int(arr.shape[0]), self.round_pages)
        check_request_id(round_request_id(request_id, len(rounds) - 1))
        return arr, rounds

    def place(self, pages: np.ndarray, slot: int):
        """``(the round's pages in the protocol, {hosted rank: its pool local pages in slot order})`` for ``slot``;
        in place: the pages themselves and nothing to copy."""
        if not self.staged:
            return pages, {}
        win_pages, owner, local, _ = _placement(self.ownership, pages, self.window_ownership, slot * self.round_pages)
        return win_pages, {r: local[owner == r] for r in self.windows}

    def window_bytes(self) -> int:
        """Host memory of the windows this process holds."""
        return sum(t.numel() * t.element_size() for w in self.windows.values() for t in w.host.buffers.values())

    def drain(self) -> None:
        for w in self.windows.values():
            w.wait_all()
