"""Partial MLA attention + LSE merge equals one softmax over all selected rows, however the rows are split.

Tolerance: the merge is the exact identity of split softmax, so in float64 only the summation order changes.
Each output is a convex combination of at most K = 40 rows of O(1) values, computed with O(K) roundings of
2**-53 each before and after the merge: the difference is bounded by ~K * 1e-16 = 4e-15 relative to the output
scale; we allow 1e-12 (250x margin, still ten orders of magnitude below a wrong or missing row).
"""

from __future__ import annotations

import math

import pytest
import torch

from dtkv.decode import combine_partials, merge_partials, partial_attention

N, H, K, R, E = 3, 4, 40, 16, 6
SCALE = 1.0 / math.sqrt(R + E)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    valid = torch.rand(N, K, generator=g) < 0.8
    valid[2] = False
    valid[2, 5] = True  # a query with a single selected row
    return f(N, H, R), f(N, H, E), f(N, K, R), f(N, K, E), valid


def _reference(q_nope, q_rope, latent, rope, valid):
    logits = (torch.einsum("nhr,nkr->nhk", q_nope, latent) + torch.einsum("nhe,nke->nhk", q_rope, rope)) * SCALE
    p = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("nhk,nkr->nhr", p, latent)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_split_softmax_merge_vs_single_softmax(parts, seed):
    q_nope, q_rope, latent, rope, valid = _inputs(seed)
    owner = torch.randint(0, parts, (N, K), generator=torch.Generator().manual_seed(seed + 9))
    owner[1] = 0  # query 1's rows all on part 0: the other parts are empty for it
    outs, lses = zip(
        *(
            partial_attention(q_nope, q_rope, latent, rope, valid & (owner == c), softmax_scale=SCALE)
            for c in range(parts)
        )
    )
    out, lse = combine_partials(torch.stack(outs), torch.stack(lses))
    want = _reference(q_nope, q_rope, latent, rope, valid)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    logits = (torch.einsum("nhr,nkr->nhk", q_nope, latent) + torch.einsum("nhe,nke->nhk", q_rope, rope)) * SCALE
    torch.testing.assert_close(lse, torch.logsumexp(logits.masked_fill(~valid[:, None, :], float("-inf")), -1))
    for c in range(1, parts):  # empty partials are exactly zero with -inf LSE, never NaN
        assert torch.equal(outs[c][1], torch.zeros(H, R)) and bool((lses[c][1] == float("-inf")).all())


def test_a_query_with_no_rows_anywhere_gives_zeros_and_minus_inf():
    q_nope, q_rope, latent, rope, valid = _inputs(0)
    none = torch.zeros_like(valid)
    out, lse = partial_attention(q_nope, q_rope, latent, rope, none, softmax_scale=SCALE)
    merged, merged_lse = combine_partials(torch.stack([out, out]), torch.stack([lse, lse]))
    assert torch.equal(merged, torch.zeros_like(merged)) and bool(torch.isneginf(merged_lse).all())


def test_merge_partials_rejects_mixed_or_low_precision_dtypes():
    out = torch.zeros(1, 2, 3, dtype=torch.float32)
    with pytest.raises(
        TypeError, match=r"must share a float32 or float64 dtype .*got torch.bfloat16 and torch.bfloat16"
    ):
        merge_partials(out.bfloat16(), torch.zeros(1, 2, dtype=torch.bfloat16), None)
    with pytest.raises(TypeError, match="got torch.float32 and torch.float64"):
        merge_partials(out, torch.zeros(1, 2, dtype=torch.float64), None)
    lse = torch.zeros(1, 2)
    assert merge_partials(out, lse, None)[0] is out  # one process: nothing to merge


def _merge_on_ranks(rank, world):
    import torch.distributed as dist

    q_nope, q_rope, latent, rope, valid = _inputs(1)
    owner = torch.arange(N * K).view(N, K) % world
    owner[0] = 0  # query 0 is only on rank 0
    out, lse = partial_attention(q_nope, q_rope, latent, rope, valid & (owner == rank), softmax_scale=SCALE)
    merged, _ = merge_partials(out, lse, dist.group.WORLD)
    want = _reference(q_nope, q_rope, latent, rope, valid)
    return merged, float((merged - want).abs().max() / want.abs().max())


@pytest.mark.multirank
def test_merge_partials_on_ranks_is_the_same_everywhere_and_matches_one_softmax(ranks234):
    results = ranks234.run(_merge_on_ranks)
    assert all(torch.equal(r[0], results[0][0]) for r in results)
    assert all(r[1] < 1e-12 for r in results)
