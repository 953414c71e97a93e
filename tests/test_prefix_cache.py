"""PrefixCache: longest full-page matches, one reference per holder, LRU leaf eviction that never frees a page in
use, owner classes first, input checks that change nothing, and an SPMD digest.

``page_size`` is 3 (odd, so partial pages are easy to build); token ids are small ints written out by hand.
"""

from __future__ import annotations

import pytest

from dtkv import PageAllocator, PageOwnership, PrefixCache

PS = 3


def _cache(cp=2, num_pages=16, scheme="interleave", reserved=()):
    alloc = PageAllocator(PageOwnership(cp, num_pages, scheme), reserved=reserved)
    return alloc, PrefixCache(alloc, PS)


def _request(alloc, cache, tokens, owners=None):
    """A request's pages: its cached prefix (matched) then newly allocated pages for its other full pages."""
    pages = cache.match(tokens)
    rest = len(tokens) // PS - len(pages)
    new = alloc.alloc(owners[len(pages) :]) if owners else alloc.alloc_balanced(rest)
    return pages + new.tolist()


A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # three full pages and one token
B = [1, 2, 3, 4, 5, 6, 0, 0, 0]  # shares A's first two pages


def test_match_returns_the_longest_cached_prefix_of_full_pages():
    alloc, cache = _cache()
    pages = _request(alloc, cache, A)
    assert cache.insert(A, pages) == 3  # the partial fourth page (token 10) is never cached
    assert cache.num_pages == 3 and cache.cached_pages() == sorted(pages)
    assert cache.lookup(A) == pages
    assert cache.lookup(B) == pages[:2]
    assert cache.lookup(A[:8]) == pages[:2]  # only whole pages match
    assert cache.lookup(A, max_pages=1) == pages[:1]
    assert cache.lookup([9, 9, 9, 1]) == [] and cache.lookup([]) == []
    assert cache.lookup([2, 1, 3]) == []  # same tokens, other order: another page


def test_every_holder_has_one_reference_and_the_last_one_frees_the_page():
    alloc, cache = _cache()
    a = _request(alloc, cache, A)
    cache.insert(A, a)
    assert [alloc.refcount(p) for p in a] == [2, 2, 2]  # request + cache
    alloc.free(a)  # the request ends
    assert [alloc.refcount(p) for p in a] == [1, 1, 1] and not any(alloc.is_free(p) for p in a)
    b = cache.match(B)
    assert b == a[:2] and [alloc.refcount(p) for p in a] == [2, 2, 1]
    assert cache.stats["matched_pages"] == 2
    assert cache.evict(3) == [a[2]]  # only the leaf nobody else holds
    assert alloc.is_free(a[2]) and alloc.refcount(a[0]) == 2
    alloc.free(b)
    assert cache.clear() == [a[1], a[0]]  # leaf first, then its parent
    assert alloc.num_free() == 16 and cache.num_pages == 0


def test_insert_keeps_the_cached_page_when_another_request_computed_the_same_tokens():
    alloc, cache = _cache()
    first = alloc.alloc_balanced(3).tolist()
    second = alloc.alloc_balanced(3).tolist()  # the same prompt, computed in the same batch (no hit)
    cache.insert(A, first)
    assert cache.insert(A + [11, 12], second + [alloc.alloc([0]).item()]) == 1  # only the new fourth page
    path = cache.lookup(A + [11, 12])
    assert path[:3] == first and path[3] not in second
    assert [alloc.refcount(p) for p in second] == [1, 1, 1]  # left to its holder, freed when it ends
    alloc.free(second)
    assert all(alloc.is_free(p) for p in second)


def test_eviction_is_lru_leaves_first_ties_by_page_and_never_a_page_in_use():
    alloc, cache = _cache(cp=1, num_pages=12)
    x = alloc.alloc_balanced(2).tolist()  # [0, 1]
    y = alloc.alloc_balanced(2).tolist()  # [2, 3]
    z = alloc.alloc_balanced(1).tolist()  # [4]
    cache.insert([1, 1, 1, 2, 2, 2], x)
    cache.insert([1, 1, 1, 2, 2, 2, 3, 3, 3], x + z)  # z below x: x[1] is no longer a leaf
    cache.insert([5, 5, 5, 6, 6, 6], y)
    alloc.free(x + y + z)
    held = cache.match([5, 5, 5, 6, 6, 6])  # a live request holds y; also makes y the most recent
    assert cache.num_evictable() == 3 and cache.num_evictable(owner=0) == 3
    assert cache.evict(10) == [4, 1, 0]  # z (least recent leaf), then x[1], x[0]; y is in use
    assert cache.cached_pages() == [2, 3]
    alloc.free(held)
    assert cache.evict(1) == [3] and cache.evict(5) == [2]


def test_equal_last_use_evicts_the_lower_page_first():
    alloc, cache = _cache(cp=1, num_pages=8)
    pages = alloc.alloc_balanced(2).tolist()
    cache.insert([1, 1, 1, 7, 7, 7], pages)  # one insert: both pages share one clock value
    other = alloc.alloc_balanced(1).tolist()
    cache.insert([1, 1, 1, 8, 8, 8], [pages[0], other[0]])  # sibling leaf, newer
    alloc.free(pages + other)
    assert cache.evict(3) == [pages[1], other[0], pages[0]]


def test_make_room_evicts_the_short_owner_class_first_then_any_leaf():
    """cp=2 interleave: even pages live on rank 0, odd pages on rank 1."""
    alloc, cache = _cache(cp=2, num_pages=8)
    old = alloc.alloc([1, 1]).tolist()  # [1, 3]: least recently used, rank 1
    new = alloc.alloc([0, 0]).tolist()  # [0, 2]: rank 0
    cache.insert([1, 1, 1], old[:1])
    cache.insert([2, 2, 2], old[1:])
    cache.insert([3, 3, 3], new[:1])
    cache.insert([4, 4, 4], new[1:])
    alloc.free(old + new)
    rest = alloc.alloc_balanced(alloc.num_free())  # the pool is full: 4 cached, 4 held elsewhere
    assert cache.make_room(0) == [] and cache.make_room(1, per_owner=[0, 0]) == [1]  # plain LRU
    assert cache.make_room(1, per_owner=[1, 0]) == [0]  # rank 0 short: its LRU leaf, not page 3
    assert alloc.num_free(0) == 1 and alloc.num_free(1) == 1
    assert cache.make_room(4, per_owner=[2, 0]) == [2, 3]  # rank 0 class first, then any for the total
    assert cache.make_room(5) == [] and cache.num_pages == 0  # nothing left to evict: the caller's alloc fails
    alloc.free(rest)
    assert alloc.num_free() == 8


def test_digest_is_equal_for_equal_calls_and_follows_every_change():
    runs = []
    for _ in range(2):
        alloc, cache = _cache()
        pages = _request(alloc, cache, A)
        cache.insert(A, pages)
        runs.append((alloc, cache, pages))
    (a1, c1, p1), (a2, c2, p2) = runs
    assert p1 == p2 and c1.digest() == c2.digest() and len(c1.digest()) == 32
    c1.lookup(B)
    assert c1.digest() == c2.digest()  # lookup changes nothing
    c1.match(B)
    assert c1.digest() != c2.digest()  # clock, last uses and references moved
    c2.match(B)
    assert c1.digest() == c2.digest()
    a1.retain([p1[0]])
    assert c1.digest() != c2.digest()  # the allocator's references are part of the state


REJECTED = [
    ("short pages", lambda a, c, p: c.insert(A, p[:2]), ValueError,
     "pages must hold one page per full page of token_ids (3 = 9 tokens // page_size=3), got 2 pages"),
    ("free page", lambda a, c, p: c.insert(A, p[:2] + [9]), ValueError,
     "insert(token_ids, pages) got pages[2]=9, which is free (the caller must hold every page it inserts); "
     "nothing was cached"),
    ("padding page", lambda a, c, p: c.insert(B, p[:2] + [-1]), ValueError,
     "insert(token_ids, pages) got pages[2]=-1, outside the pool's pages [0, 16); nothing was cached"),
    ("reserved page", lambda a, c, p: c.insert(B, p[:2] + [15]), ValueError,
     "insert(token_ids, pages) got pages[2]=15, which is reserved (never allocated); nothing was cached"),
    ("cached elsewhere", lambda a, c, p: c.insert([7, 7, 7, 8, 8, 8], [p[3], p[1]]), ValueError,
     "insert(token_ids, pages) got pages[1]=1, which the cache already holds for another prefix (a page holds "
     "the KV of one token prefix); nothing was cached"),
    ("repeated page", lambda a, c, p: c.insert([7, 7, 7, 8, 8, 8], [p[3], p[3]]), ValueError,
     "insert(token_ids, pages) got pages[1]=4, a second time (a page holds the KV of one token prefix); "
     "nothing was cached"),
    ("negative token", lambda a, c, p: c.match([1, -2, 3]), ValueError, "token_ids must be >= 0, got token_ids[1]=-2"),
    ("float token", lambda a, c, p: c.lookup([1.0]), TypeError, "token_ids must hold ints, got 1.0 (float)"),
    ("max_pages", lambda a, c, p: c.match(A, max_pages=-1), ValueError, "max_pages must be >= 0, got max_pages=-1"),
    ("evict count", lambda a, c, p: c.evict(-1), ValueError, "num_pages must be >= 0, got num_pages=-1"),
    ("evict owner", lambda a, c, p: c.evict(1, owner=2), ValueError, "owner must be a rank in [0, 2), got owner=2"),
    ("per_owner", lambda a, c, p: c.make_room(20, per_owner=[20]), ValueError,
     "per_owner must hold one count per rank (2), got 1 counts"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "call", "exc", "msg"), REJECTED, ids=[r[0] for r in REJECTED])
def test_rejects_bad_input_naming_it_and_changes_nothing(what, call, exc, msg):
    alloc, cache = _cache(reserved=[15])
    pages = alloc.alloc([0, 1, 0, 0]).tolist()  # [0, 1, 2, 4]; 4 is not cached
    cache.insert(A, pages[:3])
    before = (cache.digest(), cache.cached_pages(), dict(cache.stats), alloc.digest())
    with pytest.raises(exc) as e:
        call(alloc, cache, pages)
    assert str(e.value) == msg
    assert (cache.digest(), cache.cached_pages(), dict(cache.stats), alloc.digest()) == before


def test_rejects_a_non_allocator_and_a_bad_page_size():
    with pytest.raises(TypeError, match="allocator must be a PageAllocator, got PageOwnership"):
        PrefixCache(PageOwnership(2, 4), 3)
    with pytest.raises(ValueError, match="page_size must be >= 1, got page_size=0"):
        PrefixCache(PageAllocator(PageOwnership(2, 4)), 0)
