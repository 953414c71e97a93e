"""``dtkv::indexer_scores``: every Triton launch variant (page tiles by TMA or ``cp.async``, one or two pages per
iteration, the column kernel) against the torch reference, and bitwise against each other whatever the grid; the
reference against an independent per-key loop, the float64 path bitwise against the decode path it replaces, the
launch table and its buckets, opcheck, errors, and the kernels' sm_90 builds (wgmma, TMA, no register spills)
without a GPU.

Tolerances. Positions and masks are integers: equal. Scores: the kernel applies the key scale after the head sum
and sums in the dot's order, the reference dequantizes first (float32): relative differences of a few float32 ulps
of the row's largest ``|score|``; we allow 1e-5 (a wrong key, head or scale moves a score by O(1)). The reference
against the float64 loop: float32 rounding of dequantized keys and sums, 1e-5 likewise.
"""

from __future__ import annotations

import json
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
from dtkv.ops.indexer_scores import (
    DEFAULT_LAUNCH,
    LAUNCH_TABLE,
    IndexerLaunch,
    indexer_scores_torch,
    launch_bucket,
    launch_config,
    use_launch,
)
from tests.ops_reference import BACKENDS, skip_unless

_mod = sys.modules["dtkv.ops.indexer_scores"]  # the package's attribute of that name is the function

LAUNCHES = {
    "pages_cp_async": DEFAULT_LAUNCH,
    "pages_tma": IndexerLaunch(tma=True),
    "pages_tma_x2": IndexerLaunch(tma=True, pages_per_iter=2, num_stages=6),
    "pages_cp_async_x2": IndexerLaunch(pages_per_iter=2),
    "pages_cp_async_r96": IndexerLaunch(ctas_per_sm=5, maxnreg=96),
    "pages_merged2": IndexerLaunch(merge=True, pages_per_iter=2, num_warps=8),
    "pages_merged4": IndexerLaunch(merge=True, pages_per_iter=4, num_stages=6),
    "cols_64": IndexerLaunch(kernel="cols", num_stages=4, ctas_per_sm=8),
    "cols_128": IndexerLaunch(kernel="cols", block_s=128, num_warps=8),
}


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


def _strided(pool: torch.Tensor, extra: int) -> torch.Tensor:
    """The same pages ``extra`` bytes apart (a pool whose page stride exceeds its page bytes)."""
    out = torch.zeros(pool.shape[0], pool.shape[1] + extra, dtype=torch.uint8)
    out[:, : pool.shape[1]] = pool
    return out[:, : pool.shape[1]]


@pytest.mark.parametrize("sms", [132, 1], ids=["one_page_per_program", "pages_per_program"])
@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_q", "fp8_q"])
@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: "n{}_i{}_j{}_s{}_p{}_l{}".format(*g))
@pytest.mark.parametrize("launch", list(LAUNCHES), ids=str)
def test_triton_vs_reference(monkeypatch, launch, geom, q_fp8, sms):
    """Every launch, one page per program (the grid's target over 132 SMs exceeds the pages) and many (one SM: the
    pipelined loop, the second page of a pair past a program's end). Pools of 144, 260, 1088 and 1056-byte pages:
    the 260-byte one has no 16-byte alignment, so TMA launches fall back to ``cp.async``."""
    skip_unless("triton", "cpu")
    monkeypatch.setattr(_mod, "_num_sms", lambda device: sms)
    lay, pool, ids, slots, qpos, q, w = _case(*geom, seed=7 * sum(geom))
    a = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="torch")
    with use_launch(LAUNCHES[launch]):
        b = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="triton")
    sa, pa, va = unpack_keys(a)
    sb, pb, vb = unpack_keys(b)
    assert torch.equal(va, vb) and torch.equal(pa, pb)
    if va.any():
        rel = float((sa[va] - sb[va]).abs().max() / sa[va].abs().max().clamp(min=1e-30))
        assert rel < 1e-5, rel


@pytest.mark.parametrize("extra", [16, 4], ids=["stride_aligned", "stride_unaligned"])
@pytest.mark.parametrize("launch", ["pages_tma", "pages_cp_async", "cols_64"], ids=str)
def test_triton_strided_pool(monkeypatch, launch, extra):
    """Pages ``extra`` bytes apart: the kernels read page ``p`` at ``p * page_stride`` (TMA where the stride is a
    multiple of 16)."""
    skip_unless("triton", "cpu")
    monkeypatch.setattr(_mod, "_num_sms", lambda device: 2)
    lay, pool, ids, slots, qpos, q, w = _case(3, 4, 32, 4, 9, 6, seed=23)
    strided = _strided(pool, extra)
    assert strided.stride(0) == pool.shape[1] + extra
    want = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=True, backend="torch")
    with use_launch(LAUNCHES[launch]):
        got = indexer_scores(q, w, strided, ids, slots, qpos, layout=lay, q_fp8=True, backend="triton")
    sa, pa, va = unpack_keys(want)
    sb, pb, vb = unpack_keys(got)
    assert torch.equal(va, vb) and torch.equal(pa, pb)
    assert float((sa[va] - sb[va]).abs().max() / sa[va].abs().max()) < 1e-5


def test_tma_only_where_the_pool_allows():
    """TMA descriptors where the pool, its page stride and rows are 16-byte aligned; ``cp.async`` otherwise."""
    skip_unless("triton", "cpu")
    if _mod.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side TMA descriptors")
    lay = IndexerFp8Layout(page_size=4, head_dim=32)
    g = torch.Generator().manual_seed(0)
    pool = _pool(6, lay, g)
    assert _mod._tma_descriptors(pool, 4, 32, 16, 32) is not None
    assert _mod._tma_descriptors(_strided(pool, 4), 4, 32, 16, 32) is None  # page stride 148
    assert _mod._tma_descriptors(pool[:0], 4, 32, 16, 32) is None  # no page
    assert _mod._tma_descriptors(pool.view(-1)[16:][: 5 * 144].view(5, 144), 4, 32, 16, 32) is not None
    assert _mod._tma_descriptors(pool.view(-1)[4:][: 5 * 144].view(5, 144), 4, 32, 16, 32) is None  # offset 4
    odd = IndexerFp8Layout(page_size=5, head_dim=48)
    assert _mod._tma_descriptors(_pool(3, odd, g), 5, 48, 16, 64) is None  # 260-byte pages


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
    import dataclasses, json, os, re, subprocess, sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dtkv.ops._indexer_kernels import indexer_cols_kernel, indexer_pages_kernel
    from dtkv.ops.indexer_scores import DEFAULT_LAUNCH, LAUNCH_TABLE
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sig = {"keys_ptr": "*i64", "q_ptr": "*bf16", "w_ptr": "*fp32", "pool_ptr": "*u8", "ids_ptr": "*i32",
           "slots_ptr": "*i32", "qpos_ptr": "*i32", "num_cols": "i32", "num_page_cols": "i32",
           "num_local_pages": "i32", "page_stride": "i32", "q_sn": "i32", "q_si": "i32", "w_sn": "i32",
           "tiles_per_prog": "i32", "pages_per_prog": "i32",
           "k_desc": "tensordesc<fp8e4nv[1, 64, 128]>", "s_desc": "tensordesc<fp32[1, 64]>"}
    div = ("keys_ptr", "q_ptr", "w_ptr", "pool_ptr", "ids_ptr", "slots_ptr", "qpos_ptr", "page_stride", "q_sn",
           "q_si", "w_sn")  # what the launcher specializes at DeepSeek-V3.2 geometry (multiples of 16)
    launches = [DEFAULT_LAUNCH, dataclasses.replace(DEFAULT_LAUNCH, tma=True),
                dataclasses.replace(DEFAULT_LAUNCH, merge=True, pages_per_iter=2, num_warps=8), *LAUNCH_TABLE.values()]
    for cfg in launches:
        for fp8 in (True, False):
            const = dict(S=64, NH=64, NHP=64, J=128, JP=128, Q_FP8=fp8, PREROUND=False, IMPRECISE_ACC=cfg.imprecise)
            if cfg.kernel == "pages":
                fn = indexer_pages_kernel
                tma = cfg.tma and not cfg.merge
                const.update(SP=64, PAGES=cfg.pages_per_iter, MERGE=cfg.merge, NUM_STAGES=cfg.num_stages, TMA=tma)
                if not tma:
                    const.update(k_desc=None, s_desc=None)
            else:
                fn, const["BLOCK_S"] = indexer_cols_kernel, cfg.block_s
            s = {k: sig[k] for k in fn.arg_names if k in sig and k not in const}
            src = ASTSource(fn=fn, signature={**s, **{k: "constexpr" for k in const}}, constexprs=const,
                            attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div})
            opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "maxnreg": cfg.maxnreg or None}
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            path = f"/tmp/dtkv_indexer_{os.getpid()}.cubin"  # the cubin Triton built with the ptxas it picks
            open(path, "wb").write(c.asm["cubin"])
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
            os.remove(path)
            regs, local = map(int, re.search(r"REG:(\\d+) .*LOCAL:(\\d+)", usage).groups())
            ptx = c.asm["ptx"]
            print(json.dumps({"launch": repr(cfg), "fp8": fp8, "wgmma": "wgmma" in ptx,
                              "tma": "cp.async.bulk.tensor" in ptx, "want_tma": cfg.kernel == "pages" and tma,
                              "no_spills": local == 0, "smem": c.metadata.shared, "registers": regs}))
    """
)


@pytest.mark.slow
def test_kernel_builds_for_sm90_with_wgmma_and_no_spills():
    """The kernels as the H200 compiles them (Triton's own sm_90 pipeline and ptxas, no GPU needed), at the default
    launch, its TMA twin, the merged two-page tile and every table entry: the dot is a Hopper ``wgmma`` in both
    precisions, TMA launches issue TMA loads, no register spills (no local memory in the cubin Triton built, read
    with ``cuobjdump``: Triton 3.9 assembles sm_90 with its newer ``ptxas-blackwell``). At the default launch the fp8
    kernel fits 4 programs per SM (at most 128 registers per thread and 56 KB of shared memory), which its grid
    assumes."""
    triton = pytest.importorskip("triton")
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("Triton's NVIDIA backend (ptxas, cuobjdump) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(ln) for ln in res.stdout.strip().splitlines()]
    assert len(rows) == 2 * (3 + len(LAUNCH_TABLE)), res.stdout
    for r in rows:
        assert r["wgmma"] and r["no_spills"] and r["tma"] == r["want_tma"], r
    first = rows[0]
    assert first["fp8"] and first["registers"] <= 128 and first["smem"] <= 56 * 1024, first


def _height_ordered_matmul(a, b, dtype=None, **kwargs):
    """A float32 matmul whose summation order depends on the tile's height, as a BLAS kernel's may (OpenBLAS's
    AVX2 kernels sum a 64-row tile in another order than a 16-row one): ascending over ``K`` for tiles of up to 16
    rows, descending above."""
    import numpy as np

    a, b = np.asarray(a, dtype=dtype or np.float32), np.asarray(b, dtype=dtype or np.float32)
    order = range(a.shape[-1]) if a.shape[-2] <= 16 else reversed(range(a.shape[-1]))
    acc = np.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype)
    for k in order:
        acc += a[..., k : k + 1] * b[..., k : k + 1, :]
    return acc


@pytest.mark.parametrize("matmul", ["numpy", "height_ordered"])
@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_q", "fp8_q"])
@pytest.mark.parametrize("sms", [1, 3, 132])
@pytest.mark.parametrize("launch", list(LAUNCHES), ids=str)
def test_triton_any_launch_gives_the_same_keys(monkeypatch, launch, sms, q_fp8, matmul):
    """Every launch and grid gives the default launch's bits (here, under the interpreter): a key is scored in one
    order of operations wherever it lands (tiles of 16 to 64 rows here). The interpreter's dot does not go through
    numpy's matmul, whose order follows the BLAS kernel (``height_ordered``: one that orders by the tile's height;
    with numpy's own, ``OPENBLAS_CORETYPE=Haswell`` used to give 1 key of 336 other bits in 9 of 27 cases). On a
    GPU the sweep checks the same before a launch enters the table, and ``bench_indexer_scores.py --check-launches``
    checks every launch."""
    skip_unless("triton", "cpu")
    if matmul == "height_ordered":
        import triton.runtime.interpreter as interpreter

        monkeypatch.setattr(interpreter.np, "matmul", _height_ordered_matmul)
    lay, pool, ids, slots, qpos, q, w = _case(3, 4, 32, 16, 9, 7, seed=13)
    with use_launch(DEFAULT_LAUNCH):
        base = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="triton")
    monkeypatch.setattr(_mod, "_num_sms", lambda device: sms)
    with use_launch(LAUNCHES[launch]):
        got = indexer_scores(q, w, pool, ids, slots, qpos, layout=lay, q_fp8=q_fp8, backend="triton")
    assert torch.equal(got, base)


def test_launch_table_buckets_and_override(monkeypatch):
    assert [launch_bucket(n, 131072) for n in (1, 2, 4, 5, 64)] == [(0, 0), (1, 0), (1, 0), (2, 0), (2, 0)]
    assert [launch_bucket(1, k) for k in (64, 262144, 262145, 1 << 20)] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    fast = IndexerLaunch(num_stages=12, ctas_per_sm=2)
    monkeypatch.setitem(LAUNCH_TABLE, (1, 0), fast)
    assert launch_config(3, 131072) is fast
    assert launch_config(16, 131072) == LAUNCH_TABLE.get((2, 0), DEFAULT_LAUNCH)
    other = IndexerLaunch(kernel="cols")
    with use_launch(other):
        assert launch_config(3, 131072) is other
        with use_launch(DEFAULT_LAUNCH):
            assert launch_config(3, 131072) is DEFAULT_LAUNCH
        assert launch_config(3, 131072) is other
    assert launch_config(3, 131072) is fast
    with pytest.raises(TypeError, match="cfg must be an IndexerLaunch, got dict"), use_launch({"kernel": "cols"}):
        pass


def test_launch_table_entries_are_valid():
    """What ``--apply-table`` wrote: cells of the bucket grid, each a launch (the sweep admits bitwise ones only)."""
    for (b, k), cfg in LAUNCH_TABLE.items():
        assert 0 <= b <= len(_mod.BATCH_BUCKETS) and 0 <= k <= len(_mod.KEY_BUCKETS), (b, k)
        assert isinstance(cfg, IndexerLaunch) and cfg.num_warps == 4 and cfg.imprecise == 0, cfg


def test_rejects_bad_launch():
    with pytest.raises(ValueError, match=re.escape("kernel must be one of ('pages', 'cols'), got kernel='tiles'")):
        IndexerLaunch(kernel="tiles")
    with pytest.raises(ValueError, match=re.escape("num_stages must be an int >= 1, got num_stages=0")):
        IndexerLaunch(num_stages=0)
    with pytest.raises(ValueError, match=re.escape("ctas_per_sm must be an int >= 1, got ctas_per_sm=True")):
        IndexerLaunch(ctas_per_sm=True)
    with pytest.raises(ValueError, match=re.escape("pages_per_iter must be a power of two, got pages_per_iter=3")):
        IndexerLaunch(pages_per_iter=3)
    with pytest.raises(TypeError, match=re.escape("merge and tma must be bools, got merge=1, tma=False")):
        IndexerLaunch(merge=1)
    with pytest.raises(ValueError, match=re.escape("maxnreg must be an int >= 0, got maxnreg=-1")):
        IndexerLaunch(maxnreg=-1)
    with pytest.raises(ValueError, match=re.escape("block_s must be a power of two >= 16, got block_s=48")):
        IndexerLaunch(block_s=48)
