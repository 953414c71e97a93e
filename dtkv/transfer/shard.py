"""``KVShard``: one rank's transferable KV buffers, its staging buffer and its metadata rows."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from dtkv._checks import check_int
from dtkv.layouts import KVLayout
from dtkv.ownership import PageOwnership, check_ownership
from dtkv.pool import ShardedKVPool
from dtkv.transfer.descriptors import BufferSpec, RankEndpoint, StageCopy
from dtkv.transfer.errors import format_pages

__all__ = ["KVShard", "layout_key"]


def layout_key(layout: KVLayout) -> str:
    """Canonical text of a layout (what both sides compare)."""
    return json.dumps(layout.describe(), sort_keys=True, default=str)


class KVShard:
    """The buffers of one CP rank that take part in a transfer.

    Args:
        buffers: name -> ``[num_layers, ownership.num_local_pages(rank), *layout.page_shape]`` tensor of
            ``layout.dtype`` (CPU: the Mooncake non-cuda build moves host memory only): contiguous, or with
            ``page_major`` the transposed view of a contiguous ``[num_local_pages, num_layers, *page_shape]`` tensor
            (what :meth:`dtkv.ShardedKVPool.buffer` returns for a page-major pool).
        layouts: name -> :class:`dtkv.KVLayout` of each buffer.
        ownership: the page map of this side.
        rank: this rank's index in ``ownership``.
        staging_bytes: bytes of a staging buffer to allocate and register (0: no staging on this rank).
        meta_num_rows: metadata slots (uint8 rows) to allocate and register (0: none).
        meta_row_bytes: bytes of a metadata row.
        page_major: the buffers' storage is page-major (published in :attr:`BufferSpec.page_major`).

    Use :meth:`from_pool` to wrap a :class:`dtkv.ShardedKVPool` (zero copy) or :meth:`allocate` for a
    standalone rank (e.g. the ranks of a CP decode simulated in one process).
    """

    def __init__(
        self,
        buffers: Mapping[str, torch.Tensor],
        layouts: Mapping[str, KVLayout],
        ownership: PageOwnership,
        rank: int,
        *,
        staging_bytes: int = 0,
        meta_num_rows: int = 0,
        meta_row_bytes: int = 0,
        page_major: bool = False,
    ) -> None:
        check_ownership(ownership, rank)
        if not isinstance(page_major, bool):
            raise TypeError(f"page_major must be a bool, got page_major={page_major!r}")
        check_int("staging_bytes", staging_bytes, min_value=0)
        check_int("meta_num_rows", meta_num_rows, min_value=0)
        check_int("meta_row_bytes", meta_row_bytes, min_value=0)
        if sorted(buffers) != sorted(layouts) or not buffers:
            raise ValueError(
                f"buffers and layouts must name the same buffers, got {sorted(buffers)} and {sorted(layouts)}"
            )
        if (meta_num_rows == 0) != (meta_row_bytes == 0):
            raise ValueError(
                "meta_num_rows and meta_row_bytes must be both 0 or both > 0, got "
                f"meta_num_rows={meta_num_rows}, meta_row_bytes={meta_row_bytes}"
            )
        n_local = ownership.num_local_pages(rank)
        num_layers = None
        for name, buf in buffers.items():
            lay = layouts[name]
            if not isinstance(buf, torch.Tensor):
                raise TypeError(f"buffers[{name!r}] must be a torch.Tensor, got {type(buf).__name__}")
            want = [buf.shape[0] if buf.dim() else None, n_local, *lay.page_shape]
            if buf.dim() != len(want) or list(buf.shape[1:]) != want[1:] or buf.dtype != lay.dtype:
                raise ValueError(
                    f"buffers[{name!r}] must be [num_layers, {n_local}, {', '.join(map(str, lay.page_shape))}] of "
                    f"{lay.dtype}, got shape {list(buf.shape)} of {buf.dtype}"
                )
            if page_major and not buf.transpose(0, 1).is_contiguous():
                raise ValueError(
                    f"buffers[{name!r}] must be the [num_layers, num_local_pages, ...] view of a contiguous "
                    "[num_local_pages, num_layers, ...] tensor (page_major=True: one registered region)"
                )
            if not page_major and not buf.is_contiguous():
                raise ValueError(f"buffers[{name!r}] must be contiguous (one registered region)")
            if num_layers is None:
                num_layers = int(buf.shape[0])
            elif buf.shape[0] != num_layers:
                raise ValueError(f"buffers must share num_layers, got {num_layers} and {buf.shape[0]} ({name!r})")
        self.buffers = dict(sorted(buffers.items()))
        """name -> ``[num_layers, num_local_pages, *page_shape]`` (a strided view when page-major)."""
        self.page_major = page_major
        self.layouts = dict(layouts)
        self.ownership = ownership
        self.rank = rank
        self.num_layers = int(num_layers)
        device = next(iter(self.buffers.values())).device
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device) if staging_bytes else None
        self.meta = (
            torch.zeros(meta_num_rows, meta_row_bytes, dtype=torch.uint8, device=device) if meta_num_rows else None
        )

    @classmethod
    def from_pool(cls, pool: ShardedKVPool, **kwargs: int) -> KVShard:
        """Wrap this rank's buffers of a :class:`dtkv.ShardedKVPool` (no copy; ``kwargs`` as the constructor)."""
        buffers = {name: pool.buffer(name) for name in pool.layouts}
        return cls(buffers, pool.layouts, pool.ownership, pool.rank, page_major=pool.page_major, **kwargs)

    @classmethod
    def allocate(
        cls,
        layouts: Mapping[str, KVLayout],
        ownership: PageOwnership,
        rank: int,
        *,
        num_layers: int,
        device: torch.device | str = "cpu",
        page_major: bool = False,
        **kwargs: int,
    ) -> KVShard:
        """Zero-filled buffers for ``rank`` of ``ownership``, page-major with ``page_major`` (``kwargs`` as the
        constructor)."""
        check_int("num_layers", num_layers, min_value=1)
        check_int("rank", rank, min_value=0)
        n_local = ownership.num_local_pages(rank)
        dims = (n_local, num_layers) if page_major else (num_layers, n_local)
        buffers = {
            name: torch.zeros((*dims, *lay.page_shape), dtype=lay.dtype, device=device) for name, lay in layouts.items()
        }
        if page_major:
            buffers = {name: buf.transpose(0, 1) for name, buf in buffers.items()}
        return cls(buffers, layouts, ownership, rank, page_major=page_major, **kwargs)

    @property
    def page_size(self) -> int:
        """Tokens per page (shared by every layout)."""
        return next(iter(self.layouts.values())).page_size

    # ------------------------------------------------------------------------------------------ exchange
    def endpoint(self, role: Literal["prefill", "decode"], session: str, incarnation: int = 0) -> RankEndpoint:
        """The :class:`RankEndpoint` this rank publishes (addresses of the registered tensors)."""
        specs = tuple(
            BufferSpec(
                name=name,
                addr=buf.data_ptr(),
                num_local_pages=int(buf.shape[1]),
                page_bytes=self.layouts[name].page_bytes,
                elem_bytes=buf.element_size(),
                layout_key=layout_key(self.layouts[name]),
                page_major=self.page_major,
            )
            for name, buf in self.buffers.items()
        )
        return RankEndpoint(
            role=role,
            rank=self.rank,
            session=session,
            incarnation=incarnation,
            ownership=self.ownership,
            num_layers=self.num_layers,
            buffers=specs,
            staging_addr=self.staging.data_ptr() if self.staging is not None else 0,
            staging_bytes=self.staging.numel() if self.staging is not None else 0,
            meta_addr=self.meta.data_ptr() if self.meta is not None else 0,
            meta_row_bytes=self.meta.shape[1] if self.meta is not None else 0,
            meta_num_rows=self.meta.shape[0] if self.meta is not None else 0,
        )

    def registered_tensors(self) -> list[torch.Tensor]:
        """Every tensor a transfer engine must register for this rank (pools, staging, metadata rows), each
        contiguous (a page-major buffer as its ``[num_local_pages, num_layers, ...]`` storage)."""
        out = [self.storage(name) for name in self.buffers]
        out += [t for t in (self.staging, self.meta) if t is not None]
        return out

    def storage(self, name: str) -> torch.Tensor:
        """The contiguous tensor behind ``buffers[name]``: itself when layer-major, ``[num_local_pages, num_layers,
        *page_shape]`` when page-major."""
        buf = self.buffers[name]
        return buf.transpose(0, 1) if self.page_major else buf

    # ------------------------------------------------------------------------------------------ staging
    def _views(self, copy: StageCopy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pool buffer ``[num_layers, num_local_pages, ...]``, staging region ``[num_layers, k, ...]``, page index),
        as int64 words when aligned (the pool view strided when page-major).

        Torch's CPU ``index_copy_`` moves uint8 rows at ~2 GB/s but int64 rows at ~11 GB/s, so whole pages are
        copied as 8-byte words whenever the page size and both addresses allow it.
        """
        buf = self.buffers[copy.name]
        page_bytes = self.layouts[copy.name].page_bytes
        k = int(copy.local_pages.shape[0])
        nbytes = self.num_layers * k * page_bytes
        assert self.staging is not None and copy.offset + nbytes <= self.staging.numel(), (
            f"staging region [{copy.offset}, {copy.offset + nbytes}) exceeds rank {self.rank}'s staging buffer"
        )
        raw = self.staging[copy.offset : copy.offset + nbytes]
        if page_bytes % 8 == 0 and (raw.data_ptr() | buf.data_ptr()) % 8 == 0:
            pool = buf.view(torch.uint8).view(self.num_layers, buf.shape[1], page_bytes).view(torch.int64)
            region = raw.view(torch.int64).view(self.num_layers, k, page_bytes // 8)
        else:
            pool = buf
            region = raw.view(buf.dtype).view(self.num_layers, k, *buf.shape[2:])
        return pool, region, torch.from_numpy(copy.local_pages).to(buf.device)

    def check_copies(self, copies: Iterable[StageCopy]) -> None:
        """Raise ``ValueError`` unless every copy names a buffer of this rank, lies inside its staging buffer and
        holds local pages in range (what decode checks before unpacking copies a sender announced)."""
        staging = 0 if self.staging is None else self.staging.numel()
        for c in copies:
            if c.name not in self.buffers:
                raise ValueError(f"copy buffer must be one of {sorted(self.buffers)}, got {c.name!r}")
            n_local = int(self.buffers[c.name].shape[1])
            pages = c.local_pages
            if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= n_local):
                raise ValueError(f"copy local pages must be in [0, {n_local}), got {format_pages(pages)}")
            nbytes = self.num_layers * int(pages.shape[0]) * self.layouts[c.name].page_bytes
            if c.offset < 0 or c.offset + nbytes > staging:
                raise ValueError(
                    f"copy region [{c.offset}, {c.offset + nbytes}) must lie in the {staging}-byte staging buffer"
                )
            if c.offset % self.buffers[c.name].element_size():
                raise ValueError(f"copy offset must be a multiple of the element size, got {c.offset}")

    def pack(self, copies: Iterable[StageCopy], layers: slice = slice(None)) -> None:
        """Copy ``buffer[layers, local_pages]`` into each staging region (prefill side, before sending)."""
        for c in copies:
            pool, region, idx = self._views(c)
            torch.index_select(pool[layers], 1, idx, out=region[layers])

    def unpack(self, copies: Iterable[StageCopy], layers: slice = slice(None)) -> None:
        """Copy each staging region into ``buffer[layers, local_pages]`` (decode side, once the bytes landed)."""
        for c in copies:
            pool, region, idx = self._views(c)
            pool[layers].index_copy_(1, idx, region[layers])

    def __repr__(self) -> str:
        names = ", ".join(self.buffers)
        return (
            f"KVShard(rank={self.rank}, {self.ownership!r}, num_layers={self.num_layers}, buffers=[{names}], "
            f"staging_bytes={0 if self.staging is None else self.staging.numel()}"
            f"{', page_major=True' if self.page_major else ''})"
        )
