"""Runtime input handling on the reference model: decode with nothing to decode; the deprecated ``ModelRunner``'s
ownership-scheme keyword and its older name ``PrefillEngine``."""

from __future__ import annotations

import pytest

from dtkv.model import ModelConfig, ModelRunner
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


def test_ownership_scheme_keyword_and_its_deprecated_name():
    eng = _engine(mode="single", ownership_scheme="block")
    assert eng.ownership.scheme == "block" and eng.alloc_ownership.scheme == "block"
    with pytest.warns(DeprecationWarning, match=r"ownership_layout=\.\.\.\) is deprecated"):
        old = ModelRunner(ModelConfig(num_layers=1), mode="single", num_pages=16, ownership_layout="block")
    assert old.ownership == eng.ownership and old.alloc_ownership == eng.alloc_ownership


def test_prefill_engine_is_a_deprecated_name_of_model_runner():
    import dtkv.model

    with pytest.warns(DeprecationWarning, match=r"dtkv\.model\.PrefillEngine is deprecated.*dtkv\.model\.ModelRunner"):
        old = dtkv.model.PrefillEngine
    assert old is dtkv.model.ModelRunner
    with pytest.raises(AttributeError, match="no attribute 'NoSuchRunner'"):
        dtkv.model.NoSuchRunner  # noqa: B018
