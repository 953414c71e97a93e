"""dtkv.split._index: the device-side twins (``*_torch``, the CUDA path of the split plan) agree with the numpy
CPU path and with loops, run here on CPU tensors; dtype int64 throughout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtkv.split._index import (
    cached_arange,
    expand_blocks,
    expand_blocks_torch,
    indptr_of,
    invert_gather,
    invert_gather_torch,
    small_tensor,
)

CPU = torch.device("cpu")


def _ref_expand(shift, lens, slope):
    out, k = [], 0
    for s, n in zip(shift, lens):
        for _ in range(n):
            out.append(slope * k + s)
            k += 1
    return out


@pytest.mark.parametrize("slope", [0, 1, 3, -1])
@pytest.mark.parametrize("seed", [0, 1])
def test_expand_blocks_both_paths_vs_loop(slope, seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 5, size=7)  # empty blocks included
    shift = rng.integers(-20, 20, size=7).astype(np.int32)  # cast to int64 on the way
    total = int(lens.sum())
    want = _ref_expand(shift.tolist(), lens.tolist(), slope)
    for got in (expand_blocks(shift, lens, total, CPU, slope), expand_blocks_torch(shift, lens, total, CPU, slope)):
        assert got.dtype == torch.int64 and got.tolist() == want


def test_expand_blocks_default_slope_is_one():
    shift, lens = np.array([5, -2]), np.array([2, 3])
    want = [5, 6, 0, 1, 2]
    assert expand_blocks(shift, lens, 5, CPU).tolist() == want
    assert expand_blocks_torch(shift, lens, 5, CPU).tolist() == want


@pytest.mark.parametrize("num_local_tokens,max_local", [([3, 1, 0, 2], 3), ([1], 1), ([2, 2], 4)])
def test_invert_gather_both_paths_vs_loop(num_local_tokens, max_local):
    total = sum(num_local_tokens)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(total))
    gather = torch.full((len(num_local_tokens) * max_local,), -1, dtype=torch.int64)
    k = 0
    for r, n in enumerate(num_local_tokens):
        gather[r * max_local : r * max_local + n] = perm[k : k + n]
        k += n
    want = [0] * total
    for row, tok in enumerate(gather.tolist()):
        if tok >= 0:
            want[tok] = row
    for fn in (invert_gather, invert_gather_torch):
        got = fn(gather, num_local_tokens, max_local, total)
        assert got.dtype == torch.int64 and got.tolist() == want, fn.__name__


def test_small_helpers():
    assert indptr_of(np.array([2, 0, 3])).tolist() == [0, 2, 2, 5]
    assert indptr_of(np.array([], dtype=np.int64)).tolist() == [0]
    a = cached_arange(5)
    assert a.tolist() == [0, 1, 2, 3, 4] and a.dtype == np.int64 and not a.flags.writeable
    assert cached_arange(1000)[-1] == 999 and cached_arange(3).tolist() == [0, 1, 2]
    t = small_tensor(np.array([1, 2], dtype=np.int32), CPU)
    assert t.dtype == torch.int64 and t.tolist() == [1, 2]
    assert small_tensor(np.array([1, 2]), CPU, np.int32).dtype == torch.int32
