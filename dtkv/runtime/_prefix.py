"""The runtime's prefix-cache steps: a :class:`dtkv.PrefixCache` over the runtime's SPMD allocator.

- :func:`attach_cached_prefix` (``add_request``): the request starts from its longest cached prefix of full
  pages, capped so that at least one prompt token is computed (its logits give the first output token). The
  prefix ends on a page boundary, so the step's split is planned with a page-aligned prefix.
- :func:`make_room` (plan phase, before allocation): evicts unused cached pages when the step's new pages would
  not fit where the allocation asks for them -- first of each owner class the compute-owner allocation asks more
  of than it has free (even when the total fits: the eviction rule of :mod:`dtkv.prefix_cache`), then any;
  :func:`make_room_for_decode` likewise before a sharded decode step (``decode_mode="sharded"``).
- :func:`cache_computed` (after each step): shares every request's fully computed pages.
- :func:`release_request` (``finish_request``): caches the request's full pages and drops its references.

Every function is host-side and runs identically on every rank. ``runtime`` is a :class:`dtkv.runtime.Runtime`
(``prefix_cache``, ``allocator``, ``page_size``, ``mode``, ``stats``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dtkv._util import cdiv
from dtkv.split import compute_owners

__all__ = ["attach_cached_prefix", "cache_computed", "make_room", "make_room_for_decode", "release_request"]


def attach_cached_prefix(runtime, req) -> None:
    """Give a new request (no pages yet) the cached pages of its prompt's longest cached prefix."""
    cache, ps = runtime.prefix_cache, runtime.page_size
    pages = cache.match(req.prompt, max_pages=(len(req.prompt) - 1) // ps)
    req.pages = pages
    req.num_computed = req.cached_tokens = len(pages) * ps
    runtime.stats["prefix_prompt_tokens"] += len(req.prompt)
    runtime.stats["prefix_hit_tokens"] += req.cached_tokens


def make_room(runtime, split) -> None:
    """Evict cached pages so that the step's new pages fit where the allocation asks for them.

    Under ``sharded_direct`` the compute-owner allocation (``allocate_for_split``) asks each owner for the new
    pages of the page-aligned requests it computes: an owner short of free pages evicts its own cached leaves
    first (:meth:`dtkv.PrefixCache.make_room` with ``per_owner``), even when the total still fits -- otherwise
    those slots fall back to other owners' pages and their rows go through the handoff all-gather instead of a
    direct write. Otherwise (and then) leaves are evicted while the total does not fit.
    """
    ps = split.page_size
    prefix = np.asarray(split.prefix_lens, dtype=np.int64).reshape(split.num_reqs)
    extend = np.asarray(split.extend_lens, dtype=np.int64).reshape(split.num_reqs)
    have, need = cdiv(prefix, ps), cdiv(prefix + extend, ps)
    total = int(np.maximum(need - have, 0).sum())
    alloc = runtime.allocator
    per_owner = None
    short = total > alloc.num_free()
    if runtime.mode == "sharded_direct":
        owners = compute_owners(split).numpy()
        cols = np.arange(owners.shape[1], dtype=np.int64)[None, :]
        new = (cols >= have[:, None]) & (cols < need[:, None]) & split.page_aligned.numpy()[:, None]
        per_owner = np.bincount(owners[new], minlength=alloc.ownership.cp_size).tolist()
        short = short or any(want > alloc.num_free(r) for r, want in enumerate(per_owner))
    if short:
        _note_evicted(runtime, runtime.prefix_cache.make_room(total, per_owner))


def _note_evicted(runtime, pages: list[int]) -> None:
    """Tell the running step which pages its evictions freed (:meth:`dtkv.runtime._outcome.StepOutcome.keep_pages`)."""
    outcome = getattr(runtime, "_outcome", None)
    if outcome is not None:
        outcome.evicted += pages


def make_room_for_decode(runtime, reqs: Sequence) -> None:
    """Evict cached pages so that a sharded decode step's new pages (one token per request) fit."""
    ps = runtime.page_size
    total = sum(max(0, cdiv(r.num_computed + 1, ps) - len(r.pages)) for r in reqs)
    if total > runtime.allocator.num_free():
        _note_evicted(runtime, runtime.prefix_cache.make_room(total))


def cache_computed(runtime, reqs: Sequence) -> None:
    """Insert the fully computed pages of each request into the cache (touches pages cached already)."""
    cache, ps = runtime.prefix_cache, runtime.page_size
    for r in reqs:
        n = r.num_computed // ps
        if n:
            cache.insert(r.token_range(0, n * ps), r.pages[:n])


def release_request(runtime, req) -> None:
    """Cache a finished request's full pages (with a cache) and drop the request's reference on every page."""
    if runtime.prefix_cache is not None:
        cache_computed(runtime, [req])
    runtime.allocator.free(req.pages)
    req.pages = []
    req.finished = True
