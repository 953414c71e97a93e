"""PageOwnership's edges: the eager range check at both ends of the range, hashing by every field, the FX repr
that compiled graphs print, the upstream placement for one rank, and ``ownership_spec``'s conversions."""

from __future__ import annotations

import pytest
import torch

from dtkv import PageOwnership
from dtkv.ownership import OwnershipSpec, ownership_spec


@pytest.mark.parametrize("layout", ["interleave", "block"])
def test_check_pages_accepts_exactly_the_pool_and_the_padding(layout):
    own = PageOwnership(3, 7, layout)
    own.check_pages("pages", torch.tensor([-1, 0, 6]))
    own.check_pages("pages", torch.tensor([0, 6]), allow_padding=False)
    own.check_pages("pages", torch.zeros(0, dtype=torch.int64), allow_padding=False)
    cases = [([0, -2], True, -2), ([7], True, 7), ([3, -1], False, -1), ([7, 0], False, 7)]
    for pages, padding, bad in cases:
        with pytest.raises(ValueError) as e:
            own.check_pages("locs", torch.tensor(pages), allow_padding=padding)
        rule = "[-1, 7) (-1 is padding)" if padding else "[0, 7)"
        assert str(e.value) == f"locs must hold logical pages in {rule}, got locs containing {bad}"


def test_hash_covers_every_field():
    tags = [PageOwnership(cp, n, lay) for cp in (1, 2, 3) for n in (5, 6) for lay in ("interleave", "block")]
    assert len({hash(t) for t in tags}) == len(tags)
    assert all(hash(t) == hash(PageOwnership(t.cp_size, t.num_pages, t.scheme)) for t in tags)


def test_fx_repr_rebuilds_the_tag():
    own = PageOwnership(4, 10, "block")
    text, names = own.__fx_repr__()
    assert (text, names) == ("PageOwnership(cp_size=4, num_pages=10, scheme='block')", {"PageOwnership": PageOwnership})
    assert eval(text, {}, names) == own


def test_to_standard_for_one_rank_is_shard0():
    from torch.distributed.tensor import Shard

    assert PageOwnership(1, 5).to_standard() == Shard(0)
    assert PageOwnership(1, 5, "block").to_standard() == Shard(0)
    with pytest.raises(ValueError) as e:
        PageOwnership(2, 5).to_standard()
    assert str(e.value) == (
        "to_standard() for scheme='interleave' needs num_pages % cp_size == 0, got num_pages=5, cp_size=2"
    )


def test_ownership_spec_converts_placements_and_keeps_specs():
    own = PageOwnership(3, 8, "block")
    spec = ownership_spec(own)
    assert spec == OwnershipSpec(3, 8, "block") == own.spec and spec.pages_per_rank == 3
    assert ownership_spec(spec) is spec
    with pytest.raises(TypeError) as e:
        ownership_spec((3, 8, "block"))
    assert str(e.value) == "ownership must be a dtkv.PageOwnership or OwnershipSpec, got tuple"
