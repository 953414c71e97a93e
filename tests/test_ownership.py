"""PageOwnership: the page map is a bijection, balanced, sentinel-preserving, and a well-behaved placement tag."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing._internal.common_utils import TestCase

from dtkv import PageOwnership

CPS = st.sampled_from([1, 2, 3, 4, 8])
SCHEMES = st.sampled_from(["interleave", "block"])
PAGES = st.one_of(st.integers(1, 9), st.integers(10, 300))


def _reference_owner_and_local(cp: int, num_pages: int, scheme: str) -> list[tuple[int, int]]:
    """Brute force: deal pages to ranks (interleave) or cut torch.chunk ranges (block)."""
    if scheme == "interleave":
        table, counts = [], [0] * cp
        for p in range(num_pages):
            r = p % cp
            table.append((r, counts[r]))
            counts[r] += 1
        return table
    chunks = torch.arange(num_pages).chunk(cp)
    table = [None] * num_pages
    for r, chunk in enumerate(chunks):
        for i, p in enumerate(chunk.tolist()):
            table[p] = (r, i)
    return table


@settings(max_examples=60, deadline=None)
@given(cp=CPS, num_pages=PAGES, scheme=SCHEMES)
def test_map_matches_reference_and_is_a_bijection(cp, num_pages, scheme):
    own = PageOwnership(cp, num_pages, scheme)
    pages = torch.arange(num_pages)
    owner, local = own.owner(pages), own.local_index(pages)
    ref = _reference_owner_and_local(cp, num_pages, scheme)
    assert list(zip(owner.tolist(), local.tolist())) == ref
    assert torch.equal(own.global_page(owner, local), pages)
    # every (rank, local) slot below num_local_pages(rank) is hit exactly once
    seen = set(zip(owner.tolist(), local.tolist()))
    assert len(seen) == num_pages
    assert sum(own.num_local_pages(r) for r in range(cp)) == num_pages
    for r in range(cp):
        n = own.num_local_pages(r)
        assert {(rr, i) for rr, i in seen if rr == r} == {(r, i) for i in range(n)}
        assert torch.equal(own.owner(own.local_pages(r)), torch.full((n,), r, dtype=torch.int64))
    # scalar ints agree with tensors
    p = num_pages - 1
    assert (own.owner(p), own.local_index(p)) == ref[p]


@settings(max_examples=40, deadline=None)
@given(cp=CPS, num_pages=PAGES)
def test_interleave_counts_differ_by_at_most_one(cp, num_pages):
    own = PageOwnership(cp, num_pages, "interleave")
    counts = [own.num_local_pages(r) for r in range(cp)]
    assert max(counts) - min(counts) <= 1
    assert own.max_local_pages == max(counts)


@settings(max_examples=40, deadline=None)
@given(cp=CPS, num_pages=PAGES, scheme=SCHEMES, dtype=st.sampled_from([torch.int32, torch.int64]))
def test_sentinel_is_preserved(cp, num_pages, scheme, dtype):
    own = PageOwnership(cp, num_pages, scheme)
    pages = torch.tensor([-1, 0, num_pages - 1, -1], dtype=dtype)
    for out in (
        own.owner(pages),
        own.local_index(pages),
        own.global_page(own.owner(pages), own.local_index(pages)),
    ):
        assert out.dtype == dtype
        assert out[0] == -1 and out[3] == -1
    assert own.owner(-1) == -1 and own.local_index(-1) == -1 and own.global_page(0, -1) == -1


def test_block_with_more_ranks_than_pages_has_empty_ranks():
    own = PageOwnership(4, 5, "block")  # torch.chunk(5, 4) -> sizes [2, 2, 1]
    assert [own.num_local_pages(r) for r in range(4)] == [2, 2, 1, 0]
    assert own.local_pages(3).numel() == 0


TORCH_2_13 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.parametrize(
    "form",
    [
        "spec",
        pytest.param(
            "placement",
            marks=pytest.mark.skipif(
                not TORCH_2_13, reason="Dynamo < 2.13 cannot call methods of a Placement subclass"
            ),
        ),
    ],
)
@pytest.mark.parametrize("scheme", ["interleave", "block"])
def test_methods_compile_without_graph_breaks(form, scheme):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    own = PageOwnership(3, 17, scheme)
    m = own.spec if form == "spec" else own
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def roundtrip(pages):
        return m.global_page(m.owner(pages), m.local_index(pages)), m.owner(pages)

    pages = torch.tensor([-1, 0, 5, 16])
    back, owner = roundtrip(pages)
    assert torch.equal(back, pages) and torch.equal(owner, own.owner(pages))
    assert counter.frame_count == 1


def test_spec_is_the_same_map():
    for own in (PageOwnership(4, 10), PageOwnership(3, 7, "block")):
        spec = own.spec
        pages = torch.arange(-1, own.num_pages)
        assert torch.equal(spec.owner(pages), own.owner(pages))
        assert torch.equal(spec.local_index(pages), own.local_index(pages))
        assert torch.equal(spec.global_page(spec.owner(pages), spec.local_index(pages)), pages)


def test_placement_tag_identity_and_pickling():
    a = PageOwnership(4, 10)
    assert a == PageOwnership(4, 10, "interleave") and hash(a) == hash(PageOwnership(4, 10))
    assert a != PageOwnership(4, 10, "block") and a != PageOwnership(2, 10) and a != PageOwnership(4, 11)
    assert len({a, PageOwnership(4, 10), PageOwnership(4, 10, "block")}) == 2
    assert pickle.loads(pickle.dumps(a)) == a and copy.deepcopy(a) == a
    assert not a.is_shard() and not a.is_replicate() and not a.is_partial()
    with pytest.raises(AttributeError):
        a.cp_size = 2


def test_to_standard_matches_upstream_placements():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert PageOwnership(4, 10, "block").to_standard() == Shard(0)
    assert PageOwnership(4, 12).to_standard() == _StridedShard(0, split_factor=3)
    with pytest.raises(ValueError, match="num_pages % cp_size == 0"):
        PageOwnership(4, 10).to_standard()


def test_check_pages_names_the_bad_value():
    own = PageOwnership(2, 8)
    own.check_pages("pages", torch.tensor([-1, 0, 7]))
    with pytest.raises(ValueError, match="containing 8"):
        own.check_pages("pages", torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="containing -1"):
        own.check_pages("pages", torch.tensor([-1]), allow_padding=False)


class TestPinnedText(TestCase):
    def test_repr_and_str(self):
        self.assertExpectedInline(
            repr(PageOwnership(4, 10)), """PageOwnership(cp_size=4, num_pages=10, scheme='interleave')"""
        )
        self.assertExpectedInline(str(PageOwnership(8, 64, "block")), """PO(b,8)""")

    def test_errors(self):
        with self.assertRaises(ValueError) as e:
            PageOwnership(2, 10, "round_robin")
        self.assertExpectedInline(
            str(e.exception), """scheme must be one of ('interleave', 'block'), got scheme='round_robin'"""
        )
        with self.assertRaises(ValueError) as e:
            PageOwnership(0, 10)
        self.assertExpectedInline(str(e.exception), """cp_size must be >= 1, got cp_size=0""")
        with self.assertRaises(TypeError) as e:
            PageOwnership(2, 10.0)
        self.assertExpectedInline(str(e.exception), """num_pages must be an int, got num_pages=10.0 (float)""")
        with self.assertRaises(ValueError) as e:
            PageOwnership(2, 10).num_local_pages(2)
        self.assertExpectedInline(str(e.exception), """rank must be < cp_size=2, got rank=2""")


# ----------------------------------------------------------------------------------------- vocabulary
def test_scheme_is_the_one_name():
    """``scheme`` names the ownership scheme (0.1's ``layout`` spelling, which meant a byte format elsewhere, is
    gone from the keyword, the placement and the spec)."""
    own = PageOwnership(4, 10, scheme="block")
    assert own.scheme == "block" and own == PageOwnership(4, 10, "block")
    assert own.pages_per_rank == 3 and own.spec.pages_per_rank == 3
    with pytest.raises(TypeError, match="layout"):
        PageOwnership(4, 10, layout="block")
    assert not hasattr(own, "layout")


def test_ownership_spec_fields():
    spec = PageOwnership(3, 7, "block").spec
    assert spec == (3, 7, "block") and spec.scheme == "block" and spec._fields == ("cp_size", "num_pages", "scheme")
    assert spec.pages_per_rank == 3 and not hasattr(spec, "layout") and not hasattr(spec, "chunk")


def test_the_scheme_type_has_one_name():
    import dtkv.ownership as mod

    assert mod.OwnershipScheme.__args__ == ("interleave", "block")
    with pytest.raises(AttributeError):
        mod.Layout  # noqa: B018 - 0.1's name of OwnershipScheme, removed in 0.2


@settings(max_examples=40, deadline=None)
@given(cp=CPS, num_pages=PAGES, scheme=SCHEMES)
def test_plain_int_arithmetic_is_the_same_map(cp, num_pages, scheme):
    """``owner_and_local`` (for code holding plain ints, e.g. the ops) with a scheme name or code."""
    from dtkv.ownership import SCHEME_CODES, owner_and_local, pages_per_rank

    own = PageOwnership(cp, num_pages, scheme)
    pages = torch.arange(num_pages)
    for s in (scheme, SCHEME_CODES[scheme]):
        owner, local = owner_and_local(pages, cp, num_pages, s)
        assert owner.equal(own.owner(pages)) and local.equal(own.local_index(pages))
        assert owner_and_local(num_pages - 1, cp, num_pages, s) == (
            own.owner(num_pages - 1),
            own.local_index(num_pages - 1),
        )
    assert pages_per_rank(cp, num_pages) == own.max_local_pages == -(-num_pages // cp)


@pytest.mark.parametrize(
    "cp,num_pages,scheme,counts",
    [(3, 4, "block", [2, 2, 0]), (8, 49, "block", [7] * 7 + [0]), (4, 2, "interleave", [1, 1, 0, 0])],
)
def test_ranks_that_store_no_page(cp, num_pages, scheme, counts):
    own = PageOwnership(cp, num_pages, scheme)
    assert [own.num_local_pages(r) for r in range(cp)] == counts
    assert own.max_local_pages == max(counts)
    for r in range(cp):
        assert own.local_pages(r).numel() == counts[r]
        assert own.global_page(r, torch.arange(counts[r])).equal(own.local_pages(r))
    assert torch.cat([own.local_pages(r) for r in range(cp)]).sort().values.equal(torch.arange(num_pages))
