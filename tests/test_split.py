"""``dtkv.split`` planning and row helpers: goldens, per-token references, input validation, the half-split bug."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expecttest import TestCase

from dtkv.split import (
    CPSplit,
    merge_prev_next,
    pad_local,
    plan_cp_split,
    restore_natural,
    split_prev_next,
    take_local,
)
from dtkv.split._index import expand_blocks, expand_blocks_torch, invert_gather_torch
from tests.test_split_reference import assert_split_matches, ref_split

# awkward batches: sizes 1, primes, prefixes ending mid-page, partial last pages, empty extends, cp > tokens
CASES = [
    ([5], [23]),
    ([0], [1]),
    ([3, 0, 7], [10, 5, 2]),
    ([2, 11, 0, 13], [7, 37, 64, 0]),
    ([0, 1, 17, 4], [97, 3, 29, 61]),
    ([63, 64, 65], [129, 1, 130]),
]


def _runs(values: list[int]) -> str:
    """[0, 1, 2, 7, 8] -> '0-2 7-8' (golden-friendly)."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return " ".join(out) or "-"


def describe(split: CPSplit) -> str:
    lines = [
        f"cp={split.cp_size} page={split.page_size} mode={split.mode} total={split.total_tokens} "
        f"local={split.num_local_tokens} max_local={split.max_local_tokens} all_aligned={split.all_page_aligned}"
    ]
    for i, (p, n) in enumerate(zip(split.prefix_lens, split.extend_lens)):
        line = f"req {i}: prefix={p} extend={n} aligned={bool(split.page_aligned[i])}"
        if split.boundaries is not None:
            b = split.boundaries[i].tolist()
            line += f" bounds={b} abs={[p + x for x in b]} lens={split.segment_lens[i].tolist()}"
        lines.append(line)
    for r in range(split.cp_size):
        loc = split.local(r)
        lines.append(
            f"rank {r}: q_prev={loc.actual_seq_q_prev} q_next={loc.actual_seq_q_next} kv_prev={loc.kv_len_prev} "
            f"kv_next={loc.kv_len_next} rows={_runs(loc.token_index.tolist())}"
        )
    lines.append(f"restore={_runs(split.restore_index.tolist())}")
    return "\n".join(lines)


class TestGoldens(TestCase):
    """Small splits pinned in full; the per-token reference tests below check the same rules generally."""

    def test_zigzag_cp2_page4(self):
        # req 0: prefix ends mid-page, aligned with unequal segments; req 1: touches 3 < 4 pages -> fallback
        split = plan_cp_split([5, 2, 0], [23, 7, 17], cp_size=2, page_size=4)
        self.assertExpectedInline(
            describe(split),
            """\
cp=2 page=4 mode=zigzag total=47 local=(23, 24) max_local=24 all_aligned=False
req 0: prefix=5 extend=23 aligned=True bounds=[0, 7, 11, 19, 23] abs=[5, 12, 16, 24, 28] lens=[7, 4, 8, 4]
req 1: prefix=2 extend=7 aligned=False bounds=[0, 2, 4, 6, 7] abs=[2, 4, 6, 8, 9] lens=[2, 2, 2, 1]
req 2: prefix=0 extend=17 aligned=True bounds=[0, 4, 8, 12, 17] abs=[0, 4, 8, 12, 17] lens=[4, 4, 4, 5]
rank 0: q_prev=(7, 2, 4) q_next=(4, 1, 5) kv_prev=(12, 4, 4) kv_next=(28, 9, 17) rows=0-6 19-24 29-33 42-46
rank 1: q_prev=(4, 2, 4) q_next=(8, 2, 4) kv_prev=(16, 6, 8) kv_next=(24, 8, 12) rows=7-18 25-28 34-41
restore=0-6 24-35 7-12 36-39 13-17 40-47 18-22""",
        )

    def test_zigzag_cp4_page4(self):
        # req 1 touches 3 < 8 pages -> fallback; req 2 has no extend
        split = plan_cp_split([3, 6, 9], [37, 10, 0], cp_size=4, page_size=4)
        self.assertExpectedInline(
            describe(split),
            """\
cp=4 page=4 mode=zigzag total=47 local=(12, 11, 14, 10) max_local=14 all_aligned=False
req 0: prefix=3 extend=37 aligned=True bounds=[0, 5, 9, 17, 21, 25, 29, 33, 37] abs=[3, 8, 12, 20, 24, 28, 32, 36, 40] lens=[5, 4, 8, 4, 4, 4, 4, 4]
req 1: prefix=6 extend=10 aligned=False bounds=[0, 2, 4, 5, 6, 7, 8, 9, 10] abs=[6, 8, 10, 11, 12, 13, 14, 15, 16] lens=[2, 2, 1, 1, 1, 1, 1, 1]
req 2: prefix=9 extend=0 aligned=False bounds=[0, 0, 0, 0, 0, 0, 0, 0, 0] abs=[9, 9, 9, 9, 9, 9, 9, 9, 9] lens=[0, 0, 0, 0, 0, 0, 0, 0]
rank 0: q_prev=(5, 2, 0) q_next=(4, 1, 0) kv_prev=(8, 8, 9) kv_next=(40, 16, 9) rows=0-4 33-38 46
rank 1: q_prev=(4, 2, 0) q_next=(4, 1, 0) kv_prev=(12, 10, 9) kv_next=(36, 15, 9) rows=5-8 29-32 39-40 45
rank 2: q_prev=(8, 1, 0) q_next=(4, 1, 0) kv_prev=(20, 11, 9) kv_next=(32, 14, 9) rows=9-16 25-28 41 44
rank 3: q_prev=(4, 1, 0) q_next=(4, 1, 0) kv_prev=(24, 12, 9) kv_next=(28, 13, 9) rows=17-24 42-43
restore=0-4 14-17 28-35 42-49 36-39 18-21 5-10 22-23 40 50-51 41 24 11""",
        )

    def test_zigzag_token_balanced(self):
        split = plan_cp_split([5], [23], cp_size=2, page_size=4, page_aligned=False)
        self.assertExpectedInline(
            describe(split),
            """\
cp=2 page=4 mode=zigzag total=23 local=(11, 12) max_local=12 all_aligned=False
req 0: prefix=5 extend=23 aligned=False bounds=[0, 6, 12, 18, 23] abs=[5, 11, 17, 23, 28] lens=[6, 6, 6, 5]
rank 0: q_prev=(6,) q_next=(5,) kv_prev=(11,) kv_next=(28,) rows=0-5 18-22
rank 1: q_prev=(6,) q_next=(6,) kv_prev=(17,) kv_next=(23,) rows=6-17
restore=0-5 12-23 6-10""",
        )

    def test_round_robin_with_remainder(self):
        split = plan_cp_split([3, 0, 7], [10, 5, 2], cp_size=4, page_size=4, mode="round_robin")
        self.assertExpectedInline(
            describe(split),
            """\
cp=4 page=4 mode=round_robin total=17 local=(5, 4, 4, 4) max_local=5 all_aligned=False
req 0: prefix=3 extend=10 aligned=False
req 1: prefix=0 extend=5 aligned=False
req 2: prefix=7 extend=2 aligned=False
rank 0: q_prev=(3, 1, 1) q_next=(0, 0, 0) kv_prev=(12, 3, 9) kv_next=(12, 3, 9) rows=0 4 8 12 16
rank 1: q_prev=(3, 1, 0) q_next=(0, 0, 0) kv_prev=(13, 4, 7) kv_next=(13, 4, 7) rows=1 5 9 13
rank 2: q_prev=(2, 2, 0) q_next=(0, 0, 0) kv_prev=(10, 5, 7) kv_next=(10, 5, 7) rows=2 6 10 14
rank 3: q_prev=(2, 1, 1) q_next=(0, 0, 0) kv_prev=(11, 2, 8) kv_next=(11, 2, 8) rows=3 7 11 15
restore=0 5 10 15 1 6 11 16 2 7 12 17 3 8 13 18 4""",
        )


# ----------------------------------------------------------------------------------------- vs the reference
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 4, 5, 16])
@pytest.mark.parametrize(
    "mode,page_aligned", [("zigzag", True), ("zigzag", False), ("round_robin", True)], ids=["aligned", "tb", "rr"]
)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_plan_vs_reference(case, mode, page_aligned, page_size, cp):
    prefix, extend = CASES[case]
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=page_size, mode=mode, page_aligned=page_aligned)
    ref = ref_split(prefix, extend, cp, page_size, mode, page_aligned)
    assert (split.boundaries is None) == (mode != "zigzag")
    assert_split_matches(split, ref, cp)
    for r in range(cp):
        loc = split.local(r)
        counts = [a + b for a, b in zip(ref.q_prev[r], ref.q_next[r])]
        assert loc.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
        assert loc.cu_seqlens_q.dtype == torch.int32
        assert loc.kv_len_prev_tensor.tolist() == ref.kv_prev[r]
        assert loc.actual_seq_q_next_tensor.dtype == torch.int32


def test_local_is_cached_and_split_is_frozen():
    split = plan_cp_split([5], [23], cp_size=2, page_size=4)
    assert split.local(1) is split.local(1)
    assert split.restore_index is split.restore_index
    with pytest.raises(AttributeError):
        split.cp_size = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        split.local(0).num_tokens = 0  # type: ignore[misc]


def test_accepts_tensor_lengths():
    a = plan_cp_split(torch.tensor([5, 2]), torch.tensor([23, 7], dtype=torch.int32), cp_size=2, page_size=4)
    b = plan_cp_split((5, 2), np.array([23, 7]), cp_size=2, page_size=4)
    assert a.boundaries.equal(b.boundaries) and a.restore_index.equal(b.restore_index)
    assert a.prefix_lens == (5, 2) and isinstance(a.prefix_lens[0], int)


def test_round_robin_deals_one_token_requests_over_the_ranks():
    """Eight one-token requests at cp=8: one token a rank (each request used to restart at rank 0)."""
    split = plan_cp_split([0, 5, 9, 0, 2, 64, 1, 0], [1] * 8, cp_size=8, page_size=4, mode="round_robin")
    assert split.num_local_tokens == (1,) * 8 and split.max_local_tokens == 1
    for r in range(8):
        loc = split.local(r)
        assert loc.token_index.tolist() == [r] and loc.req_idx.tolist() == [r]
        assert loc.actual_seq_q_prev == tuple(int(i == r) for i in range(8))
        assert loc.kv_len_prev[r] == split.prefix_lens[r] + 1  # its request's only token
    x = torch.arange(8.0)
    parts = [pad_local(take_local(x, split, r), split) for r in range(8)]
    assert restore_natural(torch.cat(parts), split).equal(x)


def test_empty_batch():
    split = plan_cp_split([], [], cp_size=3, page_size=4)
    assert (split.total_tokens, split.max_local_tokens, split.all_page_aligned) == (0, 0, False)
    assert split.restore_index.shape == (0,) and split.gather_index.shape == (0,)
    assert take_local(torch.zeros(0, 2), split, 2).shape == (0, 2)


def test_extend_len_zero_contributes_nothing():
    split = plan_cp_split([7, 6], [0, 16], cp_size=2, page_size=4)
    assert split.page_aligned.tolist() == [False, True]
    assert split.boundaries[0].tolist() == [0, 0, 0, 0, 0]
    for r in range(2):
        loc = split.local(r)
        assert loc.actual_seq_q_prev[0] == loc.actual_seq_q_next[0] == 0
        assert loc.kv_len_prev[0] == loc.kv_len_next[0] == 7


def test_device_paths_match_host_paths():
    """The non-CPU expansion (``repeat_interleave`` on the device) and inverse (``index_copy_``), run on CPU."""
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 9, 40)
    shift = rng.integers(-50, 50, 40)
    for slope in (0, 1, 3):
        host = expand_blocks(shift, lens, int(lens.sum()), torch.device("cpu"), slope)
        dev = expand_blocks_torch(shift, lens, int(lens.sum()), torch.device("cpu"), slope)
        assert host.equal(dev)
    split = plan_cp_split([3, 0, 7], [10, 5, 2], cp_size=4, page_size=4, mode="round_robin")
    args = (split.num_local_tokens, split.max_local_tokens, split.total_tokens)
    assert invert_gather_torch(split.gather_index, *args).equal(split.restore_index)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,page_aligned", [("zigzag", True), ("zigzag", False), ("round_robin", True)])
def test_cuda_split_matches_cpu(mode, page_aligned):
    prefix, extend = CASES[3]
    kwargs = dict(cp_size=3, page_size=4, mode=mode, page_aligned=page_aligned)
    host, dev = plan_cp_split(prefix, extend, **kwargs), plan_cp_split(prefix, extend, device="cuda", **kwargs)
    assert dev.restore_index.is_cuda and dev.restore_index.cpu().equal(host.restore_index)
    assert dev.gather_index.cpu().equal(host.gather_index)
    x = torch.randn(host.total_tokens, 5, device="cuda")
    parts = []
    for r in range(3):
        for name in ("token_index", "positions", "req_idx", "cu_seqlens_q", "prev_index", "next_index"):
            a, b = getattr(host.local(r), name), getattr(dev.local(r), name)
            assert b.is_cuda and b.dtype == a.dtype and b.cpu().equal(a), name
        local = take_local(x, dev, r)
        assert merge_prev_next(*split_prev_next(local, dev, r), dev, r).equal(local)
        parts.append(pad_local(local, dev))
    assert restore_natural(torch.cat(parts), dev).equal(x)


# ----------------------------------------------------------------------------------------- row helpers
@pytest.mark.parametrize("mode", ["zigzag", "round_robin"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_take_pad_restore_roundtrip(case, mode):
    prefix, extend = CASES[case]
    cp = 3
    split = plan_cp_split(prefix, extend, cp_size=cp, page_size=4, mode=mode)
    x = torch.randn(split.total_tokens, 2, 3, generator=torch.Generator().manual_seed(case))
    parts = [pad_local(take_local(x, split, r), split) for r in range(cp)]
    assert all(p.shape == (split.max_local_tokens, 2, 3) for p in parts)
    assert restore_natural(torch.cat(parts), split).equal(x)
    for r in range(cp):
        local = take_local(x, split, r)
        prev, nxt = split_prev_next(local, split, r)
        assert merge_prev_next(prev, nxt, split, r).equal(local)
        loc = split.local(r)
        assert prev.shape[0] == loc.cu_seqlens_q_prev[-1] and nxt.shape[0] == loc.cu_seqlens_q_next[-1]


def test_split_prev_next_follows_segments_across_requests():
    split = plan_cp_split([5, 2, 0], [23, 7, 17], cp_size=2, page_size=4)
    x = torch.arange(split.total_tokens)
    for r in range(2):
        prev, nxt = split_prev_next(take_local(x, split, r), split, r)
        loc = split.local(r)
        want_prev, want_next = [], []
        for i, start in enumerate(split.extend_indptr[:-1]):
            b = split.boundaries[i].tolist()
            want_prev += range(start + b[r], start + b[r + 1])
            want_next += range(start + b[3 - r], start + b[4 - r])
        assert prev.tolist() == want_prev and nxt.tolist() == want_next
        cu_prev = loc.cu_seqlens_q_prev.tolist()
        assert [cu_prev[i + 1] - cu_prev[i] for i in range(3)] == list(loc.actual_seq_q_prev)


def _ragged_topk(q_rows, keys, kv_len, q_len, k):
    """Reference of a ragged causal indexer topk over one half (as the CP indexer calls it): row ``j`` of the
    half may attend keys ``[0, kv_len - q_len + 1 + j)``."""
    scores = q_rows @ keys.T
    extent = torch.arange(kv_len - q_len + 1, kv_len + 1)[: q_rows.shape[0]]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] >= extent[:, None], float("-inf"))
    return scores.topk(k, dim=1).indices, extent


def test_half_split_hands_wrong_rows_to_topk():
    """Page-aligned segments are unequal (7 and 4 rows on rank 0), so ``(n+1)//2`` puts a next-segment row
    into the prev half; the recorded lengths do not. Each row's true causal extent is ``position + 1``."""
    split = plan_cp_split([5], [23], cp_size=2, page_size=4)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(28, 8, generator=g)
    q = torch.randn(split.total_tokens, 8, generator=g)
    loc = split.local(0)
    q_local = take_local(q, split, 0)
    assert (loc.actual_seq_q_prev, loc.actual_seq_q_next) == ((7,), (4,))
    true_extent = loc.positions + 1
    # metadata path
    prev, nxt = split_prev_next(q_local, split, 0)
    _, ext_prev = _ragged_topk(prev, keys, loc.kv_len_prev[0], loc.actual_seq_q_prev[0], 4)
    _, ext_next = _ragged_topk(nxt, keys, loc.kv_len_next[0], loc.actual_seq_q_next[0], 4)
    assert torch.cat([ext_prev, ext_next]).equal(true_extent)
    idx_meta = torch.cat(
        [
            _ragged_topk(prev, keys, loc.kv_len_prev[0], loc.actual_seq_q_prev[0], 4)[0],
            _ragged_topk(nxt, keys, loc.kv_len_next[0], loc.actual_seq_q_next[0], 4)[0],
        ]
    )
    idx_true = torch.stack([_ragged_topk(q_local[j : j + 1], keys, int(true_extent[j]), 1, 4)[0][0] for j in range(11)])
    assert idx_meta.equal(idx_true)
    # half split: 6 + 5 rows, paired with the same kv lengths -> wrong extents and wrong topk
    half = (loc.num_tokens + 1) // 2
    h_prev, h_next = q_local[:half], q_local[half:]
    assert h_prev.shape[0] != loc.actual_seq_q_prev[0]
    _, bad_prev = _ragged_topk(h_prev, keys, loc.kv_len_prev[0], h_prev.shape[0], 4)
    _, bad_next = _ragged_topk(h_next, keys, loc.kv_len_next[0], h_next.shape[0], 4)
    bad_extent = torch.cat([bad_prev, bad_next])
    assert not bad_extent.equal(true_extent)
    assert (bad_extent > true_extent).any()  # some rows would see future keys
    idx_half = torch.cat(
        [
            _ragged_topk(h_prev, keys, loc.kv_len_prev[0], h_prev.shape[0], 4)[0],
            _ragged_topk(h_next, keys, loc.kv_len_next[0], h_next.shape[0], 4)[0],
        ]
    )
    assert not idx_half.equal(idx_true)


def test_half_split_is_right_for_token_balanced():
    """Control: token-balanced segments differ by at most one token, where the half split coincides."""
    split = plan_cp_split([5], [23], cp_size=2, page_size=4, page_aligned=False)
    for r in range(2):
        loc = split.local(r)
        assert loc.actual_seq_q_prev[0] == (loc.num_tokens + 1) // 2


# ----------------------------------------------------------------------------------------- validation
class TestRejects(TestCase):
    def _msg(self, exc_type, fn, *args, **kwargs) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception)

    def test_rejects_bad_plan_inputs(self):
        plan = plan_cp_split
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0, -3], [1, 1], cp_size=2, page_size=4),
            """prefix_lens must be >= 0, got prefix_lens[1]=-3""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0], [-1], cp_size=2, page_size=4),
            """extend_lens must be >= 0, got extend_lens[0]=-1""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0], [1], cp_size=0, page_size=4), """cp_size must be >= 1, got cp_size=0"""
        )
        self.assertExpectedInline(
            self._msg(TypeError, plan, [0], [1], cp_size=2, page_size=4.0),
            """page_size must be an int, got page_size=4.0 (float)""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0, 1], [1], cp_size=2, page_size=4),
            """prefix_lens and extend_lens must have one entry per request, got len(prefix_lens)=2 and len(extend_lens)=1""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0], [1], cp_size=2, page_size=4, mode="ring"),
            """mode must be one of ('zigzag', 'round_robin'), got mode='ring'""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, plan, torch.tensor([0.0]), [1], cp_size=2, page_size=4),
            """prefix_lens must be an integer tensor, got prefix_lens.dtype=torch.float32""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, plan, [0, True], [1, 2], cp_size=2, page_size=4),
            """prefix_lens must hold ints, got True (bool)""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [[0]], [[1]], cp_size=2, page_size=4),
            """prefix_lens must be a flat sequence of ints ([num_reqs]), got shape [1, 1]""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, plan, [0], [1], cp_size=2, page_size=4, page_aligned=1),
            """page_aligned must be a bool, got page_aligned=1""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, plan, 3, [1], cp_size=2, page_size=4),
            """prefix_lens must be a sequence of ints or an integer tensor, got int""",
        )

    def test_rejects_kv_lengths_past_int32(self):
        """The split's length tensors are int32 (as kernels read them): lengths past 2**31 - 1 are rejected
        rather than wrapped to negative values."""
        plan = plan_cp_split
        big = 2**31 - 1
        ok = plan([big - 4], [4], cp_size=2, page_size=4)  # exactly the largest KV length
        assert ok.local(1).kv_len_next_tensor.dtype == torch.int32 and int(ok.local(0).kv_len_next_tensor[0]) == big
        self.assertExpectedInline(
            self._msg(ValueError, plan, [big - 3], [4], cp_size=2, page_size=4),
            """prefix_lens[i] + extend_lens[i] must be <= 2**31 - 1 (the int32 KV lengths kernels read), got prefix_lens[0] + extend_lens[0] = 2147483644 + 4 = 2147483648""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0, 2**40], [1, 0], cp_size=2, page_size=4, mode="round_robin"),
            """prefix_lens must be <= 2**31 - 1 (int32 KV lengths), got prefix_lens[1]=1099511627776""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [0, 0], [2**30, 2**30], cp_size=2, page_size=4),
            """sum(extend_lens) must be <= 2**31 - 1 (the int32 cu_seqlens of the batch), got 2147483648 tokens""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, plan, [2**63], [1], cp_size=2, page_size=4),
            """prefix_lens must fit in int64, got prefix_lens=[9223372036854775808]""",
        )

    def test_rejects_bad_rank_and_rows(self):
        split = plan_cp_split([5], [23], cp_size=2, page_size=4)
        self.assertExpectedInline(self._msg(ValueError, split.local, 2), """rank must be < cp_size=2, got rank=2""")
        self.assertExpectedInline(
            self._msg(ValueError, take_local, torch.zeros(22), split, 0),
            """x must have 23 rows (split.total_tokens) in dim 0, got x.shape=[22]""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, pad_local, torch.zeros(13), split),
            """x_local must have at most split.max_local_tokens=12 rows in dim 0, got x_local.shape=[13]""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, restore_natural, torch.zeros(2, 12), split),
            """gathered must have 24 rows (cp_size * max_local_tokens = 2 * 12) in dim 0, got gathered.shape=[2, 12]""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, split_prev_next, torch.zeros(12), split, 0),
            """x_local must have 11 rows (split.local(0).num_tokens) in dim 0, got x_local.shape=[12]""",
        )
        self.assertExpectedInline(
            self._msg(ValueError, merge_prev_next, torch.zeros(7), torch.zeros(4, 1), split, 0),
            """prev_rows and next_rows must share trailing shape and dtype, got [7] torch.float32 and [4, 1] torch.float32""",
        )
        self.assertExpectedInline(
            self._msg(TypeError, take_local, [1.0] * 23, split, 0), """x must be a torch.Tensor, got list"""
        )
