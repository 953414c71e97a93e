"""``ShardedKVPool``: per-layer KV pools that store each logical page once, on its owner rank.

One contiguous buffer per named layout holds this rank's pages for every layer (one region to register with a
transfer engine): ``[num_layers, num_local_pages, *page_shape]`` (layer-major, the default) or, with
``page_major=True``, ``[num_local_pages, num_layers, *page_shape]`` (a page's layers next to each other, so that a
run of pages is one byte range covering every layer: one transfer entry instead of one per layer). Hot paths use
the plain local views (:meth:`ShardedKVPool.local`); API boundaries can wrap them as DTensors whose global shape is
the logical pool (:meth:`ShardedKVPool.dtensor`). The page-table format is defined in :mod:`dtkv.page_table`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtkv._agree import agreement
from dtkv._checks import check_tensor
from dtkv._collectives import all_gather_rows, group_rank, group_size
from dtkv.layouts import KVLayout, total_page_bytes
from dtkv.ownership import PageOwnership, check_ownership

__all__ = ["ShardedKVPool"]


def _resolve_group(
    group: dist.ProcessGroup | DeviceMesh | None,
) -> tuple[dist.ProcessGroup | None, DeviceMesh | None]:
    if group is None:
        return None, None
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group must be a 1-D DeviceMesh (the CP axis), got a mesh with ndim={group.ndim}")
        return group.get_group(), group
    return group, None


class ShardedKVPool:
    """KV pools of several layouts for ``num_layers`` layers, sharded by page ownership over a CP group.

    Creating a pool is collective over ``group`` and fails together: the ranks check that they agree on cp
    size, page size, ownership scheme, page count and layer specs (every rank raises the same
    :class:`dtkv.ConfigMismatchError` if not), and an argument error or a failed allocation on any one rank is
    raised, with that rank's message, on every rank (:mod:`dtkv._agree`), within seconds instead of leaving the
    others in a collective until the process-group timeout. Ranks that store no page (``num_local_pages`` 0)
    are a normal case.

    Args:
        layouts: name -> :class:`dtkv.KVLayout` (e.g. ``{"kv": MLAFp8Layout(), "index": IndexerFp8Layout()}``);
            all must share one ``page_size``.
        ownership: the page map; ``ownership.cp_size`` must equal the group size.
        num_layers: layers stored (>= 1).
        group: the CP process group or 1-D DeviceMesh; ``None`` for a single process (``cp_size`` 1).
        device: where the local buffers live (default CPU).
        page_major: store each buffer page-major, ``[num_local_pages, num_layers, *page_shape]`` (default
            layer-major, ``[num_layers, num_local_pages, *page_shape]``); every rank must pass the same value.
            The views (:meth:`buffer`, :meth:`local`) have the same shapes either way; only their strides differ.

    Example:
        >>> pool = ShardedKVPool({"kv": MLALatentLayout(page_size=4)}, PageOwnership(1, 8), num_layers=2)
        >>> pool.local("kv", 0).shape
        torch.Size([8, 4, 576])
    """

    def __init__(
        self,
        layouts: Mapping[str, KVLayout],
        ownership: PageOwnership,
        *,
        num_layers: int,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        device: torch.device | str = "cpu",
        page_major: bool = False,
    ) -> None:
        self.group, self._mesh = _resolve_group(group)  # the group must be known to fail together
        with agreement(self.group, what="ShardedKVPool") as agreed:
            # Local checks: any rank's error is raised on every rank, after the one agreement collective.
            check_ownership(ownership)
            if not layouts:
                raise ValueError("layouts must name at least one KVLayout, got an empty mapping")
            for name, lay in layouts.items():
                if not isinstance(lay, KVLayout):
                    raise TypeError(f"layouts[{name!r}] must be a KVLayout, got {type(lay).__name__}")
            if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
                raise ValueError(f"num_layers must be an int >= 1, got num_layers={num_layers!r}")
            if not isinstance(page_major, bool):
                raise TypeError(f"page_major must be a bool, got page_major={page_major!r}")
            self.page_major = page_major
            self.layouts = dict(layouts)
            self.ownership = ownership
            self.num_layers = num_layers
            self.device = torch.device(device)
            self.rank = group_rank(self.group)
            agreed.value = self.describe()
        # The configuration is now equal on every rank, so these checks raise on every rank or on none.
        world = group_size(self.group)
        page_sizes = {lay.page_size for lay in self.layouts.values()}
        if len(page_sizes) != 1:
            raise ValueError(f"layouts must share one page_size, got {sorted(page_sizes)}")
        if ownership.cp_size != world:
            raise ValueError(
                f"ownership.cp_size must equal the CP group size, got cp_size={ownership.cp_size}, group size={world}"
            )
        self.page_size = page_sizes.pop()
        self.num_local_pages = ownership.num_local_pages(self.rank)  # may be 0: a rank that stores no page
        with agreement(self.group, what="ShardedKVPool buffers"):  # an allocation failure fails every rank
            dims = (self.num_local_pages, num_layers) if page_major else (num_layers, self.num_local_pages)
            self._buffers = {
                name: torch.zeros((*dims, *lay.page_shape), dtype=lay.dtype, device=self.device)
                for name, lay in self.layouts.items()
            }

    # ------------------------------------------------------------------------------------------ views
    def describe(self) -> dict[str, object]:
        """Everything the ranks must agree on (exchanged at startup)."""
        return {
            "cp_size": self.ownership.cp_size,
            "num_pages": self.ownership.num_pages,
            "scheme": self.ownership.scheme,
            "num_layers": self.num_layers,
            "device_type": self.device.type,
            "page_major": self.page_major,
            "layouts": {name: lay.describe() for name, lay in sorted(self.layouts.items())},
        }

    def buffer(self, name: str) -> torch.Tensor:
        """All layers of one layout: ``[num_layers, num_local_pages, *page_shape]``, whatever the storage order.

        Contiguous when layer-major; a strided view of :meth:`storage` when page-major (``buffer(name)[l, j]`` is
        layer ``l`` of local page ``j`` either way; ``.view`` of the first two dims together does not apply).
        """
        self._check_name(name)
        buf = self._buffers[name]
        return buf.transpose(0, 1) if self.page_major else buf

    def storage(self, name: str) -> torch.Tensor:
        """The contiguous tensor behind :meth:`buffer` (what a transfer engine registers):
        ``[num_layers, num_local_pages, *page_shape]`` when layer-major, ``[num_local_pages, num_layers,
        *page_shape]`` when page-major."""
        self._check_name(name)
        return self._buffers[name]

    def local(self, name: str, layer: int) -> torch.Tensor:
        """This rank's pages of one layer: ``[num_local_pages, *page_shape]``, local page order.

        Pages are ``page_elems`` apart when layer-major and ``num_layers * page_elems`` apart when page-major (each
        page itself contiguous; the ops take any page stride).
        """
        self._check_layer(layer)
        return self.buffer(name)[layer]

    def dtensor(self, name: str, layer: int):
        """The layer's pool as a DTensor of global shape ``[num_pages, *page_shape]``, placement ``[ownership]``.

        For API boundaries and inspection; hot paths use :meth:`local` (in-graph mutation of a DTensor with a
        custom placement does not compile).
        """
        from torch.distributed.tensor import DTensor

        local = self.local(name, layer)
        shape = (self.ownership.num_pages, *local.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, [self.ownership], run_check=False, shape=shape, stride=stride)

    @property
    def mesh(self) -> DeviceMesh:
        """The CP DeviceMesh (built from the group on first use)."""
        if self._mesh is None:
            if self.group is None:
                raise ValueError("dtensor() needs a process group; this pool was created with group=None")
            self._mesh = DeviceMesh.from_group(self.group, self.device.type)
        return self._mesh

    # ------------------------------------------------------------------------------------------ sizes
    def bytes_per_rank(self) -> int:
        """Bytes of this rank's buffers (every layer, every layout)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def replicated_bytes(self) -> int:
        """Bytes one rank would hold if the logical pool were replicated."""
        return self.num_layers * self.ownership.num_pages * total_page_bytes(self.layouts)

    # ------------------------------------------------------------------------------------------ gather
    def gather_full(self, layer: int, name: str | None = None) -> dict[str, torch.Tensor] | torch.Tensor:
        """Assemble the logical pool of ``layer`` on every rank (collective; debugging and tests).

        Returns:
            ``[num_pages, *page_shape]`` in logical page order, for ``name``; or a dict of them for every
            layout when ``name`` is None.
        """
        names = sorted(self.layouts) if name is None else [name]
        out = {n: gather_pages(self.local(n, layer), self.ownership, self.group) for n in names}
        return out if name is None else out[name]

    def _check_name(self, name: str) -> None:
        if name not in self._buffers:
            raise KeyError(f"name must be one of {sorted(self._buffers)}, got name={name!r}")

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}), got layer={layer!r}")

    def __repr__(self) -> str:
        lays = ", ".join(f"{n}={type(lay).__name__}" for n, lay in sorted(self.layouts.items()))
        return (
            f"ShardedKVPool({lays}, {self.ownership!r}, num_layers={self.num_layers}, rank={self.rank}, "
            f"num_local_pages={self.num_local_pages}{', page_major=True' if self.page_major else ''})"
        )


def gather_pages(local: torch.Tensor, ownership: PageOwnership, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather a local page pool ``[num_local_pages(rank), ...]`` into logical order ``[num_pages, ...]``.

    Collective over ``group``. Each rank pads to ``max_local_pages`` (a rank storing no page sends only
    padding); the owner-major result ``[cp, max_local, ...]`` is put into logical order with a view
    (interleave: transpose) or a slice-and-cat (block).

    Eager (debugging, tests, inspection): the ranks first agree on the page shape and dtype, and a bad ``local``
    on any rank raises on every rank (:mod:`dtkv._agree`; one 48-byte all-gather) instead of aborting the
    all-gather with buffers of different sizes.

    Raises:
        ValueError: ``local`` does not have ``ownership.num_local_pages(rank)`` pages, or ``group`` does not
            have ``ownership.cp_size`` ranks (on every rank).
        ConfigMismatchError: the ranks' pages differ in shape or dtype (on every rank).
    """
    cp = ownership.cp_size
    with agreement(group, what="gather_pages") as agreed:
        check_tensor("local", local)
        world, rank = group_size(group), group_rank(group)
        if world != cp:
            raise ValueError(f"group must have ownership.cp_size={cp} ranks, got a group of {world}")
        want = ownership.num_local_pages(rank)
        if local.dim() < 1 or local.shape[0] != want:
            raise ValueError(
                f"local must hold rank {rank}'s {want} pages in dim 0 (ownership {ownership!r}), "
                f"got local.shape={list(local.shape)}"
            )
        agreed.value = {"page_shape": list(local.shape[1:]), "dtype": str(local.dtype)}
    if cp == 1:
        return local.clone()
    max_local = ownership.max_local_pages
    padded = local.new_zeros((max_local, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = all_gather_rows(padded, group).view(cp, max_local, *local.shape[1:])
    if ownership.scheme == "interleave":
        return gathered.transpose(0, 1).reshape(cp * max_local, *local.shape[1:])[: ownership.num_pages].clone()
    return torch.cat([gathered[r, : ownership.num_local_pages(r)] for r in range(cp)], dim=0)
