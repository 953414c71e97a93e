"""The undo log (:mod:`dtkv._journal`): any sequence of allocator and prefix-cache calls made while a journal is
attached is undone exactly by its rollback -- the allocator's digest (free pages, reference counts, cursor) and
every reference count, the cache's digest (tree, clock, last uses), its pages and ``stats`` are those of before,
and the next calls give what they would have given (heaps in the same order). Also :meth:`PrefixCache.discard`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtkv import AllocationError, PageAllocator, PageOwnership, PrefixCache
from dtkv._journal import Journal

PS = 2
OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "balanced", "match", "insert", "free", "evict", "make_room", "retain", "clear"]),
        st.integers(0, 40),
        st.lists(st.integers(0, 2), min_size=1, max_size=9),
    ),
    max_size=25,
)


def _state(alloc: PageAllocator, cache: PrefixCache) -> tuple:
    leaves = sorted(p for p, n in cache._by_page.items() if not n.children)
    assert sorted(cache._leaves) == leaves, "the eviction candidates are exactly the nodes without children"
    refs = [alloc.refcount(p) for p in range(alloc.ownership.num_pages)]
    return alloc.digest(), refs, cache.digest(), cache.cached_pages(), dict(cache.stats), alloc.num_free()


def _apply(op, n, tokens, alloc: PageAllocator, cache: PrefixCache, held: list[list[int]]) -> None:
    """One call; what it cannot do (no free page, nothing held) is skipped or refused, as a caller would see."""
    try:
        if op == "alloc":
            held.append(alloc.alloc([n % alloc.ownership.cp_size] * (1 + n % 3)).tolist())
        elif op == "balanced":
            held.append(alloc.alloc_balanced(n % 4).tolist())
        elif op == "match":
            held.append(cache.match(tokens))
        elif op == "insert" and held:
            pages = held[n % len(held)]
            k = min(len(pages), len(tokens) // PS)
            if k:
                cache.insert(tokens[: k * PS], pages[:k])
        elif op == "free" and held:
            alloc.free(held.pop(n % len(held)))
        elif op == "retain" and held and held[n % len(held)]:
            alloc.retain(held[n % len(held)])
            held.append(list(held[n % len(held)]))
        elif op == "evict":
            cache.evict(n % 5, owner=None if n % 2 else n % alloc.ownership.cp_size)
        elif op == "make_room":
            cp = alloc.ownership.cp_size
            cache.make_room(n % 7, [(n + r) % 3 for r in range(cp)] if n % 2 else None)
        elif op == "clear":
            cache.clear()
    except (AllocationError, ValueError):  # refused calls change nothing (their own tests say so)
        pass


@settings(max_examples=150, deadline=None)
@given(cp=st.sampled_from([1, 2, 3]), num_pages=st.integers(3, 16), before=OPS, during=OPS, after=OPS)
def test_rollback_restores_the_allocator_and_the_cache_exactly(cp, num_pages, before, during, after):
    runs = []
    for undo in (True, False):
        alloc = PageAllocator(PageOwnership(cp, num_pages))
        cache = PrefixCache(alloc, PS)
        held: list[list[int]] = []
        for op in before:
            _apply(*op, alloc, cache, held)
        snap, snap_held = _state(alloc, cache), [list(h) for h in held]
        if undo:
            journal = Journal()
            alloc.journal = cache.journal = journal
            for op in during:
                _apply(*op, alloc, cache, held)
            alloc.journal = cache.journal = None
            journal.rollback()
            assert len(journal) == 0
            held = snap_held
            assert _state(alloc, cache) == snap
        for op in after:  # the same calls give the same results as if nothing had happened in between
            _apply(*op, alloc, cache, held)
        runs.append((_state(alloc, cache), held))
    assert runs[0] == runs[1]


def test_discard_drops_an_entry_and_every_longer_prefix_through_it():
    alloc = PageAllocator(PageOwnership(1, 8))
    cache = PrefixCache(alloc, PS)
    a = alloc.alloc([0, 0, 0]).tolist()
    b = alloc.alloc([0]).tolist()
    cache.insert([1, 1, 2, 2, 3, 3], a)  # a[0] -> a[1] -> a[2]
    cache.insert([1, 1, 5, 5], [a[0], b[0]])  # a[0] -> b[0]
    alloc.free(a + b)  # only the cache holds them
    assert cache.discard([a[1], 99]) == [a[2], a[1]]  # children first; an uncached page is ignored
    assert cache.cached_pages() == sorted([a[0], b[0]]) and alloc.is_free(a[1]) and alloc.is_free(a[2])
    assert cache.lookup([1, 1, 2, 2, 3, 3]) == [a[0]] and cache.lookup([1, 1, 5, 5]) == [a[0], b[0]]
    assert cache.stats["evicted_pages"] == 2
    with pytest.raises(TypeError, match="pages must hold ints"):
        cache.discard([1.5])


@pytest.mark.parametrize("change", ["clear", "evict_one", "discard", "insert_below", "match"])
def test_rollback_of_each_tree_change_on_a_branching_tree(change):
    """A tree with a shared first page and two branches, only the cache holding it (every page evictable): each
    kind of change undone leaves the same tree, candidates, clock, counters and allocator."""
    alloc = PageAllocator(PageOwnership(2, 12))
    cache = PrefixCache(alloc, PS)
    a, b = alloc.alloc_balanced(3).tolist(), alloc.alloc_balanced(1).tolist()
    cache.insert([1, 1, 2, 2, 3, 3], a)
    cache.insert([1, 1, 4, 4], [a[0], b[0]])
    alloc.free(a + b)
    snap = _state(alloc, cache)
    journal = Journal()
    alloc.journal = cache.journal = journal
    if change == "clear":
        assert len(cache.clear()) == 4
    elif change == "evict_one":
        cache.evict(1)
    elif change == "discard":
        cache.discard([a[0]])
    elif change == "insert_below":
        held = cache.match([1, 1, 4, 4])
        cache.insert([1, 1, 4, 4, 5, 5], held + alloc.alloc([1]).tolist())
    else:
        cache.match([1, 1, 2, 2, 9])
    assert _state(alloc, cache) != snap and len(journal)
    alloc.journal = cache.journal = None
    journal.rollback()
    assert _state(alloc, cache) == snap
