"""Exact sharded top-k: packed keys order like the reference model's stable sort, and the global top-k of the
ranks' local top-ks equals the full view's top-k (same positions, same order) on 2, 3 and 4 gloo ranks.

No tolerance anywhere: selections are integer positions and must be equal. Scores are drawn from a few small
integers (plus +-0.0, huge and tiny values) so that ties are the common case, not the exception.
"""

from __future__ import annotations

import pytest
import torch

from dtkv.decode import (
    INVALID_KEY,
    MAX_POSITION,
    SelectionMismatchError,
    check_selection,
    global_topk,
    local_topk,
    selection_keys,
    unpack_keys,
)


def _reference_topk(scores_NP: torch.Tensor, valid_NP: torch.Tensor, k: int) -> torch.Tensor:
    """The reference model's rule on a full view indexed by position: float32, stable descending sort, -1 padded."""
    s = scores_NP.to(torch.float32).masked_fill(~valid_NP, float("-inf"))
    val, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    val, idx = val[:, :k], idx[:, :k]
    out = torch.where(val > float("-inf"), idx, torch.full_like(idx, -1))
    if out.shape[1] < k:
        out = torch.cat((out, torch.full((out.shape[0], k - out.shape[1]), -1, dtype=torch.int64)), dim=1)
    return out


def _tied_scores(n: int, p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([-2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 1.0 + 2**-20, 3.0, 1e30, -1e30, 1e-40, -1e-40])
    scores = pool[torch.randint(0, pool.numel(), (n, p), generator=g)].to(torch.float64)
    valid = torch.rand(n, p, generator=g) < 0.85
    return scores, valid


class TestKeys:
    @pytest.mark.parametrize("seed", range(6))
    @pytest.mark.parametrize("n,p,k", [(1, 1, 1), (3, 17, 5), (4, 40, 40), (2, 37, 64), (5, 101, 24)])
    def test_local_topk_vs_reference_stable_sort(self, n, p, k, seed):
        scores, valid = _tied_scores(n, p, seed)
        perm = torch.randperm(p, generator=torch.Generator().manual_seed(seed))  # keys in any order
        keys = selection_keys(scores[:, perm], perm.expand(n, p), valid[:, perm])
        _, pos, ok = unpack_keys(local_topk(keys, k))
        assert torch.equal(pos, _reference_topk(scores, valid, k))
        assert torch.equal(ok, pos >= 0)

    def test_unpack_round_trips_scores_and_positions(self):
        vals = torch.tensor([float("-inf"), -3.4e38, -1.0, -1e-45, 0.0, 1e-45, 1.0, 3.4e38, float("inf")])
        pos = torch.tensor([MAX_POSITION, 0, 7, 1, 2**31, 5, 6, 9, 3])
        keys = selection_keys(vals[None], pos[None], torch.ones(1, 9, dtype=torch.bool))
        scores, got_pos, ok = unpack_keys(keys)
        assert not bool(ok[0, 0]) and int(keys[0, 0]) == INVALID_KEY  # a -inf score is never selected
        assert torch.equal(scores[0, 1:], vals[1:]) and torch.equal(got_pos[0, 1:], pos[1:])
        assert torch.equal(keys[0, 1:].argsort(), torch.arange(8))  # the float order, kept by the ints

    def test_equal_scores_order_by_position_and_negative_zero_is_zero(self):
        keys = selection_keys(
            torch.tensor([[0.0, -0.0, 0.0, 2.0]]), torch.tensor([[9, 4, 6, 8]]), torch.ones(1, 4).bool()
        )
        assert unpack_keys(local_topk(keys, 4))[1].tolist() == [[8, 4, 6, 9]]

    def test_local_topk_pads_rows_shorter_than_k(self):
        keys = selection_keys(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 1]]), torch.tensor([[True, False]]))
        top = local_topk(keys, 4)
        assert top.shape == (1, 4) and unpack_keys(top)[1].tolist() == [[0, -1, -1, -1]]
        assert local_topk(torch.zeros(2, 0, dtype=torch.int64), 3).eq(INVALID_KEY).all()

    def test_rejects_k_below_one(self):
        with pytest.raises(ValueError, match="k must be >= 1, got k=0"):
            local_topk(torch.zeros(1, 3, dtype=torch.int64), 0)


def _global_vs_full(rank, world, n, p, k, seed):
    import torch.distributed as dist

    scores, valid = _tied_scores(n, p, seed)
    g = torch.Generator().manual_seed(seed + 100)
    owner = torch.randint(0, world, (n, p), generator=g)
    owner[0] = world - 1  # row 0 lives on one rank only: the others contribute nothing but padding
    # this rank's keys: the positions it owns, in a shuffled order, padded to a common width with invalid slots
    width = int((owner == rank).sum(1).max()) + 2
    pos = torch.zeros(n, width, dtype=torch.int64)
    ok = torch.zeros(n, width, dtype=torch.bool)
    for i in range(n):
        mine = torch.nonzero(owner[i] == rank).flatten()
        mine = mine[torch.randperm(mine.numel(), generator=g)]
        pos[i, : mine.numel()] = mine
        ok[i, : mine.numel()] = valid[i, mine]
    keys = selection_keys(scores.gather(1, pos), pos, ok)
    chosen = global_topk(local_topk(keys, k), k, dist.group.WORLD)
    sel_scores, sel_pos, _ = unpack_keys(chosen)
    ref = _reference_topk(scores, valid, k)
    ref_scores = torch.where(ref >= 0, scores.to(torch.float32).gather(1, ref.clamp(min=0)), float("-inf"))
    return {"equal": torch.equal(sel_pos, ref), "scores_equal": torch.equal(sel_scores, ref_scores), "keys": chosen}


@pytest.mark.multirank
@pytest.mark.parametrize("n,p,k", [(3, 50, 8), (2, 11, 16), (4, 97, 24)], ids=["k<P", "k>P", "k24"])
def test_global_topk_equals_full_view_topk(ranks234, n, p, k):
    results = ranks234.run(_global_vs_full, n, p, k, 3)
    assert all(r["equal"] and r["scores_equal"] for r in results)
    assert all(torch.equal(r["keys"], results[0]["keys"]) for r in results)  # every rank holds the same selection


def _check_selection_fault(rank, world):
    import torch.distributed as dist

    sel = torch.tensor([[3, 1, 2, -1]])
    ref = sel.clone()
    if rank == world - 1:
        sel[0, 2] = 7  # the injected fault: one rank selected another position
    try:
        check_selection(sel, ref, dist.group.WORLD, what="layer 0")
    except SelectionMismatchError as e:
        return str(e)
    return None


@pytest.mark.multirank
def test_check_selection_raises_the_same_error_on_every_rank(ranks3):
    messages = ranks3.run(_check_selection_fault)
    assert len(set(messages)) == 1 and messages[0] is not None
    assert messages[0] == (
        "DTKV_DEBUG: sharded top-k of layer 0 differs from the full view's top-k at query 0, place 2: position 7 "
        "instead of 2 (first on rank 2; ranks at fault: [2])"
    )
    check_selection(torch.tensor([[1, -1]]), torch.tensor([[1, -1]]), None, what="ok")  # agreeing: no error
