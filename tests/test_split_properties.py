"""Hypothesis invariants of ``dtkv.split.plan_cp_split`` over random batches (small sizes, modest example counts)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtkv.split import MULTIPLE_COMPUTE_OWNERS, NO_COMPUTE_OWNER, compute_owners, plan_cp_split
from tests.test_split_reference import assert_split_matches, ref_slot_ranks, ref_split

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, max_reqs: int = 5, max_extend: int = 160):
    cp = draw(st.integers(1, 5))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 64]))
    num_reqs = draw(st.integers(0, max_reqs))
    prefix = draw(st.lists(st.integers(0, 300), min_size=num_reqs, max_size=num_reqs))
    # mix short extends (fallback territory) with longer ones
    extend = draw(
        st.lists(st.one_of(st.integers(0, 12), st.integers(0, max_extend)), min_size=num_reqs, max_size=num_reqs)
    )
    return prefix, extend, cp, page_size


def _touched(prefix: int, n: int, ps: int) -> int:
    return len({(prefix + o) // ps for o in range(n)})


def _split(batch, kind: str):
    """The split of ``batch`` of a kind ("aligned", "balanced": zigzag with and without page alignment;
    "round_robin"), and its mode."""
    prefix, extend, cp, ps = batch
    mode = "round_robin" if kind == "round_robin" else "zigzag"
    return plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, mode=mode, page_aligned=kind == "aligned"), mode


@SETTINGS
@given(batches(), st.sampled_from(["aligned", "balanced", "round_robin"]))
def test_plan_vs_reference(batch, kind):
    prefix, extend, cp, ps = batch
    split, mode = _split(batch, kind)
    assert_split_matches(split, ref_split(prefix, extend, cp, ps, mode, kind == "aligned"), cp)


@SETTINGS
@given(batches(), st.booleans())
def test_segments_partition_each_extend_in_order(batch, page_aligned):
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, page_aligned=page_aligned)
    b = split.boundaries
    assert b.shape == (len(extend), 2 * cp + 1) and b.dtype == torch.int64
    if len(extend):
        assert b[:, 0].eq(0).all() and b[:, -1].tolist() == extend
        assert (b.diff(dim=1) >= 0).all()
    gather = split.gather_index
    valid = gather[gather >= 0]
    assert sorted(valid.tolist()) == list(range(split.total_tokens))
    assert gather[split.restore_index].equal(torch.arange(split.total_tokens))
    assert sum(split.num_local_tokens) == split.total_tokens
    assert split.max_local_tokens == max(split.num_local_tokens)


@SETTINGS
@given(batches(), st.booleans())
def test_zigzag_pairing(batch, page_aligned):
    """Rank r holds, request by request, segment r then segment 2cp-1-r (natural rows, in order)."""
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, page_aligned=page_aligned)
    segs = 2 * cp
    for r in range(cp):
        loc = split.local(r)
        rows = loc.token_index.tolist()
        cu = loc.cu_seqlens_q.tolist()
        for i, start in enumerate(split.extend_indptr[:-1]):
            bi = split.boundaries[i].tolist()
            want = list(range(start + bi[r], start + bi[r + 1])) + list(
                range(start + bi[segs - 1 - r], start + bi[segs - r])
            )
            assert rows[cu[i] : cu[i + 1]] == want
            assert loc.actual_seq_q_prev[i] == bi[r + 1] - bi[r]
            assert loc.kv_len_prev[i] == prefix[i] + bi[r + 1]
            assert loc.kv_len_next[i] == prefix[i] + bi[segs - r]


@SETTINGS
@given(batches())
def test_aligned_boundaries_are_page_multiples(batch):
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps)
    for i in np.flatnonzero(split.page_aligned.numpy()):
        absolute = split.boundaries[i, 1:-1] + prefix[i]
        assert (absolute % ps == 0).all()
        assert (split.segment_lens[i] > 0).all()  # strictly increasing


@SETTINGS
@given(batches())
def test_fallback_exactly_when_fewer_than_2cp_pages(batch):
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps)
    want = [_touched(p, n, ps) >= 2 * cp for p, n in zip(prefix, extend)]
    assert split.page_aligned.tolist() == want
    assert split.all_page_aligned == (bool(want) and all(want))
    off = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, page_aligned=False)
    assert not off.page_aligned.any()


@SETTINGS
@given(batches(), st.booleans())
def test_token_balanced_segments_differ_by_at_most_one(batch, page_aligned):
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, page_aligned=page_aligned)
    for i in np.flatnonzero(~split.page_aligned.numpy()):
        lens = split.segment_lens[i]
        assert lens.max() - lens.min() <= 1
        assert (lens.diff() <= 0).all()  # the longer segments come first


@SETTINGS
@given(batches())
def test_aligned_boundaries_stay_near_balanced(batch):
    """With segments of at least a page, each aligned boundary is the nearest page edge (within ps // 2)."""
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps)
    balanced = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, page_aligned=False)
    for i, n in enumerate(extend):
        if split.page_aligned[i] and n // (2 * cp) >= ps:
            assert (split.boundaries[i] - balanced.boundaries[i]).abs().max() <= ps // 2


@SETTINGS
@given(batches(), st.sampled_from(["aligned", "balanced", "round_robin"]))
def test_compute_owners_vs_reference(batch, kind):
    """Every touched page has exactly one compute owner when aligned; in general owners match per-token truth."""
    prefix, extend, cp, ps = batch
    split, _ = _split(batch, kind)
    owners = compute_owners(split)
    for i, (p, n) in enumerate(zip(prefix, extend)):
        bounds = split.boundaries[i].tolist() if split.boundaries is not None else None
        ranks = ref_slot_ranks(p, n, cp, ps, bounds, split.extend_indptr[i])
        row = owners[i].tolist()
        for s, value in enumerate(row):
            if s not in ranks:
                assert value == NO_COMPUTE_OWNER
            elif len(ranks[s]) == 1:
                assert value == next(iter(ranks[s]))
            else:
                assert value == MULTIPLE_COMPUTE_OWNERS
        if split.page_aligned[i]:
            assert all(len(v) == 1 for v in ranks.values())
            assert MULTIPLE_COMPUTE_OWNERS not in row


@SETTINGS
@given(batches())
def test_round_robin_batch_token_i_goes_to_rank_i_mod_cp(batch):
    """Row t of the batch (concatenated extends) goes to rank t % cp: the rotation does not restart per request."""
    prefix, extend, cp, ps = batch
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=ps, mode="round_robin")
    start = torch.tensor(split.extend_indptr[:-1], dtype=torch.int64)
    for r in range(cp):
        loc = split.local(r)
        offsets = loc.positions - torch.tensor(prefix, dtype=torch.int64)[loc.req_idx]
        assert ((start[loc.req_idx] + offsets) % cp == r).all()
        assert loc.token_index.equal(start[loc.req_idx] + offsets)
        assert sum(loc.actual_seq_q_next) == 0
    counts = torch.tensor([split.local(r).actual_seq_q_prev for r in range(cp)]).reshape(cp, len(extend))
    if len(extend):  # each request's tokens are consecutive batch rows, so each request is balanced too
        assert (counts.max(0).values - counts.min(0).values <= 1).all()


@settings(max_examples=200, deadline=None)
@given(
    cp=st.integers(1, 9),
    extend=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 200)), min_size=0, max_size=12),
    data=st.data(),
)
def test_round_robin_per_rank_token_counts_differ_by_at_most_one(cp, extend, data):
    """For any batch (one-token requests included), the ranks' token counts differ by at most one, and each
    rank's count is the number of batch rows t with t % cp == r."""
    prefix = data.draw(st.lists(st.integers(0, 100), min_size=len(extend), max_size=len(extend)))
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=4, mode="round_robin")
    counts = split.num_local_tokens
    total = sum(extend)
    assert counts == tuple(len(range(r, total, cp)) for r in range(cp))
    assert max(counts) - min(counts) <= 1
    assert split.max_local_tokens == (-(-total // cp) if extend else 0)
    assert all(split.local(r).num_tokens == counts[r] for r in range(cp))
