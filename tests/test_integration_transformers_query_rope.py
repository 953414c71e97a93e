"""The MLA query's rope written into the absorbed attention's query buffer (:func:`dtkv.ops.rope_interleave_into`),
against the model's own rope (transformers' ``apply_rotary_pos_emb_interleave``) then a copy.

The checks: the op gives the model function's bits on both families' geometry, in bf16 and float32, into bf16 and
float32 buffers, on both backends (the Triton kernel under the interpreter); ``projections(rope_query=False)``
leaves the query unrotated and everything else as before; a prefill step on an absorbed backend takes the op, and
the tokens and stored KV are those of the path without it; the torch backend and decode steps never take it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")

from dtkv.integrations.transformers import TransformersAdapter, attention, tiny_model  # noqa: E402
from dtkv.ops import rope_interleave_into  # noqa: E402
from dtkv.runtime import Runtime, num_pages_for  # noqa: E402
from tests.ops_reference import BACKENDS, skip_unless  # noqa: E402


def _inputs(lm, n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, lm.config.hidden_size, generator=g, dtype=lm.dtype) * 3
    cos, sin = lm.model.rotary_emb(x, torch.arange(1000, 1000 + n)[None])
    return x, cos, sin


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["deepseek-v32", "glm5"])
def test_the_op_is_the_models_rope_then_a_copy(name, dtype, backend):
    skip_unless(backend, "cpu")
    lm = tiny_model(name, num_hidden_layers=1, dtype=dtype)
    attn = lm.model.layers[0].self_attn
    mla_rope, indexer_rope = attention._ropes(attn)
    x, cos, sin = _inputs(lm)
    want = attention.projections(attn, x, cos, sin, mla_rope, indexer_rope)
    raw = attention.projections(attn, x, cos, sin, mla_rope, indexer_rope, rope_query=False)
    # everything but the rope query is what it was, bit for bit; the rope query is the unrotated split
    for a, b in zip(torch.utils._pytree.tree_leaves((want[0], want[2], want[3])),
                    torch.utils._pytree.tree_leaves((raw[0], raw[2], raw[3]))):  # fmt: skip
        assert torch.equal(a, b)
    h, n, e = attn.num_heads, x.shape[1], attn.qk_rope_head_dim
    q_full = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, n, h, -1).transpose(1, 2)
    assert torch.equal(raw[1], q_full[..., attn.qk_nope_head_dim :])
    for out_dtype in (torch.bfloat16, torch.float32):
        r = 8
        buf = torch.full((n, h, r + e), 7.0, dtype=out_dtype)
        rope_interleave_into(buf[..., r:], raw[1][0], cos[0], sin[0], backend=backend)
        assert torch.equal(buf[..., r:], want[1][0].transpose(0, 1).to(out_dtype))
        assert bool((buf[..., :r] == 7.0).all())  # nothing else written


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape", [(1, 1, 2), (3, 7, 6), (5, 13, 10), (128, 3, 64)], ids=lambda s: "x".join(map(str, s))
)
def test_awkward_shapes_and_strides_against_the_reference(shape, backend):
    """Pair counts that are not powers of two, one head or token, a head-major view with a wider row (a
    projection's output), an output inside a wider buffer: the reference's bits, every other column untouched."""
    from dtkv.ops.rope_interleave_into import rope_interleave_torch

    skip_unless(backend, "cpu")
    h, n, e = shape
    g = torch.Generator().manual_seed(sum(shape))
    for dtype in (torch.bfloat16, torch.float32):
        wide = (torch.randn(n, h, e + 5, generator=g) * 50).to(dtype)
        x = wide.transpose(0, 1)[..., 3 : 3 + e]  # [H, N, E], strides (e + 5, h * (e + 5), 1)
        ang = torch.rand(n, e // 2, generator=g) * 1000
        cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
        for out_dtype in (torch.bfloat16, torch.float32):
            buf = torch.full((n, h, e + 4), -3.0, dtype=out_dtype)
            rope_interleave_into(buf[..., 4:], x, cos, sin, backend=backend)
            assert torch.equal(buf[..., 4:], rope_interleave_torch(x, cos, sin).to(out_dtype))
            assert bool((buf[..., :4] == -3.0).all())


def test_bad_input_raises_and_writes_nothing():
    x = torch.randn(3, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    out = torch.zeros(5, 3, 8)
    with pytest.raises(ValueError, match=r"x must have an even number of rope dims \(pairs\), got x.shape=\[3, 5, 7\]"):
        rope_interleave_into(out[..., :7], x[..., :7], cos[:, :7], sin[:, :7])
    with pytest.raises(TypeError, match=r"cos must have dtype torch.float32, got cos.dtype=torch.bfloat16"):
        rope_interleave_into(out, x, cos.bfloat16(), sin)
    with pytest.raises(ValueError, match=r"out must have shape \[5, 3, 8\], got out.shape=\[3, 5, 8\]"):
        rope_interleave_into(out.transpose(0, 1).contiguous(), x, cos, sin)
    with pytest.raises(ValueError, match=r"x must have a contiguous last dim"):
        rope_interleave_into(out, x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin)
    with pytest.raises(TypeError, match=r"x must have dtype \[torch.bfloat16, torch.float32\]"):
        rope_interleave_into(out, x.half(), cos.half(), sin.half())
    assert not out.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows(backend):
    skip_unless(backend, "cpu")
    out = torch.zeros(0, 3, 8)
    rope_interleave_into(out, torch.zeros(3, 0, 8), torch.zeros(0, 8), torch.zeros(0, 8), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    skip_unless(backend, "cpu")
    x, cos, sin = torch.randn(3, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    out = torch.zeros(5, 3, 8)
    torch.library.opcheck(torch.ops.dtkv.rope_interleave_into.default, (out, x, cos, sin, backend))


def _run(lm, attention_name, prompts):
    pages = num_pages_for([len(p) for p in prompts], page_size=4, decode_steps=2)
    adapter = TransformersAdapter(lm, kv_dtype="bf16", page_size=4, compile_modules=False)
    with Runtime(adapter, num_pages=pages, attention=attention_name, cuda_graphs=False) as rt:
        reqs = [rt.add_request(p) for p in prompts]
        rt.prefill(8)
        tokens = rt.decode(2)
        kv = [rt.kv_bytes(r.rid)["kv"] for r in reqs]
    return tokens, kv


@pytest.mark.slow  # a Triton attention under the interpreter, twice
def test_a_prefill_on_an_absorbed_backend_takes_the_op_with_the_same_result(monkeypatch):
    skip_unless("triton", "cpu")
    lm = tiny_model("deepseek-v32", num_hidden_layers=2, dtype=torch.bfloat16)
    prompts = [list(range(3, 20)), list(range(40, 49))]
    calls = []
    real = attention.ops.rope_interleave_into
    monkeypatch.setattr(attention.ops, "rope_interleave_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = _run(lm, "triton", prompts)
    # prompts of 17 and 9 in chunks of 8: 2 layers x 2 extend steps (the third, one token a request, and the
    # decode steps are decode steps: ctx.decoding, the model's rope, compiled with the projections there)
    assert len(calls) == 2 * 2, len(calls)
    monkeypatch.setattr(attention, "fuses_query_rope", lambda *a: False)
    calls.clear()
    plain = _run(lm, "triton", prompts)
    assert not calls
    assert fused[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(fused[1], plain[1]))


def test_the_torch_backend_never_takes_the_op(monkeypatch):
    lm = tiny_model("deepseek-v32", num_hidden_layers=1, dtype=torch.float32)
    monkeypatch.setattr(attention.ops, "rope_interleave_into", lambda *a, **k: pytest.fail("torch took the op"))
    _run(lm, "torch", [list(range(3, 12))])


@pytest.mark.gpu
def test_cuda_kernel_vs_reference_at_deepseek_dims():
    """On a GPU, a prefill chunk's rope queries (8192 tokens x 128 heads x 64 dims, a view of ``q_b_proj``'s
    output) into a ``[N, H, 576]`` bf16 query buffer: the reference's bits."""
    from dtkv.ops.rope_interleave_into import rope_interleave_torch

    n, h = 8192, 128
    q = torch.randn(1, n, h, 192, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    x = q[0, :, :, 128:]
    ang = torch.rand(n, 32, device="cuda") * 8192
    cos, sin = (torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16())
    buf = torch.zeros(n, h, 576, device="cuda", dtype=torch.bfloat16)
    rope_interleave_into(buf[..., 512:], x, cos, sin, backend="triton")
    assert torch.equal(buf[..., 512:], rope_interleave_torch(x, cos, sin))
