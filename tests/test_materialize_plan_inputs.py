"""``plan_materialize`` refuses page ids that are not ints instead of truncating them (second review, finding 9)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtkv import PageOwnership
from dtkv.materialize import plan_materialize

OWN = PageOwnership(2, 8)


@pytest.mark.parametrize(
    "arg,pages,got",
    [
        ("history_pages", [1.0, 2.0], r"history_pages must hold ints, got 1\.0 \(float\)"),
        ("history_pages", [True, 3], r"history_pages must hold ints, got True \(bool\)"),
        ("current_pages", np.array([0.5]), r"current_pages must hold ints, got 0\.5 \(float\)"),
        ("current_pages", torch.tensor([1.7]), r"current_pages must be an integer tensor, got current_pages\.dtype"),
        ("current_pages", torch.tensor([True]), r"current_pages must be an integer tensor, got current_pages\.dtype"),
    ],
)
def test_rejects_float_and_bool_pages(arg, pages, got):
    kwargs = {"history_pages": [4], "current_pages": [5], arg: pages}
    with pytest.raises(TypeError, match=got):
        plan_materialize(kwargs["history_pages"], kwargs["current_pages"], OWN, 0)


def test_allows_ints_of_every_container():
    ref = plan_materialize([3, -1, 4], [5], OWN, 1)
    for h, c in (
        (np.array([3, -1, 4], dtype=np.int32), np.array([5])),
        (torch.tensor([3, -1, 4], dtype=torch.int32), torch.tensor([5])),
        ((np.int64(3), -1, 4), (5,)),
    ):
        plan = plan_materialize(h, c, OWN, 1)
        assert plan.digest == ref.digest and torch.equal(plan.page_map, ref.page_map)


def test_allows_empty_groups_of_any_dtype():
    """An empty float tensor (``torch.tensor([])``) holds nothing to truncate: it is an empty page list."""
    ref = plan_materialize([2], [], OWN, 0)
    for empty in (torch.tensor([]), np.array([]), (), torch.zeros(0, dtype=torch.bool)):
        assert plan_materialize([2], empty, OWN, 0).digest == ref.digest
