"""No kernel variant reads or writes outside its tensors (``benchmarks/memcheck_ops.py`` under the interpreter).

Contract: with every launch configuration ``benchmarks/tune_ops.py`` can pick, on ``bench_ops``' inputs (several
input sets, awkward sizes, skipped rows of every kind), each op's Triton kernels touch only bytes of their tensor
arguments (the interpreter's address check, what compute-sanitizer checks on a GPU), write nothing next to them
(guard bands, gaps of strided views) and give the torch backend's bytes. The harness itself is tested first: an
unmasked lane past the end, a pointer built from a loaded index for masked-off lanes, and a write into a band are
each caught, and masked-off lanes are not accesses.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from dtkv.ops import HAS_TRITON, _tuned
from dtkv.ops._common import INTERPRET, tl, triton
from tests.ops_reference import backend_ok, benchmark

M = benchmark("memcheck_ops")


@pytest.fixture(autouse=True)
def _interpreter_runs():
    if not (HAS_TRITON and INTERPRET and backend_ok("triton", "cpu")):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1 and Triton installed)")


if HAS_TRITON:

    @triton.jit
    def _copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr, MASK_LOAD: tl.constexpr, MASK_STORE: tl.constexpr):
        o = tl.arange(0, BLOCK)
        m = o < n
        if MASK_LOAD:
            v = tl.load(src_ptr + o, mask=m, other=0)
        else:
            v = tl.load(src_ptr + o)
        if MASK_STORE:
            tl.store(dst_ptr + o, v, mask=m)
        else:
            tl.store(dst_ptr + o, v)

    @triton.jit
    def _gather_kernel(out_ptr, src_ptr, idx_ptr, n, BLOCK: tl.constexpr, FOLLOW_MASKED: tl.constexpr):
        o = tl.arange(0, BLOCK)
        m = o < n
        i = tl.load(idx_ptr + o, mask=m, other=1 << 20)  # masked-off lanes get an index far past src
        if FOLLOW_MASKED:
            v = tl.load(src_ptr + i)  # the bug: a pointer from a masked load, used unmasked
        else:
            v = tl.load(src_ptr + i, mask=m, other=0)
        tl.store(out_ptr + o, v, mask=m)


def test_address_check_catches_lanes_past_the_end():
    src, dst = torch.arange(15, dtype=torch.int64), torch.zeros(15, dtype=torch.int64)
    with M.interpreter_address_check():
        _copy_kernel[(1,)](dst, src, 15, BLOCK=16, MASK_LOAD=True, MASK_STORE=True)  # masked-off lane 15: fine
        assert torch.equal(dst, src)
        with pytest.raises(M.AddressError, match=r"load of 1 active lane\(s\) out of bounds.*past the end of.*src_ptr"):
            _copy_kernel[(1,)](dst, src, 15, BLOCK=16, MASK_LOAD=False, MASK_STORE=True)
        with pytest.raises(M.AddressError, match=r"store of 1 active lane\(s\).*past the end of.*dst_ptr"):
            _copy_kernel[(1,)](dst, src, 15, BLOCK=16, MASK_LOAD=True, MASK_STORE=False)
        idx, out = torch.tensor([3, 0, 7]), torch.zeros(4, dtype=torch.int64)
        _gather_kernel[(1,)](out, src, idx, 3, BLOCK=4, FOLLOW_MASKED=False)
        assert out.tolist() == [3, 0, 7, 0]
        with pytest.raises(M.AddressError, match="load of 1 active lane"):
            _gather_kernel[(1,)](out, src, idx, 3, BLOCK=4, FOLLOW_MASKED=True)
    # outside the block nothing is checked (the interpreter is restored)
    assert M._ranges == []


def test_address_check_counts_a_view_as_its_extent_only():
    base = torch.arange(32, dtype=torch.int64)
    src, dst = base[8:23], torch.zeros(16, dtype=torch.int64)  # an unmasked 16th lane reads base[23]: mapped memory
    with M.interpreter_address_check(), pytest.raises(M.AddressError, match="0 bytes past the end of argument"):
        _copy_kernel[(1,)](dst, src, 15, BLOCK=16, MASK_LOAD=False, MASK_STORE=True)


def test_bands_see_writes_next_to_a_tensor_and_in_the_gaps_of_a_strided_view():
    bands = M.Bands(0)
    flat = bands.put("flat", torch.arange(10, dtype=torch.int32), poison=-5)
    layer = bands.put("layer", torch.zeros(3, 2, 4, dtype=torch.uint8)[:, 1])  # page stride 8, pages of 4 bytes
    assert flat.tolist() == list(range(10)) and layer.stride() == (8, 1) and bands.changed() == []
    flat.add_(1)  # the tensor's own bytes may change
    layer.fill_(7)
    assert bands.changed() == []
    past = flat.as_strided((11,), (1,))  # one element past the end: the band's first poison
    assert past[10].item() == -5
    past[10] = 0
    assert bands.changed() == ["flat"]
    gap = layer.as_strided((2, 8), (8, 1))  # the first gap (the other layer's page) lies inside the view's extent
    gap[0, 4] ^= 1
    assert bands.changed() == ["flat", "layer"]


def test_the_harness_flags_a_kernel_that_follows_a_location_past_the_end(monkeypatch):
    """A write_owned kernel that reads one location past the chunk (as a missing bound would) is reported, both by
    the address check and, without it, through the band's poison (a valid location: the row lands in the pool)."""
    wo = importlib.import_module("dtkv.ops.write_owned")
    real = wo._write_owned_kernel

    class OneRowTooMany:  # the tile kernel told of one row more than the chunk has
        def __getitem__(self, grid):
            launch = real[(grid[0] + 1,)]
            return lambda pool, src, locs, n, *args, **kwargs: launch(pool, src, locs, n + 1, *args, **kwargs)

    monkeypatch.setattr(wo, "_write_owned_kernel", OneRowTooMany())
    cfgs = [M.T.full("write_owned", {"variant": "tile", "block_r": 16})]
    (case, *_) = M.write_owned_cases(torch.device("cpu"), 37, 0)
    problems = M.check_case("write_owned", case, cfgs)
    assert problems == [f"{case.name} {cfgs[0]}: bytes differ from the torch backend's"]
    with M.interpreter_address_check():
        problems = M.check_case("write_owned", case, cfgs)
    assert len(problems) == 1 and "past the end of argument 'locs_ptr'" in problems[0], problems


QUICK = {  # op: configurations (completed from DEFAULTS) of the quick subset; the slow test runs every candidate
    "write_owned": [{}, {"variant": "tile", "block_r": 64}, {"variant": "window", "window": 64, "block_r": 16},
                    {"variant": "window", "layout": "flat", "window": 32, "block_r": 8, "chunk_w": 512},
                    {"variant": "tile", "layout": "flat", "block_r": 16, "chunk_w": 1024}],
    "direct_write": [{}, {"chunk_w": 0, "block_r": 8}, {"layout": "flat", "block_r": 8, "chunk_w": 512}],
    "quantize_write_mla_fp8": [{}, {"block_r": 16}],
    "quantize_write_indexer_fp8": [{}, {"block_r": 64}],
    "pack_owned_pages": [{}, {"rows": 2, "parts": 2}],
    "pack_layer_pages": [{}, {"parts": 4}, {"chunk_w": 2048}],
    "remap": [{}, {"map16": "always", "block": 2048}],
}  # fmt: skip


def _quick_pair(op: str) -> tuple[int, int]:
    """The (tokens, input set) of the quick test's cases of ``op``."""
    return (517 if op == "write_owned" else 67, 0)


def _key(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "num_warps"}


@pytest.mark.parametrize("op", list(QUICK))
def test_default_window_and_flat_configurations_stay_in_bounds(op):
    cfgs = [M.T.full(op, c) for c in QUICK[op]]
    problems = []
    with M.interpreter_address_check():
        for case in M.CASES[op](torch.device("cpu"), *_quick_pair(op)):
            problems += M.check_case(op, case, cfgs)
    assert problems == []


def _shipped(op: str) -> list[dict]:
    """``op``'s configurations a launch can take (the defaults, every tuned entry), ``num_warps`` aside (the
    interpreter runs twins alike)."""
    out = []
    for cfg in [M.T.full(op, {}), *(M.T.full(op, c) for c in _tuned.TUNED.get(op, {}).values())]:
        if _key(cfg) not in out:
            out.append(_key(cfg))
    return out


@pytest.mark.slow  # every candidate: under a minute on 2 cores (four with DTKV_TEST_LONG=1)
@pytest.mark.parametrize("op", list(QUICK))
def test_every_sweep_candidate_stays_in_bounds(op):
    """Each candidate's address check. The configurations a launch can take (defaults, tuned entries) run on both
    sizes with input set 0 and on the small size and 67 tokens with input set 1 (int32 locations, a pool and a
    layer view of twice its page stride, ranks 0 and 1: what set 1 adds is address arithmetic, which 67 tokens --
    several pages and windows, a partial last page -- exercise as 517 would, at an eighth of the interpreter's
    time); every other sweep candidate on one (size, set) pair, in turn, so that each pair meets a share of them.
    A configuration the quick test checks on its own pair is not checked again here. ``DTKV_TEST_LONG=1``: every
    candidate on every pair of both sizes, and set 2 (rank 2)."""
    long = os.environ.get("DTKV_TEST_LONG", "0") == "1"
    seeds = M.SEEDS if long else M.SEEDS[:2]
    pairs = [(n, seed) for n in M.SIZES["cpu"] for seed in seeds]
    if not long:
        pairs = [(67 if (n, seed) == (max(M.SIZES["cpu"]), 1) else n, seed) for n, seed in pairs]
    shipped = _shipped(op)
    quick_pair, quick = _quick_pair(op), [_key(M.T.full(op, c)) for c in QUICK[op]]
    todo: dict[tuple[int, int], list[dict]] = {pair: [] for pair in pairs}
    covered = 0
    for i, cfg in enumerate(M.configs(op, distinct_compiles=False)):
        everywhere = long or _key(cfg) in shipped
        for pair in pairs if everywhere else [pairs[i % len(pairs)]]:
            if pair == quick_pair and _key(cfg) in quick:
                covered += 1  # test_default_window_and_flat_configurations_stay_in_bounds checks it
            else:
                todo[pair].append(cfg)
    assert sum(map(len, todo.values())) + covered >= len(M.configs(op, distinct_compiles=False)), (
        "a candidate was left out"
    )
    problems = []
    with M.interpreter_address_check():
        for (n, seed), cfgs in todo.items():
            for case in M.CASES[op](torch.device("cpu"), n, seed):
                problems += M.check_case(op, case, cfgs)
    assert problems == []
