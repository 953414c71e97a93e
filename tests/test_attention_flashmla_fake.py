"""The FlashMLA backend's plumbing on CPU, against a stand-in ``flash_mla`` (``tests/fake_flash_mla.py``).

The stand-in has FlashMLA's interface, input checks, metadata contract and empty-query convention (``out = 0``,
``lse = +inf``) and raises where the real decode kernel would fault (an index past the cache). So this checks what
the seam does around the kernel -- views and reshapes (decode as ``N`` sequences of one query, fp8 prefill as one
sequence of ``N`` queries and its transposed ``lse``), index bounds and padding, metadata planned per shape and
reused, the ``+inf -> -inf`` rewrite, the models' calls at FlashMLA's dims -- on every CI run. The kernels' numerics
are the GPU tests' (``tests/test_attention_cuda.py``).

Tolerances: the stand-in computes in float32 on bf16 queries and bf16-rounded keys; the torch backend in float32 on
the unrounded keys. ``3e-2`` absolute on outputs and log-sum-exps of magnitude ~1 bounds the bf16 roundings (2**-8
relative on queries and keys, one more on the output). The models' checks are greedy tokens (equal in these runs)
and a loose logit bound (see the transformers test).
"""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

import tests.fake_flash_mla as fake
from dtkv import MLAFp8Layout, MLALatentLayout
from dtkv.attention import AttentionFitError, AttentionSpec, resolve_attention
from dtkv.ops import quantize_mla_fp8

H = 64
SCALE = 576**-0.5
FP8 = MLAFp8Layout(page_size=64)
BF16 = MLALatentLayout(page_size=64)


@pytest.fixture
def flashmla(monkeypatch):
    """FlashMLA 'installed' (the stand-in) and 'available' on the CPU device."""
    import dtkv.attention._flashmla as fm
    import dtkv.attention._resolve as res

    monkeypatch.setattr(fm, "availability", lambda name, device: "")
    monkeypatch.setattr(res, "availability", lambda name, device: "")
    monkeypatch.setattr(fm, "flashmla_module", lambda: (fake, ""))
    return lambda layout, topk=100: resolve_attention(
        "flashmla", spec=AttentionSpec(num_heads=H, layout=layout, topk=topk), device="cpu"
    )


def _pages(layout, num_pages, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(num_pages * 64, 576, generator=g) / 2
    rows = quantize_mla_fp8(src, layout) if isinstance(layout, MLAFp8Layout) else src.to(torch.bfloat16)
    return rows.view(num_pages, 64, -1)


def _locs(n, k, num_slots, seed):
    g = torch.Generator().manual_seed(seed)
    locs = torch.randint(-1, num_slots + 40, (n, k), generator=g)  # some past the pages: the seam must drop them
    locs[0] = -1  # an empty query
    return locs


@pytest.mark.parametrize("layout", [pytest.param(FP8, id="fp8"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_flashmla_seam_vs_torch(flashmla, layout, entry):
    backend = flashmla(layout)
    torch_backend = resolve_attention("torch", spec=backend.spec, device="cpu")
    kv = _pages(layout, 5, seed=1)
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(7, H, 576, generator=g) / 4).to(torch.bfloat16)
    locs = _locs(7, 100, 5 * 64, seed=3)
    idx = backend.indices(locs, kv)
    assert idx.shape == (7, 128) and backend.index_width(100) == 128  # padded to FlashMLA's top-k block
    schedule = backend.plan_decode(7, 128) if entry == "decode" else None
    for _ in range(2):  # the second call reuses the schedule's metadata (shapes checked by the stand-in)
        args = dict(softmax_scale=SCALE) if entry == "prefill" else dict(softmax_scale=SCALE, schedule=schedule)
        out, lse = getattr(backend, entry)(q, kv, idx, **args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (7, H, 512)
    assert not out[0].any() and bool((lse[0] == float("-inf")).all())  # FlashMLA's +inf rewritten
    want_out, want_lse = torch_backend.prefill(q, kv, torch_backend.indices(locs, kv), softmax_scale=SCALE)
    assert (out.float() - want_out).abs().max() <= 3e-2
    assert (lse[1:] - want_lse[1:]).abs().max() <= 3e-2
    if schedule is not None:  # fp8: the kernel's metadata, filled by the first call and reused by the second
        assert schedule.ready and (layout is BF16 or schedule.state["meta"].calls == 2)


@pytest.mark.parametrize("reads", [0, 10**9], ids=["dequantized", "fp8-kernel"])
def test_fp8_prefill_takes_the_sparse_prefill_kernel_where_it_reads_each_row_many_times(flashmla, monkeypatch, reads):
    """An fp8 prefill call whose index reads are ``DEQUANT_PREFILL_READS`` times the pages' rows or more dequantizes
    the pages to bf16 once and calls ``flash_mla_sparse_fwd``; below, the fp8 kernel reads them as they are. Both
    agree with the torch backend (the stand-in's tolerance); a width FlashMLA's prefill kernel does not take (not a
    multiple of 128) keeps the fp8 kernel whatever the reads."""
    import dtkv.attention._flashmla as F

    monkeypatch.setattr(F, "DEQUANT_PREFILL_READS", reads)
    calls = []
    for name in ("flash_mla_sparse_fwd", "flash_mla_with_kvcache"):
        real = getattr(fake, name)
        monkeypatch.setattr(fake, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    backend = flashmla(FP8)
    torch_backend = resolve_attention("torch", spec=backend.spec, device="cpu")
    kv = _pages(FP8, 5, seed=1)
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(7, H, 576, generator=g) / 4).to(torch.bfloat16)
    for k, width in ((100, 128), (40, 64)):
        calls.clear()
        locs = _locs(7, k, 5 * 64, seed=3)
        idx = backend.indices(locs, kv)
        assert idx.shape == (7, width)
        out, lse = backend.prefill(q, kv, idx, softmax_scale=SCALE)
        sparse = reads == 0 and width % 128 == 0
        assert calls == ["flash_mla_sparse_fwd" if sparse else "flash_mla_with_kvcache"], calls
        want_out, want_lse = torch_backend.prefill(q, kv, torch_backend.indices(locs, kv), softmax_scale=SCALE)
        assert not out[0].any() and bool((lse[0] == float("-inf")).all())  # the empty query, either kernel
        assert (out.float() - want_out).abs().max() <= 3e-2
        assert (lse[1:] - want_lse[1:]).abs().max() <= 3e-2


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned-storage"])
def test_bf16_rows_are_the_fp8_rows_dequantized(offset):
    """``_bf16_rows`` is :func:`dtkv.ops.dequantize_mla_fp8` rounded to bf16, bit for bit (random per-block
    scales); pages at a storage offset that is not a multiple of 4 bytes are read through a copy."""
    from dtkv.attention._flashmla import _bf16_rows
    from dtkv.ops import dequantize_mla_fp8

    g = torch.Generator().manual_seed(4)
    src = torch.randn(3 * 64, 576, generator=g) * torch.rand(3 * 64, 1, generator=g) * 8
    rows = quantize_mla_fp8(src, FP8)
    buf = torch.zeros(rows.numel() + offset, dtype=torch.uint8)
    buf[offset:] = rows.reshape(-1)
    pages = buf[offset:].view(3, 64, FP8.row_bytes)
    got = _bf16_rows(pages, FP8)
    assert got.shape == (3 * 64, 1, 576) and got.dtype == torch.bfloat16
    assert torch.equal(got[:, 0], dequantize_mla_fp8(pages, FP8).reshape(-1, 576).to(torch.bfloat16))


def test_flashmla_seam_rules(flashmla):
    backend = flashmla(FP8)
    kv = _pages(FP8, 2, seed=0)
    q = torch.zeros(3, H, 576, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=re.escape("q must have dtype torch.bfloat16, got q.dtype=torch.float32")):
        backend.prefill(q.float(), kv, torch.zeros(3, 64, dtype=torch.int32), softmax_scale=SCALE)
    assert backend.cast_queries(q.float()).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=re.escape("flashmla needs int32 indices, got indices.dtype=torch.int64")):
        backend.prefill(q, kv, torch.zeros(3, 64, dtype=torch.int64), softmax_scale=SCALE)
    with pytest.raises(AttentionFitError, match="flashmla needs an index width that is a multiple of 64"):
        backend.decode(q, kv, torch.zeros(3, 100, dtype=torch.int32), softmax_scale=SCALE)
    with pytest.raises(
        ValueError, match=re.escape("schedule was planned for backend 'flashmla' with [N, W] = [4, 64]")
    ):
        backend.decode(q, kv, torch.zeros(3, 64, dtype=torch.int32), softmax_scale=SCALE,
                       schedule=backend.plan_decode(4, 64))  # fmt: skip
    out, lse = backend.decode(q, kv[:0], torch.full((3, 64), -1, dtype=torch.int32), softmax_scale=SCALE)
    assert not out.any() and bool((lse == float("-inf")).all())  # a rank without pages: no kernel call
    with pytest.raises(AttentionFitError, match="flashmla needs 64 or 128 query heads per rank, got num_heads=16"):
        resolve_attention("flashmla", spec=AttentionSpec(num_heads=16, layout=FP8, topk=64), device="cpu")


def test_flashmla_reads_own_pages_and_merges(flashmla):
    """Sharded decode of one rank's own pages (others' rows -1), two 'ranks' merged = decode over the whole pool."""
    from dtkv import PageOwnership
    from dtkv.attention import owned_page_map
    from dtkv.decode import combine_partials

    backend = flashmla(FP8, topk=128)
    full = _pages(FP8, 6, seed=4)
    own = PageOwnership(2, 6, "interleave")
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(3, H, 576, generator=g) / 4).to(torch.bfloat16)
    locs = torch.randint(0, 6 * 64, (3, 128), generator=g)
    locs[2] = 64 + torch.arange(128) % 64  # query 2 reads page 1 only: rank 0 has nothing for it
    want_out, want_lse = backend.decode(q, full, backend.indices(locs, full), softmax_scale=SCALE)
    parts = []
    for rank in range(2):
        local = full[own.local_pages(rank)].contiguous()
        idx = backend.indices(locs, local, page_map=owned_page_map(own, rank))
        parts.append(backend.decode(q, local, idx, softmax_scale=SCALE))
    assert bool((parts[0][1][2] == float("-inf")).all())
    out, lse = combine_partials(torch.stack([p[0].float() for p in parts]), torch.stack([p[1] for p in parts]))
    assert (out - want_out.float()).abs().max() <= 2e-2 and (lse - want_lse).abs().max() <= 1e-5


def _fitting_reference_cfg(kv_dtype):
    from dtkv.model import ModelConfig

    return ModelConfig(num_heads=64, kv_lora_rank=512, rope_dim=64, quant_block=128, page_size=64, kv_dtype=kv_dtype,
                       num_layers=2, d_model=64, index_topk=80)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_reference_model_runs_the_flashmla_path(flashmla, kv_dtype):
    """``Runtime(ReferenceAdapter(cfg), attention="flashmla")`` at FlashMLA's dims: queries cast to bf16, indices bounded and padded,
    fp8 pages read in place; greedy tokens equal the float64 torch path's (margins are wide in this run)."""
    from dtkv.model import ReferenceAdapter
    from dtkv.runtime import Runtime

    outs = {}
    for name in ("torch", "flashmla"):
        eng = Runtime(ReferenceAdapter(_fitting_reference_cfg(kv_dtype)), num_pages=8, attention=name)
        assert eng.attention.name == name
        g = torch.Generator().manual_seed(0)
        for n in (150, 70):
            eng.add_request(torch.randint(0, 97, (n,), generator=g).tolist())
        eng.prefill(100)
        outs[name] = eng.decode(2)
    assert outs["flashmla"] == outs["torch"]


@pytest.mark.parametrize("name", ["deepseek-v32", "glm5"])
def test_transformers_run_the_flashmla_path(flashmla, name):
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    from dtkv.integrations.transformers import TransformersAdapter, tiny_model
    from dtkv.runtime import Runtime, num_pages_for

    lm = tiny_model(
        name, num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 20)]
    pages = num_pages_for([len(p) for p in prompts], page_size=64, decode_steps=2)
    logits = {}
    from dtkv.integrations.transformers import indexer_precision

    for attention in ("torch", "flashmla"):
        # fp8 KV on flashmla runs the fp8 indexer: the torch run takes its math too (the same selections)
        adapter = TransformersAdapter(lm, kv_dtype="fp8", page_size=64)
        with indexer_precision("fp8"), Runtime(adapter, num_pages=pages, attention=attention) as rt:
            assert rt.attention.name == attention
            for p in prompts:
                rt.add_request(p)
            _, lg = rt.prefill(64, return_logits=True)
            logits[attention] = (rt.decode(2), torch.cat(lg))
    assert logits["flashmla"][0] == logits["torch"][0]
    diff = (logits["flashmla"][1] - logits["torch"][1]).abs().max() / logits["torch"][1].abs().max()
    # bf16 queries and keys (the stand-in rounds them as FlashMLA does) through 3 layers of a random model: measured
    # 0.12 of the logits' scale here; the absorbed math itself matches the expanded form to 1e-4 in float32
    # (tests/test_attention_models.py, Triton). This bound only catches plumbing that is wrong, not rounding.
    assert float(diff) <= 0.3, diff


@pytest.mark.parametrize(
    "model",
    [pytest.param("bfloat16", id="transformers-bf16"), pytest.param("float32", id="transformers-fp32"),
     pytest.param("reference", id="reference")],
)  # fmt: skip
def test_sharded_decode_on_one_rank_hands_the_model_its_compute_dtype(flashmla, model, monkeypatch):
    """Sharded decode on FlashMLA with one rank (nothing to merge): the layer's output reaches the model in the
    queries' compute dtype (FlashMLA's partial is bf16; a one-rank step used to hand it on as it was, and the
    transformers model's ``W_UV`` product raised "expected scalar type Float but found BFloat16"), and the greedy
    tokens equal the torch backend's sharded decode (fp8 indexer math on both; margins are wide in this run). A
    bf16 model's absorbed products on FlashMLA are bf16, as its extend steps' (float32 read twice the weight
    bytes a step); a float32 model's, and every model's on the torch backend, float32."""
    from dtkv.runtime import Runtime, num_pages_for

    outs, factors = {}, {}
    if model != "reference":
        import dtkv.integrations.transformers.attention as A

        real = A._factors
        monkeypatch.setattr(A, "_factors", lambda attn, absorbed, dtype: factors[attention].add(dtype) or real(
            attn, absorbed, dtype))  # fmt: skip
    for attention in ("torch", "flashmla"):
        factors[attention] = set()
        if model == "reference":
            from dtkv.model import ReferenceAdapter

            adapter, vocab, precision = ReferenceAdapter(_fitting_reference_cfg("fp8")), 97, contextlib.nullcontext()
        else:
            pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
            from dtkv.integrations.transformers import TransformersAdapter, indexer_precision, tiny_model

            lm = tiny_model("deepseek-v32", num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512,
                            qk_rope_head_dim=64, index_head_dim=128, num_hidden_layers=2, index_topk=64,
                            dtype=getattr(torch, model))  # fmt: skip
            adapter, vocab = TransformersAdapter(lm, kv_dtype="fp8", page_size=64), 256
            precision = indexer_precision("fp8")  # the fp8 indexer on both backends: the same selections
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (150, 20)]  # one longer than top-k
        pages = num_pages_for([len(p) for p in prompts], page_size=64, decode_steps=3)
        with precision, Runtime(adapter, num_pages=pages, attention=attention, decode_mode="sharded") as rt:
            for p in prompts:
                rt.add_request(p)
            rt.prefill(64)
            outs[attention] = rt.decode(2)
    assert outs["flashmla"] == outs["torch"]
    if model != "reference":
        narrow = {torch.bfloat16} if model == "bfloat16" else {torch.float32}
        assert factors == {"torch": {torch.float32}, "flashmla": narrow}, factors


def test_empty_query_rewrite_is_robust_to_either_convention(flashmla, monkeypatch):
    """The seam maps FlashMLA's +inf (and a -inf, should a build return that) to -inf; finite values untouched."""
    backend = flashmla(FP8, topk=64)
    kv = _pages(FP8, 1, seed=0)
    q = torch.zeros(2, H, 576, dtype=torch.bfloat16)
    idx = torch.full((2, 64), -1, dtype=torch.int32)
    idx[1, 0] = 3
    real = fake.flash_mla_with_kvcache

    def minus_inf(*a, **k):
        out, lse = real(*a, **k)
        return out, torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse)

    for fn in (real, minus_inf):
        monkeypatch.setattr(fake, "flash_mla_with_kvcache", fn)
        out, lse = backend.decode(q, kv, idx, softmax_scale=SCALE)
        assert bool((lse[0] == float("-inf")).all()) and torch.allclose(lse[1], torch.zeros(H), atol=1e-6)
        assert math.isfinite(float(out.float().abs().max()))


def test_a_schedule_not_for_merging_skips_the_rewrite(flashmla):
    backend = flashmla(FP8, topk=64)
    kv = _pages(FP8, 1, seed=0)
    q = torch.zeros(2, H, 576, dtype=torch.bfloat16)
    idx = torch.full((2, 64), -1, dtype=torch.int32)
    idx[1, 0] = 3
    out, lse = backend.decode(q, kv, idx, softmax_scale=SCALE, schedule=backend.plan_decode(2, 64, merge_lse=False))
    assert bool((lse[0] == float("inf")).all()) and not out[0].any()  # the kernel's own convention, untouched
    out, lse = backend.decode(q, kv, idx, softmax_scale=SCALE, schedule=backend.plan_decode(2, 64))
    assert bool((lse[0] == float("-inf")).all())


def test_flashmla_index_width_follows_the_kernel(flashmla):
    """The fp8 kernel takes top-k blocks of 64; the bf16 sparse prefill kernel, which also serves bf16 decode, blocks
    of 128 (on an H200 a top-k of 64 failed ``params.topk % (2*B_TOPK) == 0``): the seam pads each accordingly."""
    fp8, bf16 = flashmla(FP8, topk=64), flashmla(BF16, topk=64)
    assert fp8.index_width(64) == 64 and bf16.index_width(64) == 128 and bf16.index_width(129) == 256
    kv = _pages(BF16, 3, seed=4)
    q = (torch.randn(5, H, 576, generator=torch.Generator().manual_seed(5)) / 4).to(torch.bfloat16)
    idx = bf16.indices(_locs(5, 64, 3 * 64, seed=6), kv)
    assert idx.shape == (5, 128)
    out, lse = bf16.prefill(q, kv, idx, softmax_scale=SCALE)  # the stand-in asserts the kernel's rule
    assert out.shape == (5, H, 512) and lse.shape == (5, H)
