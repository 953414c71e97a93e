"""Runtime input handling on the reference model: decode with nothing to decode; the ownership scheme keyword."""

from __future__ import annotations

import pytest

from dtkv.model import ModelConfig
from tests._runtime import reference_runtime


def _engine(**kwargs):
    return reference_runtime(ModelConfig(num_layers=1), mode=kwargs.pop("mode", "single"), num_pages=16, **kwargs)


def test_decode_with_no_requests_is_a_no_op():
    """It used to fail inside ``torch.cat`` on an empty batch."""
    eng = _engine()
    assert eng.decode(3) == []
    assert eng.stats["steps"] == 0


def test_decode_skips_requests_that_were_not_prefilled():
    eng = _engine()
    eng.add_request([1, 2, 3])
    assert eng.decode(2) == [[]]  # nothing to decode yet: no step, outputs unchanged
    assert eng.stats["steps"] == 0 and eng.allocator.num_free() == 16
    first = eng.prefill(4)
    out = eng.decode(2)
    assert out[0][0] == first[0] and len(out[0]) == 3 and eng.stats["steps"] == 3


def _decode_nothing(rank, world):
    import torch.distributed as dist

    eng = reference_runtime(ModelConfig(num_layers=1), mode="sharded", group=dist.group.WORLD, num_pages=16)
    out = eng.decode(2)
    eng.add_request([5, 6])
    return out, eng.decode(1), eng.stats["steps"]


@pytest.mark.multirank
def test_decode_with_nothing_to_decode_takes_no_collective_on_any_rank(ranks2):
    assert ranks2.run(_decode_nothing) == [([], [[]], 0)] * 2


def test_the_ownership_scheme_keyword_sets_the_pool_and_the_allocator():
    eng = _engine(mode="single", scheme="block")
    assert eng.ownership.scheme == "block" and eng.alloc_ownership.scheme == "block"
