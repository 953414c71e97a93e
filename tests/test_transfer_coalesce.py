"""dtkv.transfer.coalesce against Python loops: runs, layer expansion, entry merging, layer groups, batches.

Each reference walks the entries one by one (no numpy vector tricks), and the inputs mix shuffled pages, gaps on
one side only, repeated ranges across groups, zero lengths, single entries and empty inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from dtkv.transfer.coalesce import coalesce_entries, expand_layers, expand_runs, page_runs, split_batches
from dtkv.transfer.plan import layer_bounds


def _ref_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Pairs sorted by source; a run continues while both sides step by exactly one."""
    runs: list[list[int]] = []
    for s, d in sorted(zip(src, dst)):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _ref_coalesce(src, dst, length, group) -> list[tuple[int, int, int, int]]:
    """Drop empty entries, sort by (group, src, dst), then extend the last entry while both sides continue it."""
    items = sorted((g, s, d, n) for s, d, n, g in zip(src, dst, length, group) if n > 0)
    out: list[list[int]] = []
    for g, s, d, n in items:
        if out and out[-1][3] == g and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n, g])
    return [tuple(e) for e in out]


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [0, 1, 2, 7, 31])
def test_page_runs_vs_reference(seed, k):
    rng = np.random.default_rng(seed)
    src = rng.permutation(64)[:k]
    dst = src + rng.integers(-1, 2, size=k) * (rng.random(k) < 0.3)  # mostly aligned, some steps broken
    if seed % 2:
        dst = rng.permutation(64)[:k]  # arbitrary destinations
    s0, d0, n = page_runs(_i64(src), _i64(dst))
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist())) == _ref_runs(src.tolist(), dst.tolist())
    assert s0.dtype == d0.dtype == n.dtype == np.int64


def test_page_runs_cut_on_either_side():
    #            src contiguous, dst jumps | dst contiguous, src jumps | both contiguous
    src, dst = [0, 1, 2, 10, 12, 20, 21, 22], [5, 6, 9, 30, 31, 40, 41, 42]
    s0, d0, n = page_runs(_i64(src), _i64(dst))
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist())) == [(0, 5, 2), (2, 9, 1), (10, 30, 1), (12, 31, 1),
                                                               (20, 40, 3)]  # fmt: skip


@pytest.mark.parametrize("num_layers", [1, 3])
def test_expand_layers_vs_reference(num_layers):
    runs = (_i64([0, 4, 9]), _i64([2, 3, 0]), _i64([3, 1, 2]))
    page_bytes, src_rows, dst_rows = 12, 11, 5
    src, dst, length = expand_layers(
        runs, num_layers=num_layers, page_bytes=page_bytes, src_rows=src_rows, dst_rows=dst_rows
    )
    want = [
        ((layer * src_rows + s) * page_bytes, (layer * dst_rows + d) * page_bytes, n * page_bytes)
        for layer in range(num_layers)
        for s, d, n in zip(*(r.tolist() for r in runs))
    ]
    assert list(zip(src.tolist(), dst.tolist(), length.tolist())) == want
    assert length.flags.c_contiguous and src.dtype == dst.dtype == length.dtype == np.int64


def test_expand_layers_of_no_runs_is_empty():
    src, dst, length = expand_layers((_i64([]), _i64([]), _i64([])), num_layers=4, page_bytes=8, src_rows=3,
                                     dst_rows=3)  # fmt: skip
    assert src.shape == dst.shape == length.shape == (0,)


def _side_bytes(logical: np.ndarray, page_major: bool) -> np.ndarray:
    """The flat bytes of a side holding ``logical`` ``[num_layers, rows, page_bytes]`` in the given layout."""
    return np.ascontiguousarray(logical.transpose(1, 0, 2) if page_major else logical).ravel()


@pytest.mark.parametrize("page_major", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["lm-lm", "pm-pm", "pm-lm", "lm-pm"])  # fmt: skip
@pytest.mark.parametrize("num_layers", [1, 2, 5])
@pytest.mark.parametrize("seed", range(4))
def test_expand_runs_moves_the_bytes_of_a_per_page_copy(seed, num_layers, page_major):
    """Copying the ranges byte for byte gives what copying every (layer, page) pair on its own gives."""
    rng = np.random.default_rng(seed)
    page_bytes, src_rows, dst_rows = 6, 13, 7  # prime page counts
    k = int(rng.integers(0, dst_rows + 1))
    src_idx, dst_idx = rng.permutation(src_rows)[:k], rng.permutation(dst_rows)[:k]
    src_idx[: k // 2], dst_idx[: k // 2] = np.sort(src_idx[: k // 2]), np.sort(dst_idx[: k // 2])  # some runs
    runs = page_runs(_i64(src_idx), _i64(dst_idx))
    src_logical = rng.integers(0, 256, (num_layers, src_rows, page_bytes), dtype=np.uint8)
    dst_logical = rng.integers(0, 256, (num_layers, dst_rows, page_bytes), dtype=np.uint8)
    want = dst_logical.copy()
    for s, d in zip(src_idx.tolist(), dst_idx.tolist()):  # the reference: one page of one layer at a time
        for layer in range(num_layers):
            want[layer, d] = src_logical[layer, s]
    src_flat, dst_flat = _side_bytes(src_logical, page_major[0]), _side_bytes(dst_logical, page_major[1])
    so, do, ln, layer = expand_runs(
        runs, num_layers=num_layers, page_bytes=page_bytes, src_rows=src_rows, dst_rows=dst_rows,
        src_page_major=page_major[0], dst_page_major=page_major[1],
    )  # fmt: skip
    assert so.dtype == do.dtype == ln.dtype == layer.dtype == np.int64
    assert so.shape == do.shape == ln.shape == layer.shape and int(ln.sum()) == k * num_layers * page_bytes
    written = np.zeros(dst_flat.shape[0], dtype=np.int64)
    for a, b, n in zip(so.tolist(), do.tolist(), ln.tolist()):
        dst_flat[b : b + n] = src_flat[a : a + n]
        written[b : b + n] += 1
    assert written.max(initial=0) <= 1, "a destination byte is written twice"
    assert np.array_equal(dst_flat, _side_bytes(want, page_major[1]))
    num_runs = int(runs[0].shape[0])
    want_entries = {(False, False): num_runs * num_layers, (True, True): num_runs}.get(page_major, k * num_layers)
    assert so.shape[0] == want_entries
    if page_major == (True, True):
        assert not layer.any()  # every range covers every layer
    else:  # each range lies in the layer it names
        for a, n, lay in zip(so.tolist(), ln.tolist(), layer.tolist()):
            first, last = (a // page_bytes, (a + n - 1) // page_bytes)
            to_layer = (lambda i: i % num_layers) if page_major[0] else (lambda i: i // src_rows)
            assert to_layer(first) == to_layer(last) == lay


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("with_group", [False, True])
def test_coalesce_entries_vs_reference(seed, with_group):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, 24))
    # entries cut from a few long contiguous ranges, shuffled; some empty, some shifted on one side only
    starts = np.sort(rng.choice(np.arange(0, 400, 8), size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)
    length = rng.integers(0, 3, size=k) * 4
    src = starts.copy()
    dst = 1000 + starts + (rng.random(k) < 0.2) * 4
    if seed % 4 == 3:
        dst = 5000 - starts  # destinations in the opposite order: the output order is the source order
    group = rng.integers(0, 3, size=k) if with_group else np.zeros(k, dtype=np.int64)
    perm = rng.permutation(k)
    args = (_i64(src[perm]), _i64(dst[perm]), _i64(length[perm]))
    out = coalesce_entries(*args, _i64(group[perm])) if with_group else coalesce_entries(*args)
    want = _ref_coalesce(src[perm].tolist(), dst[perm].tolist(), length[perm].tolist(), group[perm].tolist())
    assert len(out) == (4 if with_group else 3)
    got = list(zip(*(x.tolist() for x in out)))
    assert [e[:3] for e in got] == [e[:3] for e in want]
    if with_group:
        assert [e[3] for e in got] == [e[3] for e in want]
    assert all(x.dtype == np.int64 for x in out)


def test_coalesce_entries_keeps_groups_apart_and_chains_across_them_only_within():
    src, dst, length = _i64([0, 8, 16, 24]), _i64([100, 108, 116, 124]), _i64([8, 8, 8, 8])
    s, d, n, g = coalesce_entries(src, dst, length, _i64([0, 0, 1, 1]))
    assert (s.tolist(), d.tolist(), n.tolist(), g.tolist()) == ([0, 16], [100, 116], [16, 16], [0, 1])
    s, d, n = coalesce_entries(src, dst, length)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0], [100], [32])


@pytest.mark.parametrize("with_group", [False, True])
def test_coalesce_entries_single_and_empty(with_group):
    grp = (_i64([2]),) if with_group else ()
    out = coalesce_entries(_i64([5]), _i64([7]), _i64([3]), *grp)
    assert [x.tolist() for x in out] == [[5], [7], [3]] + ([[2]] if with_group else [])
    out = coalesce_entries(_i64([5]), _i64([7]), _i64([0]), *grp)  # zero length: dropped
    assert [x.tolist() for x in out] == [[], [], []] + ([[]] if with_group else [])


@pytest.mark.parametrize("num_layers", [1, 2, 5, 7, 61])
@pytest.mark.parametrize("num_groups", [0, 1, 2, 3, 8, 100])
def test_layer_bounds_vs_reference(num_layers, num_groups):
    groups = max(1, min(num_groups, num_layers))
    b = layer_bounds(num_layers, num_groups)
    assert b.dtype == np.int64 and b.tolist()[0] == 0 and b.tolist()[-1] == num_layers
    assert len(b) == groups + 1
    sizes = np.diff(b).tolist()
    assert all(s >= 1 for s in sizes) and max(sizes) - min(sizes) <= 1
    assert b.tolist() == [g * num_layers // groups for g in range(groups + 1)]


@pytest.mark.parametrize("num_entries,max_entries", [(0, 1), (1, 1), (5, 1), (5, 2), (6, 3), (7, 100), (2049, 1024)])
def test_split_batches_vs_reference(num_entries, max_entries):
    got = [(s.start, s.stop) for s in split_batches(num_entries, max_entries)]
    want, i = [], 0
    while i < num_entries:
        want.append((i, min(i + max_entries, num_entries)))
        i += max_entries
    assert got == want


@pytest.mark.parametrize("max_entries", [0, -3])
def test_split_batches_rejects_a_non_positive_batch(max_entries):
    with pytest.raises(ValueError) as e:
        split_batches(4, max_entries)
    assert str(e.value) == f"max_entries must be >= 1, got max_entries={max_entries}"
