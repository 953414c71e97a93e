"""Prefix cache under CP: a radix tree over full pages of token ids, sharing logical pages by reference count.

Entry point: :class:`PrefixCache` (``match`` / ``insert`` / ``evict`` / ``make_room`` / ``digest``).

**Why reuse needs no resharding.** A logical page's storage owner is a pure function of the page id
(:class:`dtkv.PageOwnership`), so a cached page stays where it is: a later request that reuses it reads it as
history through the same materialization as any prefix page, whatever split computed it. Every rank holds an
identical cache over logical pages and feeds it the same calls in the same order (SPMD), exactly like
:class:`dtkv.PageAllocator`; no rank ever asks another what is cached.

**The tree.** Each edge is one *full* page: the ``page_size`` token ids it holds. A node maps the token prefix of
its path to the logical page holding that page's KV. A page's KV depends only on the token ids up to its end, so
any page found at a path is bitwise what recomputing it would write (given a deterministic model; the engine's
parity tests check this). The cache holds one reference on each cached page (:meth:`PageAllocator.retain`);
:meth:`match` adds one for the caller, who drops it with :meth:`PageAllocator.free` when its request ends. A page
is therefore free only when no request and no cache entry holds it.

**A partially filled last page is never cached.** A new request whose cached prefix ends at a page boundary
recomputes the tokens after the boundary (at most ``page_size - 1`` of them) rather than copying the old partial
page and appending to the copy (copy-on-write). What each costs, at DeepSeek-V3.2 geometry (656-byte fp8 MLA row
+ 132 bytes of indexer K and scale per token and layer, 61 layers, page size 64: 48,068 bytes per token, 3,076,352
bytes = 2.93 MiB per page over all layers):

====================  ==========================================  ===============================================
cost                  copy-on-write of the partial page            recompute from the page boundary (chosen)
====================  ==========================================  ===============================================
bytes moved           2.93 MiB read + 2.93 MiB written per reuse;  none
                      when the page's owner is not the rank that
                      computes the extend's first tokens (rank 0
                      of zigzag: ``cp - 1`` of ``cp`` times under
                      ``interleave``) a 2.93 MiB cross-rank copy
                      inside the plan phase
bytes held            the cached partial page and its copy         nothing extra; partial pages are not cached
compute               none                                         <= 63 tokens (31.5 on average) at ~74 GFLOP
                                                                   each (2 x 37B active parameters): <= 0.19% of
                                                                   a 32K-token extend, <= 0.77% of an 8K chunk
split alignment       the extend starts mid-page: its first page   the extend starts on a page boundary: the
                      is computed by rank 0 but stored by the old  page-aligned zigzag split gives every page one
                      page's owner (a handoff page: all-gather +   compute owner, allocated on that rank, so every
                      owner-filtered write) or needs the copy      row is a direct write
                      above
tree                  partial-page nodes that later requests can   one node per full page; a match is a walk of
                      extend only by another copy                  whole pages
====================  ==========================================  ===============================================

In wall time a single 2.93 MiB copy (~1.3 us of HBM bandwidth) is cheaper than recomputing 63 tokens of a short
extend; CP prefill exists for long extends, where the recomputed tokens are noise, and recomputation is what
keeps the one-compute-owner rule, the tree and the plan phase (no copies, no collectives) simple.

**Eviction.** When an allocation would fail, :meth:`make_room` evicts least-recently-used *leaves* whose page
only the cache holds (reference count 1): a page a live request holds is never evicted, and a page is evicted
only after every longer prefix through it. The order is deterministic: a logical clock (one tick per
:meth:`match` / :meth:`insert`, never wall time) orders the leaves, ties by page id. When the allocation needs
pages of given owner classes (compute-owner direct writes), leaves of each short class are evicted first, which
keeps per-owner free counts where the allocation needs them; only then is any leaf evicted for the total.

**SPMD check.** :meth:`digest` hashes the tree (paths, pages, clock values), the clock and the allocator's state
(free pages, reference counts); :meth:`check_agreement` compares it across the CP group in one fixed-size
collective (:func:`dtkv._agree.agree`) and raises :class:`PrefixCacheMismatchError` on every rank together when
ranks diverged. The runtime calls it after every step under ``DTKV_DEBUG``.

**Undo.** While a :class:`dtkv._journal.Journal` is attached (:attr:`PrefixCache.journal`, with the same journal on
the allocator), every :meth:`match`, :meth:`insert` and :meth:`evict` records its undo (tree, clock, last uses,
``stats``), so a step that fails on any rank puts the cache back on every rank. :meth:`discard` drops entries
whose pages no longer hold their KV (a failed step wrote into pages it had evicted).
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dtkv._agree import agree
from dtkv._checks import check_int
from dtkv._util import as_int_list
from dtkv.allocator import PageAllocator

if TYPE_CHECKING:
    from dtkv._journal import Journal

__all__ = ["PrefixCache", "PrefixCacheMismatchError"]


class PrefixCacheMismatchError(RuntimeError):
    """Ranks of one CP group hold different prefix cache states (the SPMD contract was broken)."""


class _Node:
    """One cached page: the ``page_size`` token ids of the edge into it and the logical page holding their KV."""

    __slots__ = ("children", "depth", "key", "last_access", "page", "parent")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = last_access


class PrefixCache:
    """Radix tree over full pages of token ids -> logical pages, with LRU eviction (module docstring).

    Every rank of a CP group builds one over its (identical) allocator and makes the same calls in the same
    order. Host-side only (plan phase); no call touches a tensor of the pools.

    Args:
        allocator: the SPMD page allocator whose pages are cached; the cache holds one reference per page.
        page_size: tokens per page (>= 1).

    Example::

        cache = PrefixCache(allocator, page_size=64)
        pages = cache.match(prompt, max_pages=(len(prompt) - 1) // 64)  # caller now holds these pages
        ...                                                             # compute the rest, in new pages
        cache.insert(tokens[: n_full * 64], req_pages[:n_full])         # share the finished full pages
        allocator.free(req_pages)                                       # the request's references
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.page_size = check_int("page_size", page_size, min_value=1)
        self._root = _Node((), -1, None, 0)
        self._by_page: dict[int, _Node] = {}
        self._leaves: dict[int, _Node] = {}  # page -> node without children: eviction scans only these
        self._clock = 0
        # running totals: pages handed out by match, newly cached by insert, evicted
        self.stats = {"matched_pages": 0, "inserted_pages": 0, "evicted_pages": 0}
        self.journal: Journal | None = None
        """While set, every change records its undo here (module docstring: Undo)."""

    # ------------------------------------------------------------------------------------------ queries
    @property
    def num_pages(self) -> int:
        """Pages the cache holds."""
        return len(self._by_page)

    @property
    def clock(self) -> int:
        """The logical LRU clock: ticks once per :meth:`match` and :meth:`insert`."""
        return self._clock

    def cached_pages(self) -> list[int]:
        """Every cached logical page, ascending."""
        return sorted(self._by_page)

    def lookup(self, token_ids: Sequence[int] | torch.Tensor, *, max_pages: int | None = None) -> list[int]:
        """The pages of the longest cached prefix of ``token_ids``, in token order; changes nothing.

        Only whole pages match: ``len(result) <= len(token_ids) // page_size`` (and ``<= max_pages``).
        """
        return [n.page for n in self._walk(self._keys("token_ids", token_ids, max_pages))]

    def num_evictable(self, owner: int | None = None) -> int:
        """Pages repeated :meth:`evict` calls without an owner could free now: cached pages that neither a request
        nor a longer cached prefix through them (one a request holds) keeps; with ``owner``, those of them
        stored on that rank."""
        self._check_owner(owner)
        order, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        evictable: dict[int, bool] = {}
        count = 0
        for node in reversed(order):  # children before parents
            ok = self.allocator.refcount(node.page) == 1 and all(evictable[id(c)] for c in node.children.values())
            evictable[id(node)] = ok
            if ok and (owner is None or self.allocator.ownership.owner(node.page) == owner):
                count += 1
        return count

    # ------------------------------------------------------------------------------------------ updates
    def match(self, token_ids: Sequence[int] | torch.Tensor, *, max_pages: int | None = None) -> list[int]:
        """The pages of the longest cached prefix of ``token_ids``; the caller gets one reference on each.

        Marks the matched path as used now (LRU). The caller releases its references with
        :meth:`PageAllocator.free` (or :meth:`PageAllocator.release`) when it is done with the pages.

        Args:
            token_ids: the request's token ids (ints, or an integer tensor of any shape, flattened).
            max_pages: match at most this many pages (e.g. ``(len(prompt) - 1) // page_size`` so that at least
                one token is left to compute); default no limit.

        Returns:
            Logical pages ``[k]`` in token order, ``k <= len(token_ids) // page_size``; ``[]`` on a miss.
        """
        path = self._walk(self._keys("token_ids", token_ids, max_pages))
        pages = [n.page for n in path]
        self.allocator.retain(pages)
        self._touch(path)
        self._count("matched_pages", len(pages))
        return pages

    def _count(self, counter: str, n: int) -> None:
        """Add ``n`` to ``stats[counter]`` (journaled)."""
        self.stats[counter] += n
        if self.journal is not None and n:
            self.journal.record(lambda: self.stats.__setitem__(counter, self.stats[counter] - n))

    def insert(self, token_ids: Sequence[int] | torch.Tensor, pages: Sequence[int] | torch.Tensor) -> int:
        """Cache the full pages of ``token_ids`` (a partial last page is left out); returns pages newly cached.

        ``pages[i]`` must hold the KV of ``token_ids[i * page_size : (i + 1) * page_size]``. Where the path
        already holds a page, that page stays cached and the given one is left to its holder (two requests that
        computed the same tokens); every newly cached page gets one reference held by the cache. The whole path
        is marked as used now. All or nothing: a bad page changes nothing.

        Raises:
            ValueError: ``pages`` is shorter than the full pages of ``token_ids``; one of them is outside the pool,
                reserved, free (the caller must hold its pages) or repeated; a page to be cached is cached
                already for another prefix.
        """
        keys = self._keys("token_ids", token_ids, None)
        plist = as_int_list("pages", pages)
        if len(plist) < len(keys):
            raise ValueError(
                f"pages must hold one page per full page of token_ids ({len(keys)} = {len(keys) * self.page_size} "
                f"tokens // page_size={self.page_size}), got {len(plist)} pages"
            )
        alloc = self.allocator
        num_pages = alloc.ownership.num_pages
        seen: set[int] = set()
        for i, p in enumerate(plist[: len(keys)]):
            rule = ""
            if not 0 <= p < num_pages:
                rule = f"outside the pool's pages [0, {num_pages})"
            elif p in alloc.reserved:
                rule = "which is reserved (never allocated)"
            elif alloc.refcount(p) == 0:
                rule = "which is free (the caller must hold every page it inserts)"
            elif p in seen:
                rule = "a second time (a page holds the KV of one token prefix)"
            if rule:
                raise ValueError(f"insert(token_ids, pages) got pages[{i}]={p}, {rule}; nothing was cached")
            seen.add(p)
        path = self._walk(keys)
        new = plist[len(path) : len(keys)]
        for i, p in enumerate(new, start=len(path)):
            if p in self._by_page:
                raise ValueError(
                    f"insert(token_ids, pages) got pages[{i}]={p}, which the cache already holds for another prefix "
                    "(a page holds the KV of one token prefix); nothing was cached"
                )
        alloc.retain(new)
        self._touch(path)
        top = path[-1] if path else self._root
        top_was_leaf = top.page in self._leaves
        created, parent = [], top
        for key, p in zip(keys[len(path) :], new):
            node = _Node(key, p, parent, self._clock)
            parent.children[key] = node
            self._by_page[p] = node
            self._leaves.pop(parent.page, None)
            self._leaves[p] = node
            created.append(node)
            parent = node
        self.stats["inserted_pages"] += len(new)
        if self.journal is not None and created:
            self.journal.record(lambda: self._uninsert(created, top, top_was_leaf))
        return len(new)

    def _touch(self, path: list[_Node]) -> None:
        """Tick the clock and mark ``path`` as used now (journaled)."""
        if self.journal is not None:
            clock, uses = self._clock, [(n, n.last_access) for n in path]

            def undo() -> None:
                self._clock = clock
                for n, t in uses:
                    n.last_access = t

            self.journal.record(undo)
        self._clock += 1
        for node in path:
            node.last_access = self._clock

    def _uninsert(self, created: list[_Node], top: _Node, top_was_leaf: bool) -> None:
        """Undo of :meth:`insert`'s new nodes (the allocator's journal gives their references back)."""
        for node in reversed(created):
            assert node.parent is not None and not node.children, "undo of insert: a new node is a leaf again"
            del node.parent.children[node.key]
            del self._by_page[node.page]
            self._leaves.pop(node.page, None)
        if top_was_leaf:
            self._leaves[top.page] = top
        self.stats["inserted_pages"] -= len(created)

    def evict(self, num_pages: int, *, owner: int | None = None) -> list[int]:
        """Evict up to ``num_pages`` least-recently-used leaves that only the cache holds; returns their pages.

        Leaves go in (last use, page id) order; a parent whose last child went becomes a candidate. With
        ``owner``, only pages stored on that rank are evicted (possibly fewer than asked). Evicted pages whose
        last reference was the cache's are free afterwards.
        """
        check_int("num_pages", num_pages, min_value=0)
        self._check_owner(owner)
        heap = [(n.last_access, n.page, n) for n in self._leaves.values() if self._evictable(n, owner)]
        heapq.heapify(heap)
        out: list[int] = []
        removed: list[tuple[_Node, bool]] = []
        while heap and len(out) < num_pages:
            _, page, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None, "the root is never a candidate"
            removed.append((node, self._remove_leaf(node)))
            out.append(page)
            if parent is not self._root and not parent.children and self._evictable(parent, owner):
                heapq.heappush(heap, (parent.last_access, parent.page, parent))
        self._forget(removed, "evicted_pages")
        return out

    def discard(self, pages: Sequence[int]) -> list[int]:
        """Drop the entries of the cached ``pages`` and of every longer prefix through them (their KV is no longer
        what the tokens wrote: a failed step wrote into pages it had evicted); pages not cached are ignored. The
        cache's references go (a page no request holds is free afterwards). Returns the dropped pages, children
        first. Counted as evicted in ``stats``."""
        seen: dict[int, _Node] = {}  # page -> node, children before parents
        for p in as_int_list("pages", pages):
            node = self._by_page.get(p)
            if node is None or p in seen:
                continue
            stack, sub = [node], []
            while stack:  # preorder: a node before its children; reversed, every child before its parent
                n = stack.pop()
                sub.append(n)
                stack.extend(n.children[k] for k in sorted(n.children))
            for n in reversed(sub):
                seen.setdefault(n.page, n)
        order = list(seen.values())
        removed = [(n, self._remove_leaf(n)) for n in order]
        self._forget(removed, "evicted_pages")
        return [n.page for n in order]

    def _remove_leaf(self, node: _Node) -> bool:
        """Unlink a node without children; returns whether its parent became a leaf."""
        parent = node.parent
        assert parent is not None and not node.children, "only a leaf below the root is removed"
        del parent.children[node.key]
        del self._by_page[node.page]
        self._leaves.pop(node.page, None)
        if parent is not self._root and not parent.children:
            self._leaves[parent.page] = parent
            return True
        return False

    def _forget(self, removed: list[tuple[_Node, bool]], counter: str) -> None:
        """Release the cache's references on the removed nodes' pages, count them, journal the undo."""
        if self.journal is not None and removed:
            self.journal.record(lambda: self._relink(removed, counter))
        self.allocator.release([n.page for n, _ in removed])
        self.stats[counter] += len(removed)

    def _relink(self, removed: list[tuple[_Node, bool]], counter: str) -> None:
        """Undo of removals: the nodes back in the tree, newest removal first (the allocator's journal gives their
        references back)."""
        for node, parent_became_leaf in reversed(removed):
            parent = node.parent
            assert parent is not None, "a removed node keeps its parent"
            parent.children[node.key] = node
            self._by_page[node.page] = node
            self._leaves[node.page] = node
            if parent_became_leaf:
                self._leaves.pop(parent.page, None)
        self.stats[counter] -= len(removed)

    def make_room(self, total: int, per_owner: Sequence[int] | None = None) -> list[int]:
        """Evict so that an allocation of ``total`` pages (``per_owner[r]`` of them stored on rank ``r``) fits.

        First, for each owner class short of ``per_owner[r]`` free pages, that class's leaves (LRU); then, while
        fewer than ``total`` pages are free, any leaves (LRU). Stops early when nothing more is evictable (the
        allocation then fails or falls back as it would without a cache). Returns the evicted pages, in order.
        """
        check_int("total", total, min_value=0)
        alloc = self.allocator
        out: list[int] = []
        if per_owner is not None:
            wants = as_int_list("per_owner", per_owner, min_value=0)
            if len(wants) != alloc.ownership.cp_size:
                raise ValueError(
                    f"per_owner must hold one count per rank ({alloc.ownership.cp_size}), got {len(wants)} counts"
                )
            for r, want in enumerate(wants):
                short = want - alloc.num_free(r)
                if short > 0 and self._by_page:
                    out += self.evict(short, owner=r)
        short = total - alloc.num_free()
        if short > 0 and self._by_page:
            out += self.evict(short)
        return out

    def clear(self) -> list[int]:
        """Evict every page that only the cache holds (all of them when no request holds a cached page)."""
        return self.evict(len(self._by_page))

    # ------------------------------------------------------------------------------------------ SPMD
    def digest(self) -> bytes:
        """32-byte hash of the tree (paths, pages, last uses), the clock and the allocator's state."""
        h = hashlib.sha256()
        h.update(struct.pack("<qq", self.page_size, self._clock))
        h.update(self.allocator.digest().encode())
        stack = [self._root]
        while stack:  # depth-first, children in token order: the same bytes on every rank with the same tree
            node = stack.pop()
            h.update(struct.pack("<qqq", node.depth, node.page, node.last_access))
            h.update(struct.pack(f"<{len(node.key)}q", *node.key))
            stack.extend(node.children[k] for k in sorted(node.children, reverse=True))
        return h.digest()

    def check_agreement(self, group: dist.ProcessGroup | None) -> None:
        """Raise :class:`PrefixCacheMismatchError` on every rank unless all ranks of ``group`` hold equal state.

        Collective over ``group`` (one fixed-size all-gather); ``None`` or one rank is a no-op.
        """
        agree(None, group, what="prefix cache state", value=self.digest(), mismatch_error=PrefixCacheMismatchError)

    # ------------------------------------------------------------------------------------------ internals
    def _keys(self, name: str, token_ids: Sequence[int] | torch.Tensor, max_pages: int | None) -> list[tuple]:
        ids = as_int_list(name, token_ids, min_value=0)
        n = len(ids) // self.page_size
        if max_pages is not None:
            n = min(n, check_int("max_pages", max_pages, min_value=0))
        ps = self.page_size
        return [tuple(ids[i * ps : (i + 1) * ps]) for i in range(n)]

    def _walk(self, keys: list[tuple]) -> list[_Node]:
        path, node = [], self._root
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def _evictable(self, node: _Node, owner: int | None) -> bool:
        if node.children or self.allocator.refcount(node.page) != 1:
            return False
        return owner is None or self.allocator.ownership.owner(node.page) == owner

    def _check_owner(self, owner: int | None) -> None:
        if owner is None:
            return
        check_int("owner", owner)
        cp = self.allocator.ownership.cp_size
        if not 0 <= owner < cp:
            raise ValueError(f"owner must be a rank in [0, {cp}), got owner={owner}")
