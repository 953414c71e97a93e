"""PrefixCache under random workloads, against an independent model: a dict from token prefix (whole pages) to page.

Requests arrive (matching their cached prefix and allocating the rest, evicting to make room), share their full
pages while running, finish, and the cache evicts on demand. After every step: each page's reference count is
exactly the number of live requests holding it plus one if cached (no leak, no double free); the cache maps
exactly the model's prefixes to the model's pages; a page a live request holds is never evicted; a twin
allocator and cache fed the same calls hold the same digest (SPMD). At the end every page is free again.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dtkv import AllocationError, PageAllocator, PageOwnership, PrefixCache

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # 3 token ids: prefixes are shared often


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        cp=st.sampled_from([1, 2, 3]),
        num_pages=st.integers(4, 20),
        page_size=st.sampled_from([1, 2, 3]),
        scheme=st.sampled_from(["interleave", "block"]),
    )
    def setup(self, cp, num_pages, page_size, scheme):
        self.ps = page_size
        self.own = PageOwnership(cp, num_pages, scheme)
        self.twins = []
        for _ in range(2):
            alloc = PageAllocator(self.own)
            self.twins.append((alloc, PrefixCache(alloc, page_size)))
        self.alloc, self.cache = self.twins[0]
        self.model: dict[tuple[int, ...], int] = {}  # token prefix (whole pages) -> cached page
        self.live: dict[int, tuple[list[int], list[int]]] = {}  # request -> (tokens, pages it holds)
        self.next_rid = 0

    def _both(self, fn):
        """Call ``fn(alloc, cache)`` on both twins; they must return the same."""
        out = [fn(a, c) for a, c in self.twins]
        assert out[0] == out[1], out
        return out[0]

    def _expected_match(self, tokens, max_pages):
        pages = []
        for i in range(min(len(tokens) // self.ps, max_pages)):
            page = self.model.get(tuple(tokens[: (i + 1) * self.ps]))
            if page is None:
                break
            pages.append(page)
        return pages

    def _insert(self, tokens, pages):
        n = len(tokens) // self.ps
        self._both(lambda a, c: c.insert(tokens[: n * self.ps], pages[:n]))
        for i in range(n):
            self.model.setdefault(tuple(tokens[: (i + 1) * self.ps]), pages[i])

    @rule(tokens=TOKENS, cap=st.integers(0, 5))
    def arrive(self, tokens, cap):
        matched = self._both(lambda a, c: c.match(tokens, max_pages=cap))
        assert matched == self._expected_match(tokens, cap)
        need = -(-len(tokens) // self.ps) - len(matched)
        held_before = {p for _, pages in self.live.values() for p in pages}
        evicted = self._both(lambda a, c: c.make_room(need))
        assert not set(evicted) & (held_before | set(matched)), "evicted a page a live request holds"
        for key in [k for k, p in self.model.items() if p in evicted]:
            del self.model[key]
        try:
            new = self._both(lambda a, c: a.alloc_balanced(need).tolist())
        except AllocationError:  # every page is held: the request is turned away, its matched pages released
            self._both(lambda a, c: a.free(matched))
            return
        self.live[self.next_rid] = (list(tokens), matched + new)
        self.next_rid += 1

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def share_running(self, data):
        tokens, pages = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self._insert(tokens, pages)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), cache_it=st.booleans())
    def finish(self, data, cache_it):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, pages = self.live.pop(rid)
        if cache_it:
            self._insert(tokens, pages)
        self._both(lambda a, c: a.free(pages))

    @rule(n=st.integers(0, 6), data=st.data())
    def evict(self, n, data):
        owner = data.draw(st.none() | st.integers(0, self.own.cp_size - 1))
        held = {p for _, pages in self.live.values() for p in pages}
        evictable = self.cache.num_evictable(owner)
        evicted = self._both(lambda a, c: c.evict(n, owner=owner))
        if owner is None:
            assert len(evicted) == min(n, evictable)
        else:
            assert len(evicted) <= min(n, evictable)
            assert all(self.own.owner(p) == owner for p in evicted)
        assert not set(evicted) & held, "evicted a page a live request holds"
        for key in [k for k, p in self.model.items() if p in evicted]:
            del self.model[key]

    @invariant()
    def references_and_contents_match_the_model(self):
        if not hasattr(self, "cache"):
            return
        holders = {}
        for _, pages in self.live.values():
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
        for p in self.model.values():
            holders[p] = holders.get(p, 0) + 1
        for p in range(self.own.num_pages):
            assert self.alloc.refcount(p) == holders.get(p, 0), (p, self.alloc.refcount(p), holders.get(p, 0))
        assert self.cache.cached_pages() == sorted(self.model.values())
        for key, page in self.model.items():
            assert self.cache.lookup(key)[-1] == page
            for i in range(1, len(key) // self.ps):  # only leaves go: every cached prefix keeps its shorter ones
                assert key[: i * self.ps] in self.model, "a page was evicted below a cached longer prefix"
        assert self.twins[0][1].digest() == self.twins[1][1].digest()

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for tokens, pages in self.live.values():
            self._insert(tokens, pages)
            self._both(lambda a, c, pages=pages: a.free(pages))
        self._both(lambda a, c: c.clear())
        assert self.cache.num_pages == 0 and self.alloc.num_free() == self.own.num_pages, "pages leaked"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
