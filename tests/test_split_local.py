"""Row helpers of :mod:`dtkv.split` on multi-request batches, against a per-request reference built from the
recorded segment lengths (mutation testing found the single-request shortcut of ``split_prev_next`` /
``merge_prev_next`` unchecked for two requests), and their errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from dtkv import merge_prev_next, pad_local, plan_cp_split, restore_natural, split_prev_next, take_local

CASES = [  # (prefix_lens, extend_lens, cp_size, page_size, mode)
    ([0, 5], [37, 20], 2, 4, "zigzag"),
    ([3, 0, 0], [29, 1, 13], 3, 4, "zigzag"),
    ([0], [41], 2, 4, "zigzag"),
    ([0, 7], [11, 17], 2, 1, "round_robin"),
]


def _reference_halves(x_local: torch.Tensor, loc) -> tuple[torch.Tensor, torch.Tensor]:
    prev, nxt, start = [], [], 0
    for n_prev, n_next in zip(loc.actual_seq_q_prev, loc.actual_seq_q_next):
        prev.append(x_local[start : start + n_prev])
        nxt.append(x_local[start + n_prev : start + n_prev + n_next])
        start += n_prev + n_next
    assert start == loc.num_tokens
    return torch.cat(prev), torch.cat(nxt)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[4]}-cp{c[2]}-{len(c[1])}req")
def test_prev_next_halves_follow_each_requests_segments(case):
    prefix, extend, cp, ps, mode = case
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, mode=mode)
    x = torch.arange(sum(extend) * 3, dtype=torch.float32).reshape(-1, 3)
    for rank in range(cp):
        loc = split.local(rank)
        x_local = take_local(x, split, rank)
        prev, nxt = split_prev_next(x_local, split, rank)
        want_prev, want_next = _reference_halves(x_local, loc)
        assert torch.equal(prev, want_prev) and torch.equal(nxt, want_next)
        assert torch.equal(merge_prev_next(prev, nxt, split, rank), x_local)


def test_errors_name_the_argument():
    split = plan_cp_split([0, 0], [9, 6], cp_size=2, page_size=1)
    loc = split.local(0)
    with pytest.raises(TypeError, match="x_local"):
        pad_local([1, 2], split)
    with pytest.raises(TypeError, match="gathered"):
        restore_natural("rows", split)
    with pytest.raises(ValueError, match=r"x_local must have \d+ rows \(split\.local\(0\)\.num_tokens\)"):
        split_prev_next(torch.zeros(loc.num_tokens + 1), split, 0)
    prev, nxt = split_prev_next(torch.zeros(loc.num_tokens), split, 0)
    with pytest.raises(
        ValueError, match=r"prev_rows must have \d+ rows \(sum\(split\.local\(0\)\.actual_seq_q_prev\)\)"
    ):
        merge_prev_next(prev[1:], nxt, split, 0)
    with pytest.raises(ValueError, match=r"next_rows must have \d+ rows"):
        merge_prev_next(prev, nxt[:-1], split, 0)
