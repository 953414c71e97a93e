"""``dtkv::indexer_scores``: the Triton kernel against the torch reference, the reference against an independent
per-key loop, the float64 path bitwise against the decode path it replaces, opcheck, errors, and the kernel's
sm_90 build (wgmma, no register spills) without a GPU.

Tolerances. Positions and masks are integers: equal. Scores: the kernel applies the key scale after the head sum
and sums in the dot's order, the reference dequantizes first (float32): relative differences of a few float32 ulps
of the row's largest ``|score|``; we allow 1e-5 (a wrong key, head or scale moves a score by O(1)). The reference
against the float64 loop: float32 rounding of dequantized keys and sums, 1e-5 likewise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from dtkv import IndexerFp8Layout
from dtkv.decode import index_scores, selection_keys, unpack_keys
from dtkv.ops import dequantize_indexer_pages, indexer_scores, quantize_indexer_fp8
from dtkv.ops.indexer_scores import indexer_scores_torch
from tests.ops_reference import BACKENDS, skip_unless


def _pool(num_pages: int, layout: IndexerFp8Layout, gen: torch.Generator) -> torch.Tensor:
    ps, hd = layout.page_size, layout.head_dim
    k = torch.randn(max(num_pages, 1) * ps, hd, generator=gen) * torch.rand(max(num_pages, 1) * ps, 1, generator=gen)
    codes, scales = quantize_indexer_fp8(k)
    pool = torch.empty(max(num_pages, 1), ps * (hd + 4), dtype=torch.uint8)
    pool[:, : ps * hd] = codes.view(-1, ps * hd)
    pool[:, ps * hd :] = scales.view(torch.uint8).view(-1, ps * 4)
    return pool[:num_pages]


def _case(n, heads, hd, ps, num_pages, width, seed, q_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    lay = IndexerFp8Layout(page_size=ps, head_dim=hd)
    pool = _pool(num_pages, lay, g)
    ids = torch.randint(-1, num_pages + 2, (n, width), generator=g)  # -1 and >= P are padding
    slots = torch.stack([torch.randperm(width, generator=g) for _ in range(n)])
    slots[torch.rand(n, width, generator=g) < 0.1] = -1
    qpos = torch.randint(-1, width * ps, (n,), generator=g)  # -1: nothing causal; mid-page: a partial page
    q = torch.randn(n, heads, hd, generator=g).to(q_dtype)
    w = torch.rand(n, heads, generator=g) - 0.3
    return lay, pool, ids, slots, qpos, q, w


def _loop_reference(q, w, pool, ids, slots, qpos, lay, q_fp8):
    """Key by key in float64: ``(scores [N, L*S] float64, valid [N, L*S])``."""
    n, heads, hd = q.shape
    ps = lay.page_size
    keys = dequantize_indexer_pages(pool, lay).double() if pool.shape[0] else None
    qd, wd = q.double(), w.double()
    if q_fp8:
        codes, qs = quantize_indexer_fp8(q.float().reshape(-1, hd))
        qd = codes.view(torch.float8_e4m3fn).double().view(n, heads, hd)
        wd = wd * qs.double().view(n, heads)
    scores = torch.zeros(n, ids.shape[1] * ps, dtype=torch.float64)
    valid = torch.zeros(n, ids.shape[1] * ps, dtype=torch.bool)
    for i in range(n):
        for c in range(ids.shape[1]):
            p, s = int(ids[i, c]), int(slots[i, c])
            for t in range(ps):
                if p < 0 or p >= pool.shape[0] or s < 0 or s * ps + t > int(qpos[i]):
                    continue
                k = keys[p, t]
                scores[i, c * ps + t] = sum(float(wd[i, h]) * max(0.0, float(qd[i, h] @ k)) for h in range(heads))
                valid[i, c * ps + t] = True
    return scores, valid


GEOMS = [(1, 2, 32, 4, 5, 3), (3, 3, 48, 5, 11, 7), (2, 8, 64, 16, 9, 4), (4, 16, 128, 8, 13, 5)]


@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_q", "fp8_q"])
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "n{}_i{}_j{}_s{}_p{}_l{}".format(*g))
def test_reference_vs_per_key_loop(geom, q_fp8):
    lay, pool, ids, slots, qpos, q, w = _case(*geom, seed=sum(geom))
    got = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="torch")
    scores, pos, ok = unpack_keys(got)
    want, valid = _loop_reference(q, w, pool, ids, slots, qpos, lay, q_fp8)
    assert torch.equal(ok, valid)
    cols = torch.arange(ids.shape[1] * lay.page_size)
    want_pos = slots.repeat_interleave(lay.page_size, 1) * lay.page_size + cols % lay.page_size
    assert torch.equal(pos[ok], want_pos[ok])
    if ok.any():
        rel = float((scores[ok].double() - want[ok]).abs().max() / want[ok].abs().max().clamp(min=1e-30))
        assert rel < 1e-5, rel


@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_q", "fp8_q"])
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "n{}_i{}_j{}_s{}_p{}_l{}".format(*g))
def test_triton_vs_reference(geom, q_fp8):
    skip_unless("triton", "cpu")
    lay, pool, ids, slots, qpos, q, w = _case(*geom, seed=7 * sum(geom))
    a = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="torch")
    b = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="triton")
    sa, pa, va = unpack_keys(a)
    sb, pb, vb = unpack_keys(b)
    assert torch.equal(va, vb) and torch.equal(pa, pb)
    if va.any():
        rel = float((sa[va] - sb[va]).abs().max() / sa[va].abs().max().clamp(min=1e-30))
        assert rel < 1e-5, rel


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_pool_strided_ids_and_zero_width(backend):
    skip_unless(backend, "cpu")
    lay = IndexerFp8Layout(page_size=4, head_dim=32)
    g = torch.Generator().manual_seed(3)
    q, w = torch.randn(2, 2, 32, generator=g).bfloat16(), torch.rand(2, 2, generator=g)
    empty = torch.empty(0, lay.page_shape[0], dtype=torch.uint8)
    ids = torch.tensor([[0, 1], [2, -1]])
    keys = indexer_scores(q, w, empty, ids, ids.clone(), torch.tensor([7, 7]), layout=lay, backend=backend)
    assert keys.shape == (2, 8) and bool((unpack_keys(keys)[2] == 0).all())  # a rank with no page: all padding
    pool = _pool(5, lay, g)
    ids_t = torch.tensor([[0, 2], [1, 3], [4, -1]]).t()  # non-contiguous [2, 3]
    slots = torch.tensor([[0, 1, 2], [2, 0, 1]])
    args = (q, w, pool, ids_t, slots, torch.tensor([11, 5]))
    assert torch.equal(
        indexer_scores(*args, layout=lay, backend=backend),
        indexer_scores(q, w, pool, ids_t.contiguous(), slots, torch.tensor([11, 5]), layout=lay, backend=backend),
    )
    zero = indexer_scores(q, w, pool, ids[:, :0], ids[:, :0], torch.tensor([1, 1]), layout=lay, backend=backend)
    assert zero.shape == (2, 0)


def test_float64_is_bitwise_the_decode_path():
    """With float64 queries the reference is the first sharded-decode implementation, op for op: dequantized pages,
    :func:`dtkv.decode.index_scores`, :func:`dtkv.decode.selection_keys` (what keeps the reference model's CPU
    parity exact)."""
    lay, pool, ids, slots, qpos, q, w = _case(3, 4, 32, 4, 9, 6, seed=11, q_dtype=torch.float64)
    w = w.double()
    got = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, backend="torch")
    n, width, ps = 3, 6, 4
    real = (ids >= 0) & (ids < pool.shape[0]) & (slots >= 0)
    pages = pool[torch.where(real, ids, 0)].reshape(n * width, -1)
    keys_nsj = dequantize_indexer_pages(pages, lay).reshape(n, width * ps, -1).to(torch.float64)
    pos = (slots[:, :, None] * ps + torch.arange(ps)).reshape(n, -1)
    valid = real[:, :, None].expand(-1, -1, ps).reshape(n, -1) & (pos <= qpos[:, None])
    assert torch.equal(got, selection_keys(index_scores(q, w, keys_nsj), pos, valid))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_q", "fp8_q"])
def test_opcheck(backend, q_fp8):
    skip_unless(backend, "cpu")
    lay, pool, ids, slots, qpos, q, w = _case(2, 3, 32, 4, 6, 3, seed=5)
    args = (q, w, pool, ids, slots, qpos, lay.page_size, q_fp8, backend)
    torch.library.opcheck(torch.ops.dtkv.indexer_scores.default, args)
    assert indexer_scores_torch(q, w, pool, ids, slots, qpos, lay.page_size, q_fp8).dtype == torch.int64


def test_rejects_bad_input():
    lay, pool, ids, slots, qpos, q, w = _case(2, 2, 32, 4, 6, 3, seed=1)

    def call(**kw):
        a = {"q": q, "w": w, "pool": pool, "page_ids": ids, "page_slots": slots, "query_pos": qpos} | kw
        return indexer_scores(**a, layout=kw.pop("layout", lay), backend="torch")

    with pytest.raises(ValueError, match=re.escape("q must have shape [*, *, 32] (layout.head_dim), got [2, 2, 16]")):
        call(q=q[..., :16])
    with pytest.raises(TypeError, match=re.escape("w must have dtype [torch.bfloat16, torch.float16")):
        call(w=w.to(torch.int32))
    with pytest.raises(ValueError, match=re.escape("w must have shape [2, 2], got w.shape=[2, 3] (dim 1)")):
        call(w=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=re.escape("pool must have shape [*, 144], got pool.shape=[6, 143]")):
        call(pool=pool[:, :143])
    with pytest.raises(TypeError, match=re.escape("page_ids must have dtype [torch.int32, torch.int64]")):
        call(page_ids=ids.float())
    with pytest.raises(ValueError, match=re.escape("page_ids must have one row per query (2), got page_ids.shape=[1")):
        call(page_ids=ids[:1])
    with pytest.raises(ValueError, match=re.escape("page_slots must have shape [2, 3], got page_slots.shape=[2, 2]")):
        call(page_slots=slots[:, :2])
    with pytest.raises(ValueError, match=re.escape("query_pos must have shape [2], got query_pos.shape=[3]")):
        call(query_pos=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="layout must be a dtkv.IndexerFp8Layout, got str"):
        indexer_scores(q, w, pool, ids, slots, qpos, layout="indexer")


def test_triton_refuses_what_the_kernel_cannot_take():
    skip_unless("triton", "cpu")
    lay, pool, ids, slots, qpos, q, w = _case(2, 2, 32, 4, 6, 3, seed=2, q_dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="q is float64 .*use backend='torch'"):
        indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, backend="triton")
    with pytest.raises(NotImplementedError, match="q is float32 with q_fp8=False"):
        indexer_scores(q.float(), w, pool, ids, slots, qpos, layout=lay, backend="triton")
    odd = IndexerFp8Layout(page_size=3, head_dim=33)  # 99-byte code block: scales not 4-byte aligned
    pool_odd = torch.zeros(4, odd.page_shape[0], dtype=torch.uint8)
    q33 = torch.zeros(2, 2, 33, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="multiples of 4"):
        indexer_scores(q33, w, pool_odd, ids, slots, qpos, layout=odd, backend="triton")
    # auto falls back to torch where the kernel cannot take the arguments
    assert indexer_scores(q33, w, pool_odd, ids, slots, qpos, layout=odd).shape == (2, 9)


_SM90 = textwrap.dedent(
    """
    import os, subprocess, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dtkv.ops.indexer_scores import KERNEL_CONFIG, _indexer_scores_kernel
    sig = {"keys_ptr": "*i64", "q_ptr": "*bf16", "w_ptr": "*fp32", "pool_ptr": "*u8", "ids_ptr": "*i32",
           "slots_ptr": "*i32", "qpos_ptr": "*i32", "num_cols": "i32", "num_page_cols": "i32",
           "num_local_pages": "i32", "page_stride": "i32", "q_sn": "i32", "q_si": "i32", "w_sn": "i32",
           "tiles_per_prog": "i32"}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    cfg = KERNEL_CONFIG
    for fp8 in (True, False):
        const = dict(S=64, NH=64, NHP=64, J=128, JP=128, BLOCK_S=cfg["block_s"], Q_FP8=fp8, PREROUND=False,
                     IMPRECISE_ACC=cfg["imprecise"])
        src = ASTSource(fn=_indexer_scores_kernel, signature={**sig, **{k: "constexpr" for k in const}},
                        constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 10)})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        path = f"/tmp/dtkv_indexer_{os.getpid()}_{fp8}.ptx"
        open(path, "w").write(c.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"], capture_output=True,
                              text=True).stderr
        os.remove(path)
        print(fp8, "wgmma" in c.asm["ptx"], "0 bytes spill stores" in info, c.metadata.shared)
    """
)


@pytest.mark.slow
def test_kernel_builds_for_sm90_with_wgmma_and_no_spills():
    """The kernel as the H200 compiles it (Triton's own sm_90 pipeline and ptxas, no GPU needed): the dot is a
    Hopper ``wgmma`` in both precisions and no register spills at the shipped launch parameters."""
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln.split() for ln in res.stdout.strip().splitlines()]
    assert [ln[:3] for ln in lines] == [["True", "True", "True"], ["False", "True", "True"]], res.stdout


@pytest.mark.parametrize("programs,block_s", [(1, 16), (3, 32), (1056, 128)])
def test_triton_any_grid_gives_the_same_keys(monkeypatch, programs, block_s):
    """Tiles per program (the grid's loop) and the tile width change no key bit (here, under the interpreter): a key
    is scored by the same operations wherever it lands. On a GPU the launch parameters are fixed
    (``KERNEL_CONFIG``), so sharded, full-view and replicated steps score a key with the same instructions."""
    skip_unless("triton", "cpu")
    from dtkv.ops.indexer_scores import KERNEL_CONFIG

    lay, pool, ids, slots, qpos, q, w = _case(3, 4, 32, 16, 9, 7, seed=13)
    base = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=True, backend="triton")
    monkeypatch.setitem(KERNEL_CONFIG, "programs", programs)
    monkeypatch.setitem(KERNEL_CONFIG, "block_s", block_s)
    got = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=True, backend="triton")
    assert torch.equal(got, base)
