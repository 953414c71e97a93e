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
"""

from __future__ import annotations

from dtkv._env import debug_enabled, debug_mode, default_backend
from dtkv._startup import ConfigMismatchError
from dtkv._version import __version__ as __version__
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
