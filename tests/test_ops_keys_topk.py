"""``dtkv::keys_topk``: the torch reference against a per-row Python sort of the keys, the kernel (interpreter)
against the reference on every kind of row (thousands of exact score ties, constant rows, NaN / ``+inf`` /
``-0.0``, scores spread over 240 octaves, rows with no candidate, fewer candidates than ``k``, keys that differ in
their last bit only) under launches of 32 to 2048 keys a program (the digit rounds' histograms summed over many
programs a row), slots of both shapes and widths, strided keys, ``k`` past the columns, opcheck, a fullgraph
compile, the errors, the kernels' address bounds under the interpreter, and on a GPU the reference at the decode
step's sizes, eager and replayed from a CUDA graph.

No tolerances: the results are columns and slots, compared exactly.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from dtkv.ops import indexer_topk, keys_topk
from dtkv.ops.keys_topk import keys_topk_torch
from dtkv.ops.selection_keys import INVALID_KEY, selection_keys
from tests.ops_reference import BACKENDS, address_check, skip_unless

_mod = sys.modules["dtkv.ops.keys_topk"]

LAUNCHES = {
    "default": {},  # 2048 keys a program: one program a row here
    "chunk64": {"chunk": 64, "block": 32, "rank_rows": 16, "rank_cols": 32},  # many programs a row, many tiles
    "chunk128_warps2": {"chunk": 128, "block": 64, "rank_rows": 8, "rank_cols": 64, "num_warps": 2},
    "digits11": {"digit_bits": 11, "chunk": 256, "block": 128},  # 6 rounds, the last of 9 bits
    "digits5": {"digit_bits": 5, "chunk": 64, "block": 64},  # 13 rounds, the last of 4 bits
}
KINDS = ("normal", "ties", "constant", "sparse", "specials", "spread", "last_bit", "none")


def _python_topk(keys: torch.Tensor, k: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """The rule row by row in Python: the candidates (keys other than the padding key), largest first, their
    columns (or slots), ``-1`` padded."""
    n, num_keys = keys.shape
    out = torch.full((n, k), -1, dtype=torch.int64)
    for i in range(n):
        row = keys[i].tolist()
        cands = sorted((c for c in range(num_keys) if row[c] != INVALID_KEY), key=lambda c: -row[c])
        for j, c in enumerate(cands[:k]):
            s = c if slots is None else int(slots[c] if slots.ndim == 1 else slots[i, c])
            out[i, j] = s
    return out


def _keys(kind: str, n: int, num_keys: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, num_keys, generator=gen)
    visible = torch.rand(n, num_keys, generator=gen) < 0.9
    if kind == "ties":  # five values: thousands of exact ties, broken by column
        x = torch.randint(-2, 3, (n, num_keys), generator=gen).float()
    elif kind == "constant":
        x = torch.full((n, num_keys), -0.75)
    elif kind == "sparse":
        visible &= torch.rand(n, num_keys, generator=gen) < 0.1
    elif kind == "specials":
        pick = torch.randint(0, 7, (n, num_keys), generator=gen)
        vals = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-42, -1e-42])
        x = torch.where(pick < 7, vals[pick], x)
        x[:, ::5] = torch.randn(n, x[:, ::5].shape[1], generator=gen)
    elif kind == "spread":
        x = torch.sign(x) * torch.exp2(torch.rand(n, num_keys, generator=gen) * 240 - 120)
    elif kind == "last_bit":  # scores one ulp apart: keys that differ in the last digit round's bits
        x = torch.full((n, num_keys), 1.0) + torch.randint(0, 4, (n, num_keys), generator=gen) * 2.0**-23
    elif kind == "none":
        visible[:] = False
    if n > 1:
        visible[-1] = False  # one row with no candidate
    cols = torch.arange(num_keys)
    return selection_keys(x, cols.expand(n, num_keys), visible)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_the_rule(kind):
    g = torch.Generator().manual_seed(len(kind))
    keys = _keys(kind, 5, 61, g)
    slots = torch.randperm(61, generator=g) * 3 + 1
    assert torch.equal(keys_topk_torch(keys, 9, None), _python_topk(keys, 9))
    assert torch.equal(keys_topk_torch(keys, 9, slots), _python_topk(keys, 9, slots))
    slots2 = torch.randint(0, 1000, (5, 61), generator=g)
    assert torch.equal(keys_topk_torch(keys, 70, slots2), _python_topk(keys, 70, slots2))


def _check_triton(monkeypatch, kind, launch, n, num_keys, k):
    monkeypatch.setattr(_mod, "KERNEL_CONFIG", {**_mod.KERNEL_CONFIG, **LAUNCHES[launch]})
    g = torch.Generator().manual_seed(n * num_keys + k + len(kind))
    keys = _keys(kind, n, num_keys, g)
    slots1 = torch.randperm(num_keys, generator=g).to(torch.int32) + 7
    slots2 = torch.randint(0, 2**40, (n, num_keys), generator=g)
    for slots in (None, slots1, slots2):
        want = keys_topk(keys, k, key_slots=slots, backend="torch")
        got = keys_topk(keys, k, key_slots=slots, backend="triton")
        assert torch.equal(got, want), (kind, launch, got, want)
    want = keys_topk(keys, k, return_keys=True, backend="torch")
    assert torch.equal(keys_topk(keys, k, return_keys=True, backend="triton"), want), (kind, launch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_triton_vs_reference(monkeypatch, kind, launch):
    """Every kind of row under every launch, 3 rows of 331 columns, ``k = 40``."""
    skip_unless("triton", "cpu")
    _check_triton(monkeypatch, kind, launch, 3, 331, 40)


@pytest.mark.parametrize(("n", "num_keys", "k"), [(1, 1, 1), (2, 7, 16), (1, 97, 97), (2, 1031, 61)])
def test_triton_vs_reference_sizes(monkeypatch, n, num_keys, k):
    """One column, ``k`` past the columns, ``k`` equal to them, a thousand columns over 17 programs a row."""
    skip_unless("triton", "cpu")
    for kind in ("ties", "last_bit", "normal"):
        _check_triton(monkeypatch, kind, "chunk64", n, num_keys, k)


def test_returned_keys_are_local_topk():
    """``return_keys``: the kept keys largest first, padded with the padding key: sharded decode's
    :func:`dtkv.decode.local_topk`, sorted."""
    from dtkv.decode import local_topk

    g = torch.Generator().manual_seed(4)
    keys = _keys("ties", 3, 40, g)
    for backend in BACKENDS:
        skip_unless(backend, "cpu")
        for k in (7, 40, 53):
            got = keys_topk(keys, k, return_keys=True, backend=backend)
            assert torch.equal(got, local_topk(keys, k, sorted=True)), (backend, k)
        empty = keys_topk(keys[:, :0], 3, return_keys=True, backend=backend)
        assert empty.tolist() == [[INVALID_KEY] * 3] * 3


def test_is_indexer_topk():
    """The reference is :func:`indexer_topk`, the columns mapped: the kernel path replaces it in the decode step."""
    g = torch.Generator().manual_seed(2)
    keys = _keys("ties", 4, 50, g)
    slots = torch.randint(0, 99, (4, 50), generator=g)
    cols, valid = indexer_topk(keys, 12)
    want = torch.where(valid, slots.gather(1, cols.clamp(min=0)), torch.full_like(cols, -1))
    for backend in BACKENDS:
        skip_unless(backend, "cpu")
        assert torch.equal(keys_topk(keys, 12, key_slots=slots, backend=backend), want), backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_empty_inputs(backend):
    skip_unless(backend, "cpu")
    g = torch.Generator().manual_seed(5)
    wide = _keys("normal", 4, 80, g)
    keys = wide[:, 3:70]  # row stride 80
    assert torch.equal(keys_topk(keys, 6, backend=backend), _python_topk(keys.contiguous(), 6))
    cols = wide.t().contiguous().t()[:, :40]  # column stride 4: copied first
    assert torch.equal(keys_topk(cols, 3, backend=backend), _python_topk(cols.contiguous(), 3))
    slots = torch.randint(0, 50, (4, 100), generator=g)[:, 10:77]  # strided slots
    assert torch.equal(keys_topk(keys, 5, key_slots=slots, backend=backend), _python_topk(keys, 5, slots))
    assert keys_topk(keys[:0], 6, backend=backend).shape == (0, 6)
    assert keys_topk(keys[:, :0], 2, backend=backend).tolist() == [[-1, -1]] * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    g = torch.Generator().manual_seed(6)
    keys = _keys("ties", 3, 29, g)
    for args in ((keys, None, 4, False, backend), (keys, torch.arange(29) * 2, 40, False, backend),
                 (keys, torch.arange(87).view(3, 29), 5, False, backend), (keys, None, 31, True, backend)):  # fmt: skip
        torch.library.opcheck(torch.ops.dtkv.keys_topk.default, args)


def test_compiles_fullgraph():
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = "triton" if _triton_here() else "torch"
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(3, 45, generator=g)
    slots = torch.randint(0, 90, (3, 45), generator=g)

    def select(s):
        cols = torch.arange(s.shape[1])
        return keys_topk(selection_keys(s, cols.expand_as(s), cols < 40), 8, key_slots=slots, backend=backend)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(select, backend=counter, fullgraph=True)(scores)
    assert counter.frame_count == 1 and torch.equal(compiled, select(scores))


def _triton_here() -> bool:
    try:
        skip_unless("triton", "cpu")
    except pytest.skip.Exception:
        return False
    return True


def test_rejects_bad_input():
    keys = torch.zeros(2, 5, dtype=torch.int64)

    def call(**kw):
        a = {"keys": keys, "k": 3} | kw
        return keys_topk(**a, backend="torch")

    with pytest.raises(ValueError, match="k must be >= 1, got k=0"):
        call(k=0)
    with pytest.raises(TypeError, match=re.escape("keys must have dtype torch.int64, got keys.dtype=torch.float32")):
        call(keys=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=re.escape("keys must have 2 dims, got keys.shape=(10,)")):
        call(keys=torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ValueError, match=re.escape("key_slots must have shape [5], got key_slots.shape=[4]")):
        call(key_slots=torch.arange(4))
    with pytest.raises(ValueError, match=re.escape("key_slots must have shape [2, 5], got key_slots.shape=[3, 5]")):
        call(key_slots=torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match=re.escape("key_slots must have dtype [torch.int32, torch.int64]")):
        call(key_slots=torch.zeros(5))
    with pytest.raises(ValueError, match="key_slots and return_keys=True exclude each other"):
        call(key_slots=torch.arange(5), return_keys=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        keys_topk(keys, 3, backend="cuda")


def test_rounds_cover_every_bit_once():
    for bits in range(1, 13):
        rds = _mod.rounds(bits)
        assert rds[0][0] + rds[0][1] == 64 and rds[-1][0] == 0 and all(0 < b <= bits for _, b in rds)
        assert all(s1 == s0 + b0 for (s0, b0), (s1, _) in zip(rds[1:], rds[:-1]))
    assert _mod.rounds(11) == ((53, 11), (42, 11), (31, 11), (20, 11), (9, 11), (0, 9))
    assert _mod.ROUNDS == _mod.rounds(8) and len(_mod.ROUNDS) == 8


@pytest.mark.parametrize(
    ("bad", "match"),
    [({"chunk": 96, "block": 64}, "chunk % block == 0"), ({"digit_bits": 13}, r"digit_bits'\] must be in \[1, 12\]")],
)
def test_bad_launch_config_is_refused(monkeypatch, bad, match):
    skip_unless("triton", "cpu")
    monkeypatch.setattr(_mod, "KERNEL_CONFIG", {**_mod.KERNEL_CONFIG, **bad})
    with pytest.raises(ValueError, match=match):
        keys_topk(torch.zeros(1, 5, dtype=torch.int64), 2, backend="triton")


def test_kernels_stay_in_bounds(monkeypatch):
    """Every launch of :data:`LAUNCHES` on guard-banded inputs under the interpreter's address check: only the
    tensors' own bytes are read and written (the scratch included), and the result is the reference's."""
    skip_unless("triton", "cpu")
    from tests.ops_reference import benchmark

    M = benchmark("memcheck_ops")
    problems = []
    for kind, seed in (("ties", 0), ("sparse", 1), ("last_bit", 2)):
        g = torch.Generator().manual_seed(seed)
        bands = M.Bands(seed)
        keys = bands.put("keys", _keys(kind, 3, 150, g))
        slots = bands.put("slots", torch.randint(0, 9, (3, 150), generator=g), poison=0)
        want = keys_topk(keys, 20, key_slots=slots, backend="torch")
        for name, launch in LAUNCHES.items():
            monkeypatch.setattr(_mod, "KERNEL_CONFIG", {**_mod.KERNEL_CONFIG, **launch})
            with address_check():
                got = keys_topk(keys, 20, key_slots=slots, backend="triton")
            if not torch.equal(got, want):
                problems.append(f"{kind} {name}: differs from the torch backend")
            if bands.changed():
                problems.append(f"{kind} {name}: bands written next to {bands.changed()}")
    assert problems == []


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "num_keys"), [(1, 32768), (16, 131072), (3, 8191)])
@pytest.mark.parametrize("kind", ["normal", "ties", "last_bit", "sparse"])
def test_cuda_kernel_vs_reference_at_decode_sizes(n, num_keys, kind):
    """On a GPU, ``k = 2048`` over decode rows (one query a row): the reference's slots exactly, eager and
    replayed from a CUDA graph with new keys copied into its input."""
    g = torch.Generator().manual_seed(n + num_keys)
    keys = _keys(kind, n, num_keys, g).cuda()
    slots = torch.randint(0, 2**30, (n, num_keys), generator=g).cuda()
    want = keys_topk(keys, 2048, key_slots=slots, backend="torch")
    assert torch.equal(keys_topk(keys, 2048, key_slots=slots, backend="triton"), want)
    static = keys.clone()
    keys_topk(static, 2048, key_slots=slots, backend="triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = keys_topk(static, 2048, key_slots=slots, backend="triton")
    other = _keys("normal", n, num_keys, g).cuda()
    static.copy_(other)
    graph.replay()
    assert torch.equal(out, keys_topk(other, 2048, key_slots=slots, backend="torch"))
