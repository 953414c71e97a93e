"""``dtkv::logits_topk``: the torch reference against a per-row Python sort of the rule, the kernel (interpreter)
against the reference on every kind of row (ties at the ``k``-th best, constant rows, ``-inf``, NaN, ``+inf``,
``-0.0``, logits spread over 240 octaves, logits near ``-3e38``, ``k + 1`` keys within a part per million of the
threshold) under launches of 16 to 2048 columns a step (ties at the threshold split across steps), a threshold
stage that breaks ties its own way, ranges that are empty, clamped or cover everything, slots, ``k`` past the
columns, strided logits, opcheck, a fullgraph compile with the indexer, the errors, the kernel's address bounds under the interpreter, the
sm_90 build's rules without a GPU (:func:`check_sm90_build`, on ``tests/test_ops_compile.py``'s one build of
every kernel) and, on a GPU, the selection of the packed-key path it replaces, bit for bit.

No tolerances: the results are columns and slots, compared exactly.
"""

from __future__ import annotations

import itertools
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from dtkv import IndexerFp8Layout
from dtkv.ops import indexer_logits, indexer_topk, logits_topk, quantize_indexer_fp8, quantize_indexer_queries
from dtkv.ops.logits_topk import logits_topk_torch
from tests.ops_reference import BACKENDS, address_check, skip_unless

_mod = sys.modules["dtkv.ops.logits_topk"]
ROOT = Path(__file__).resolve().parent.parent

LAUNCHES = {
    "default": {},  # 2048 columns a step: one step a row here
    "tiles16": {"block": 16},  # many steps a row: ties at the threshold and the padding span steps
    "tiles32_warps4": {"block": 32, "num_warps": 4},
    "tiles128": {"block": 128, "num_warps": 4},
}
PATHS = {
    "exact": {"ratio": 10**9},  # no row has that many groups: steps 1-3 over the whole row
    "grouped": {"ratio": 1, "min_rows": 1, "scan_block": 32, "group_block": 16},  # groups here; scans of steps
}
"""Settings of :data:`dtkv.ops.logits_topk.GROUP_CONFIG` that pick each path of the kernel."""
KINDS = ("normal", "ties", "constant", "sparse", "specials", "spread", "very_negative", "near_threshold")


def _python_topk(logits, k, start=None, end=None, slots=None) -> torch.Tensor:
    """The rule row by row in Python: candidates in range and not ``-inf``, sorted by (NaN first, then larger value,
    ``-0.0 == +0.0``), then by lower column; the first ``k`` as columns or slots, ``-1`` padded."""
    n, num_keys = logits.shape
    out = torch.full((n, k), -1, dtype=torch.int64)
    for i in range(n):
        lo = 0 if start is None else min(max(int(start[i]), 0), num_keys)
        hi = num_keys if end is None else max(min(int(end[i]), num_keys), lo)
        row = logits[i].tolist()
        cands = [c for c in range(lo, hi) if row[c] != -math.inf]
        cands.sort(key=lambda c: (0, 0.0, c) if math.isnan(row[c]) else (1, -row[c], c))
        for j, c in enumerate(cands[:k]):
            out[i, j] = int(slots[c]) if slots is not None else c
    return out


def _logits(kind: str, n: int, num_keys: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, num_keys, generator=gen)
    if kind == "ties":  # five values: thousands of exact ties at the k-th best
        x = torch.randint(-2, 3, (n, num_keys), generator=gen).float()
    elif kind == "constant":
        x = torch.full((n, num_keys), 0.75)
    elif kind == "sparse":
        x[torch.rand(n, num_keys, generator=gen) < 0.8] = float("-inf")
    elif kind == "specials":
        pick = torch.randint(0, 6, (n, num_keys), generator=gen)
        vals = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-42])
        x = torch.where(pick < 6, vals[pick], x)
        x[:, ::7] = torch.randn(n, x[:, ::7].shape[1], generator=gen)
    elif kind == "spread":  # one octave in 240: the k-th best sits far below the row's largest
        x = torch.sign(x) * torch.exp2(torch.rand(n, num_keys, generator=gen) * 240 - 120)
    elif kind == "very_negative":  # order keys below 255 * 2**18: the coarse window starts at 0
        x = -3e38 * (1 + torch.rand(n, num_keys, generator=gen) * 1e-2)
    elif kind == "near_threshold":  # k - 1 keys far above, then k + 1 keys within a part per million, then the rest
        x = torch.rand(n, num_keys, generator=gen)
        top, close = min(k - 1, num_keys), min(k + 1, max(0, num_keys - k + 1))
        x[:, :top] += 100.0
        x[:, top : top + close] = 50.0 + torch.rand(n, close, generator=gen) * 1e-4
    return x


def _ranges(n: int, num_keys: int, gen: torch.Generator, dtype=torch.int64):
    start = torch.randint(-3, max(1, num_keys), (n,), generator=gen)
    end = start + torch.randint(-2, num_keys + 4, (n,), generator=gen)
    start[0], end[0] = 0, num_keys  # one row sees everything
    if n > 2:
        start[1], end[1] = 5, 5  # one row sees nothing
    return start.to(dtype), end.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_the_rule(kind):
    g = torch.Generator().manual_seed(len(kind))
    x = _logits(kind, 6, 53, 9, g)
    start, end = _ranges(6, 53, g)
    slots = torch.randperm(53, generator=g) * 3 + 1
    assert torch.equal(logits_topk_torch(x, 9, None, None, None), _python_topk(x, 9))
    assert torch.equal(logits_topk_torch(x, 9, start, end, slots), _python_topk(x, 9, start, end, slots))


def _check_triton(monkeypatch, kind, launch, n, num_keys, k, path="exact"):
    monkeypatch.setattr(_mod, "KERNEL_CONFIG", {**_mod.KERNEL_CONFIG, **LAUNCHES[launch]})
    monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, **PATHS[path]})
    g = torch.Generator().manual_seed(n * num_keys + k + len(kind))
    x = _logits(kind, n, num_keys, k, g)
    start, end = _ranges(n, num_keys, g, dtype=torch.int32 if k % 2 else torch.int64)
    slots = torch.randperm(num_keys, generator=g) + 7
    for kw in ({}, {"key_start": start, "key_end": end, "key_slots": slots}):
        want = logits_topk(x, k, backend="torch", **kw)
        got = logits_topk(x, k, backend="triton", **kw)
        assert torch.equal(got, want), (kind, launch, list(kw), got, want)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_triton_vs_reference(monkeypatch, kind, launch, path):
    """Every kind of row under every launch and both paths, 5 rows of 97 columns, ``k = 12``."""
    skip_unless("triton", "cpu")
    _check_triton(monkeypatch, kind, launch, 5, 97, 12, path)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("n", "num_keys", "k"), [(3, 1, 1), (4, 7, 16), (3, 300, 31), (2, 1031, 64), (3, 4099, 5)])
@pytest.mark.parametrize("launch", ["default", "tiles16"])
def test_triton_vs_reference_sizes(monkeypatch, launch, n, num_keys, k, path):
    """One column, ``k`` past the columns, several tiles, a thousand columns, groups of 32 and a partial last one:
    ties and spread rows."""
    skip_unless("triton", "cpu")
    for kind in ("ties", "spread", "near_threshold"):
        _check_triton(monkeypatch, kind, launch, n, num_keys, k, path)


def test_group_size():
    """The largest power of two up to ``max_group`` that leaves ``ratio * k`` groups; none below 2."""
    assert [_mod.group_size(num_keys, 2048) for num_keys in (8192, 16383, 16384, 32768, 131072, 1 << 20)] == [
        0, 0, 2, 4, 16, 32,
    ]  # fmt: skip
    assert _mod.group_size(97, 12) == 2 and _mod.group_size(0, 1) == 0
    assert _mod.group_size(131072, 2048, rows=128) == 16 and _mod.group_size(131072, 2048, rows=127) == 0


class _NoLaunch:
    """A kernel whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_rows_past_the_cap_take_the_radix_select(monkeypatch):
    """Rows with at most ``cap * k`` candidates at their bound are selected from those candidates alone (right with
    the overflow kernel's launches dropped); a row of equal logits (every column a candidate) overflows, and only
    the overflow kernel makes it right. The exact path runs once, over the ``[N, cap * k]`` candidates."""
    skip_unless("triton", "cpu")
    monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, "min_rows": 1, "scan_block": 32, "group_block": 16})
    assert _mod.group_size(401, 10, rows=4) == 8  # 50 groups, the bound the 10th largest of their maxima
    calls = []
    exact = _mod._select_exact
    monkeypatch.setattr(_mod, "_select_exact", lambda src, k: calls.append(tuple(src.shape)) or exact(src, k))
    g = torch.Generator().manual_seed(12)
    x = _logits("normal", 4, 401, 10, g)
    x[2] = 0.5  # 401 candidates at the bound
    want = _python_topk(x, 10)
    assert torch.equal(logits_topk(x, 10, backend="triton"), want)
    assert calls == [(4, 2 * 10)], calls
    monkeypatch.setattr(_mod, "_overflow_rows_kernel", _NoLaunch())
    got = logits_topk(x, 10, backend="triton")
    assert [torch.equal(got[i], want[i]) for i in range(4)] == [True, True, False, True]


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "specials"])
def test_given_group_maxima_replace_the_first_launch(monkeypatch, kind):
    """``group_max`` (the indexer's epilogue writes it): the same selection with the group-maxima launch dropped;
    wrong maxima give another selection (the kernel reads them)."""
    skip_unless("triton", "cpu")
    from dtkv.ops.selection_keys import group_order_maxima

    monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, **PATHS["grouped"]})
    g = torch.Generator().manual_seed(21)
    x = _logits(kind, 5, 211, 9, g)
    group = _mod.group_size(211, 9, rows=5)
    assert group == 16
    want = _python_topk(x, 9)
    gmax = group_order_maxima(x, group)
    monkeypatch.setattr(_mod, "_group_max_kernel", _NoLaunch())
    assert torch.equal(logits_topk(x, 9, group_max=gmax, backend="triton"), want)
    assert torch.equal(logits_topk(x, 9, group_max=gmax, backend="torch"), want)
    low = torch.full_like(gmax, -(2**31))  # no group reaches a bound: no candidates listed
    assert not torch.equal(logits_topk(x, 9, group_max=low, backend="triton"), want)


def test_group_maxima_are_checked(monkeypatch):
    monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, **PATHS["grouped"]})
    x = torch.zeros(3, 100)
    ok = torch.zeros(3, 4, dtype=torch.int32)  # 100 columns, k=3: groups of 32
    assert _mod.group_size(100, 3, rows=3) == 32 and logits_topk(x, 3, group_max=ok, backend="torch").shape == (3, 3)
    with pytest.raises(ValueError, match=re.escape("group_max must have shape [3, 4], got group_max.shape=[3, 8]")):
        logits_topk(x, 3, group_max=torch.zeros(3, 8, dtype=torch.int32), backend="torch")
    with pytest.raises(
        TypeError, match=re.escape("group_max must have dtype torch.int32, got group_max.dtype=torch.int64")
    ):
        logits_topk(x, 3, group_max=ok.long(), backend="torch")
    with pytest.raises(
        ValueError, match=re.escape("group_max takes logits that are -inf outside each row's candidates")
    ):
        logits_topk(x, 3, key_start=torch.zeros(3, dtype=torch.int64), key_end=torch.ones(3, dtype=torch.int64),
                    group_max=ok, backend="torch")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("3 rows of 100 columns (k=60) take the exact path")):
        logits_topk(x, 60, group_max=ok, backend="torch")


def test_group_config_is_checked(monkeypatch):
    x = torch.zeros(2, 200)
    base = {**_mod.GROUP_CONFIG, "min_rows": 1}
    for bad, match in (
        ({"ratio": 0}, r"GROUP_CONFIG\['ratio'\] must be >= 1, got 0"),
        ({"cap": 0}, r"GROUP_CONFIG\['cap'\] must be >= 1, got 0"),
        ({"ratio": 1, "scan_block": 24}, r"GROUP_CONFIG\['scan_block'\] must be a power of two >= 32, got 24"),
        ({"ratio": 1, "scan_block": 16}, r"GROUP_CONFIG\['scan_block'\] must be a power of two >= 32, got 16"),
        ({"ratio": 1, "group_block": 6}, r"GROUP_CONFIG\['group_block'\] must be a power of two >= 1, got 6"),
    ):
        monkeypatch.setattr(_mod, "GROUP_CONFIG", {**base, **bad})
        with pytest.raises(ValueError, match=match):
            _mod._select(x, None, None, None, 4)


def _ties_to_the_highest_column(x, k, dim=1, largest=True, sorted=True):
    """A top-k of the values that breaks ties the other way (the highest column first; ``-0.0`` and ``+0.0``
    by column too): what the kernel path's threshold stage may get from ``torch.topk`` on another device."""
    assert dim == 1 and largest
    flipped = torch.flip(x, dims=[1])
    order = torch.sort(flipped, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.return_types.topk((torch.gather(flipped, 1, order), x.shape[1] - 1 - order))


@pytest.mark.parametrize("kind", ["ties", "specials", "constant", "near_threshold"])
def test_threshold_stage_may_break_ties_any_way(monkeypatch, kind):
    """The kernel needs only the kept values' smallest and those above it: a top-k that keeps the highest columns
    of a tie (and of ``-0.0`` / ``+0.0``) gives the same columns, in the same order."""
    skip_unless("triton", "cpu")
    monkeypatch.setattr(_mod.torch, "topk", _ties_to_the_highest_column)
    g = torch.Generator().manual_seed(len(kind))
    x = _logits(kind, 4, 90, 11, g)
    if kind == "specials":
        x[:, 30:] = torch.where(torch.rand(4, 60, generator=g) < 0.5, -0.0, 0.0)  # the threshold is a zero
    for block in (16, 2048):
        monkeypatch.setattr(_mod, "KERNEL_CONFIG", {**_mod.KERNEL_CONFIG, "block": block})
        assert torch.equal(logits_topk(x, 11, backend="triton"), _python_topk(x, 11)), (kind, block)


def test_ties_go_to_the_lowest_column():
    """Every logit of a row equal: the ``k`` lowest columns of its range, in order, on both backends."""
    x = torch.full((3, 40), 2.5)
    start, end = torch.tensor([0, 7, 30]), torch.tensor([40, 20, 33])
    for backend in BACKENDS:
        skip_unless(backend, "cpu")
        got = logits_topk(x, 5, key_start=start, key_end=end, backend=backend)
        assert got.tolist() == [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [30, 31, 32, -1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_indexer_topk_of_the_packed_logits(backend):
    """With the indexer: the selection of its float32 logits is the packed path's (``packed=True`` keys, then
    :func:`indexer_topk`, columns mapped through the slots), on the same queries."""
    skip_unless(backend, "cpu")
    g = torch.Generator().manual_seed(3)
    lay = IndexerFp8Layout(page_size=4, head_dim=32)
    codes, scales = quantize_indexer_fp8(torch.randn(24, 32, generator=g))
    pages = torch.cat((codes.view(6, -1), scales.view(torch.uint8).view(6, -1)), dim=1)
    q, w = quantize_indexer_queries(torch.randn(9, 4, 32, generator=g), torch.rand(9, 4, generator=g) - 0.3)
    slots = torch.randint(0, 24, (70,), generator=g)  # repeated slots: exact ties
    start, end = torch.zeros(9, dtype=torch.int64), torch.arange(61, 70)
    logits = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend=backend)
    keys = indexer_logits(q, w, pages, slots, start, end, layout=lay, backend=backend, packed=True)
    cols, valid = indexer_topk(keys, 16)
    want = torch.where(valid, slots[cols.clamp(min=0)], torch.full_like(cols, -1))
    got = logits_topk(logits, 16, key_start=start, key_end=end, key_slots=slots, backend=backend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_empty_inputs(backend):
    skip_unless(backend, "cpu")
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 50, generator=g)
    x = wide[:, 3:40]  # row stride 50
    assert torch.equal(logits_topk(x, 6, backend=backend), _python_topk(x.contiguous(), 6))
    cols = torch.randn(40, 4, generator=g).t()  # column stride 4: copied first
    assert torch.equal(logits_topk(cols, 3, backend=backend), _python_topk(cols.contiguous(), 3))
    assert logits_topk(x[:0], 6, backend=backend).shape == (0, 6)
    assert logits_topk(x[:, :0], 2, backend=backend).tolist() == [[-1, -1]] * 4
    ranges = torch.stack((torch.tensor([0, 2, 4, 1]), torch.tensor([37, 9, 4, 30])), 1)
    got = logits_topk(x, 6, key_start=ranges[:, 0], key_end=ranges[:, 1], backend=backend)
    assert torch.equal(got, _python_topk(x, 6, ranges[:, 0], ranges[:, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(monkeypatch, backend):
    skip_unless(backend, "cpu")
    g = torch.Generator().manual_seed(6)
    x = _logits("ties", 3, 29, 4, g)
    start, end = _ranges(3, 29, g)
    for args in ((x, None, None, None, None, 4, backend), (x, start, end, torch.arange(29) * 2, None, 40, backend)):
        torch.library.opcheck(torch.ops.dtkv.logits_topk.default, args)
    monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, **PATHS["grouped"]})
    gmax = torch.zeros(3, 8, dtype=torch.int32)  # 29 columns, k=4: groups of 4
    torch.library.opcheck(torch.ops.dtkv.logits_topk.default, (x, None, None, None, gmax, 4, backend))


def test_compiles_fullgraph_with_the_indexer():
    """Query quantization, the float32 logits and this top-k trace into one graph and give the eager result."""
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = "triton" if _triton_here() else "torch"
    g = torch.Generator().manual_seed(7)
    lay = IndexerFp8Layout(page_size=4, head_dim=32)
    codes, scales = quantize_indexer_fp8(torch.randn(20, 32, generator=g))
    pages = torch.cat((codes.view(5, -1), scales.view(torch.uint8).view(5, -1)), dim=1)
    slots, start, end = torch.arange(20), torch.zeros(3, dtype=torch.int64), torch.tensor([5, 12, 20])

    def select(q, w):
        q8, w8 = quantize_indexer_queries(q, w, scale=0.5)
        logits = indexer_logits(q8, w8, pages, slots, start, end, layout=lay, backend=backend)
        return logits_topk(logits, 8, key_start=start, key_end=end, key_slots=slots, backend=backend)

    q, w = torch.randn(3, 2, 32, generator=g), torch.rand(3, 2, generator=g)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(select, backend=counter, fullgraph=True)(q, w)
    assert counter.frame_count == 1 and torch.equal(compiled, select(q, w))


def _triton_here() -> bool:
    try:
        skip_unless("triton", "cpu")
    except pytest.skip.Exception:
        return False
    return True


def test_rejects_bad_input():
    x = torch.zeros(2, 5)

    def call(**kw):
        a = {"logits": x, "k": 3} | kw
        return logits_topk(**a, backend="torch")

    with pytest.raises(ValueError, match="k must be >= 1, got k=0"):
        call(k=0)
    with pytest.raises(
        TypeError, match=re.escape("logits must have dtype torch.float32, got logits.dtype=torch.int64")
    ):
        call(logits=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("logits must have 2 dims, got logits.shape=(10,)")):
        call(logits=torch.zeros(10))
    with pytest.raises(ValueError, match="key_start and key_end go together"):
        call(key_start=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("key_end must have shape [2], got key_end.shape=[3]")):
        call(key_start=torch.zeros(2, dtype=torch.int64), key_end=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match=re.escape("key_start must have dtype [torch.int32, torch.int64]")):
        call(key_start=torch.zeros(2), key_end=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("key_slots must have shape [5], got key_slots.shape=[4]")):
        call(key_slots=torch.arange(4))


def test_kernel_stays_in_bounds(monkeypatch):
    """Every launch of :data:`LAUNCHES` on guard-banded inputs under the interpreter's address check: only the
    tensors' own bytes are read and written (the scratch rows and the kept values included), and the result is the
    reference's."""
    skip_unless("triton", "cpu")
    from tests.ops_reference import benchmark

    M = benchmark("memcheck_ops")
    problems = []
    for kind, seed in (("near_threshold", 0), ("ties", 1), ("spread", 2)):
        g = torch.Generator().manual_seed(seed)
        x = _logits(kind, 3, 70, 8, g)
        start, end = _ranges(3, 70, g)
        bands = M.Bands(seed)
        args = [bands.put("logits", x)]
        kw = {"key_start": bands.put("start", start, poison=0), "key_end": bands.put("end", end, poison=70),
              "key_slots": bands.put("slots", torch.arange(70) * 5, poison=0)}  # fmt: skip
        want = logits_topk(*args, 8, backend="torch", **kw)
        for (name, launch), path in itertools.product(LAUNCHES.items(), PATHS):
            monkeypatch.setattr(_mod, "KERNEL_CONFIG", {**_mod.KERNEL_CONFIG, **launch})
            monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, **PATHS[path]})
            with address_check():
                got = logits_topk(*args, 8, backend="triton", **kw)
            if not torch.equal(got, want):
                problems.append(f"{kind} {name} {path}: differs from the torch backend")
            if bands.changed():
                problems.append(f"{kind} {name} {path}: bands written next to {bands.changed()}")
    assert problems == []


def check_sm90_build(records: list[dict]) -> None:
    """The kernels in the run's sm_90 build (``tests/test_ops_compile.py`` builds every kernel once, no GPU, and
    calls this with its records): every launch compiles with no local memory (spills), the select kernel's default one
    (:data:`dtkv.ops.logits_topk.KERNEL_CONFIG`; 61 registers a thread with Triton 3.7) fits at least two programs
    an SM (one's scans overlap another's loads). The forced-int64 builds are left out."""
    grouped = [
        r for r in records if r["kernel"] in ("_group_max_kernel", "_candidates_kernel", "_overflow_rows_kernel")
    ]
    assert all(r["ok"] and r.get("local", 0) == 0 for r in grouped), grouped
    records = [r for r in records if r["kernel"] == "_logits_topk_select_kernel" and "int64 offsets" not in r["where"]]
    assert records and all(r["ok"] and r.get("local", 0) == 0 for r in records), records
    cfg = _mod.KERNEL_CONFIG
    default = [
        r for r in records if r["constexprs"]["BLOCK"] == str(cfg["block"]) and r["num_warps"] == cfg["num_warps"]
    ]
    assert default and all(2 * r["registers"] * 32 * r["num_warps"] <= 65536 for r in default), default


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("kind", ["normal", "ties", "near_threshold", "spread"])
def test_cuda_kernel_vs_reference_at_deepseek_dims(monkeypatch, kind, grouped):
    """On a GPU, ``k = 2048`` over causal rows of a 32K key table (the last chunk of a 32K prompt, every 97th query
    of it), on both paths (groups of 4; ties and runs of close values overflow): the reference's columns and slots
    exactly."""
    monkeypatch.setattr(_mod, "GROUP_CONFIG", {**_mod.GROUP_CONFIG, **({"min_rows": 1} if grouped else PATHS["exact"])})
    assert _mod.group_size(32768, 2048, rows=85) == (4 if grouped else 0)
    g = torch.Generator().manual_seed(11)
    n, num_keys = 85, 32768
    x = _logits(kind, n, num_keys, 2048, g).cuda()
    end = (torch.arange(n) * 97 + num_keys - 8192 + 1).cuda()
    start = torch.zeros_like(end)
    slots = (torch.randperm(num_keys, generator=g) * 2).cuda()
    want = logits_topk(x, 2048, key_start=start, key_end=end, key_slots=slots, backend="torch")
    got = logits_topk(x, 2048, key_start=start, key_end=end, key_slots=slots, backend="triton")
    assert torch.equal(got, want)
