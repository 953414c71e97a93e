"""dtkv: page-ownership-sharded KV caches for context-parallel prefill of sparse-attention LLMs.

Entry points:

- :class:`PageOwnership` -- DTensor placement tag and the pure logical page <-> (owner, local page) map.
- :class:`PageAllocator` -- SPMD, owner-aware page allocator.
- :class:`MLALatentLayout`, :class:`MLAFp8Layout`, :class:`IndexerFp8Layout` -- stored byte layouts.
- :class:`ShardedKVPool` -- per-layer pools holding only the owned pages, with startup agreement checks.

The page-table format is defined in :mod:`dtkv.page_table`; ``DTKV_*`` variables in :mod:`dtkv._env`.
"""

from __future__ import annotations

from dtkv._env import debug_enabled, debug_mode, default_backend
from dtkv._startup import ConfigMismatchError
from dtkv.allocator import AllocationError, PageAllocator
from dtkv.layouts import FP8_E4M3_MAX, IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout
from dtkv.ownership import PageOwnership
from dtkv.pool import ShardedKVPool, gather_pages

__version__ = "0.1.0.dev0"

__all__ = [
    "FP8_E4M3_MAX",
    "AllocationError",
    "ConfigMismatchError",
    "IndexerFp8Layout",
    "KVLayout",
    "MLAFp8Layout",
    "MLALatentLayout",
    "PageAllocator",
    "PageOwnership",
    "ShardedKVPool",
    "debug_enabled",
    "debug_mode",
    "default_backend",
    "gather_pages",
]
