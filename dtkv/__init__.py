"""dtkv: page-ownership-sharded KV caches for context-parallel prefill of sparse-attention LLMs.

Entry points:

- :class:`PageOwnership` -- DTensor placement tag and the pure logical page <-> (owner, local page) map of an
  ownership scheme (:data:`OwnershipScheme`: ``"interleave"`` or ``"block"``).
- :class:`PageAllocator` -- SPMD, owner-aware, reference-counted page allocator.
- :class:`PrefixCache` -- radix tree over full pages of token ids sharing cached pages across requests (SPMD).
- :class:`MLALatentLayout`, :class:`MLAFp8Layout`, :class:`IndexerFp8Layout` -- stored byte layouts of a page.
- :class:`ShardedKVPool` -- per-layer pools holding only the owned pages, with startup agreement checks.
- :func:`plan_cp_split` -> :class:`CPSplit` -- zigzag / page-aligned / round-robin CP split metadata
  (:mod:`dtkv.split`), :func:`verify_direct_write`, :func:`allocate_for_split`.
- :mod:`dtkv.ops` -- the custom ops; :mod:`dtkv.materialize` -- full views; :mod:`dtkv.model` -- the reference
  model; :mod:`dtkv.transfer` -- Mooncake PD transfer; :mod:`dtkv.capacity` -- sizing.

The page-table format and the glossary are in :mod:`dtkv.page_table`; ``DTKV_*`` variables in :mod:`dtkv._env`.

The names below load on first use (PEP 562): ``import dtkv`` and ``python -m dtkv --version`` import neither torch
nor a kernel; ``dtkv.<name>`` (or ``from dtkv import <name>``) imports the module that defines it, and
``dtkv.<submodule>`` (``dtkv.ops``, ``dtkv.materialize``, ...) imports that submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dtkv._env import debug_enabled, debug_mode, default_backend  # stdlib only; applies DTKV_LOGLEVEL at import
from dtkv._version import __version__ as __version__

if TYPE_CHECKING:  # the eager imports, for type checkers and readers; at run time __getattr__ below loads them
    from dtkv._startup import ConfigMismatchError
    from dtkv.allocator import AllocationError, PageAllocator
    from dtkv.layouts import FP8_E4M3_MAX, IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
    from dtkv.ownership import OwnershipScheme, OwnershipSpec, PageOwnership, ownership_spec
    from dtkv.pool import ShardedKVPool, gather_pages
    from dtkv.prefix_cache import PrefixCache, PrefixCacheMismatchError
    from dtkv.split import (
        CPSplit,
        LocalSplit,
        SplitAllocation,
        allocate_for_split,
        compute_owners,
        compute_pages,
        handoff_pages,
        local_locs,
        merge_prev_next,
        pad_local,
        plan_cp_split,
        restore_natural,
        split_prev_next,
        take_local,
        verify_direct_write,
    )

_HOMES: dict[str, str] = {
    "ConfigMismatchError": "dtkv._startup",
    "AllocationError": "dtkv.allocator",
    "PageAllocator": "dtkv.allocator",
    "FP8_E4M3_MAX": "dtkv.layouts",
    "IndexerFp8Layout": "dtkv.layouts",
    "KVLayout": "dtkv.layouts",
    "MLAFp8Layout": "dtkv.layouts",
    "MLALatentLayout": "dtkv.layouts",
    "OwnershipScheme": "dtkv.ownership",
    "OwnershipSpec": "dtkv.ownership",
    "PageOwnership": "dtkv.ownership",
    "ownership_spec": "dtkv.ownership",
    "ShardedKVPool": "dtkv.pool",
    "gather_pages": "dtkv.pool",
    "PrefixCache": "dtkv.prefix_cache",
    "PrefixCacheMismatchError": "dtkv.prefix_cache",
    **{
        name: "dtkv.split"
        for name in (
            "CPSplit",
            "LocalSplit",
            "SplitAllocation",
            "allocate_for_split",
            "compute_owners",
            "compute_pages",
            "handoff_pages",
            "local_locs",
            "merge_prev_next",
            "pad_local",
            "plan_cp_split",
            "restore_natural",
            "split_prev_next",
            "take_local",
            "verify_direct_write",
        )
    },
}
"""Public name -> the module that defines it (loaded by :func:`__getattr__` on first use)."""


def __getattr__(name: str) -> object:
    """``dtkv.<name>``: a public name from its module, or a submodule (``dtkv.ops``), imported on first use."""
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


__all__ = [
    "FP8_E4M3_MAX",
    "AllocationError",
    "CPSplit",
    "ConfigMismatchError",
    "IndexerFp8Layout",
    "KVLayout",
    "LocalSplit",
    "MLAFp8Layout",
    "MLALatentLayout",
    "OwnershipScheme",
    "OwnershipSpec",
    "PageAllocator",
    "PageOwnership",
    "PrefixCache",
    "PrefixCacheMismatchError",
    "ShardedKVPool",
    "SplitAllocation",
    "allocate_for_split",
    "compute_owners",
    "compute_pages",
    "debug_enabled",
    "debug_mode",
    "default_backend",
    "gather_pages",
    "handoff_pages",
    "local_locs",
    "merge_prev_next",
    "ownership_spec",
    "pad_local",
    "plan_cp_split",
    "restore_natural",
    "split_prev_next",
    "take_local",
    "verify_direct_write",
]
