"""The attention's input projections as one GEMM in decode steps (:meth:`AbsorbedWeights.input_weight`,
:func:`dtkv.integrations.transformers.attention.projections`'s ``fused``).

``q_a_proj``, ``kv_a_proj_with_mqa`` and the indexer's ``wk`` and ``weights_proj`` all read the layer's hidden
states; at decode's few rows each is a GEMV that reads its weight, and one launch over the four is one pass. The
checks: the weights move into one buffer without a copy kept (the modules' weights become views of its rows, the
same ``Parameter`` objects, computing what they did), the fused projections equal the separate ones, what does not
fuse ends the prefix (another dtype, a bias, a module that is not a plain ``nn.Linear``), a weight given new
storage is found and the buffer built again, one compiled graph serves every layer, and the runtime passes the
buffer in decode steps only (prefill keeps the modules' own GEMMs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")

from dtkv.integrations.transformers import TransformersAdapter, _compile, attention, tiny_model  # noqa: E402
from dtkv.runtime import Runtime, num_pages_for  # noqa: E402


def _inputs(lm, n=5, seed=1):
    x = torch.randn(1, n, lm.config.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=lm.dtype)
    cos, sin = lm.model.rotary_emb(x, torch.arange(3, 3 + n)[None])
    return x, cos, sin


def _close(got, want, tol):
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want) == 6
    for a, b in zip(flat_got, flat_want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["deepseek-v32", "glm5"])
def test_the_input_weights_become_views_of_one_buffer_and_compute_the_same(name):
    lm = tiny_model(name, num_hidden_layers=2, dtype=torch.float32)
    x, cos, sin = _inputs(lm)
    for layer in lm.model.layers:
        attn = layer.self_attn
        mods = attention._input_linears(attn)
        params = [m.weight for m in mods]
        values = [p.detach().clone() for p in params]
        outs = [m(x) for m in mods]
        want = attention.projections(attn, x, cos, sin, *attention._ropes(attn))
        absorbed = attention.AbsorbedWeights(attn)
        fused = absorbed.input_weight()
        assert fused.shape == (sum(m.out_features for m in mods), lm.config.hidden_size)
        assert absorbed.input_weight() is fused  # kept
        a = 0
        for m, p, v, out in zip(mods, params, values, outs):
            assert m.weight is p and torch.equal(p, v)  # the same Parameter, the same values
            assert p.data_ptr() == fused[a].data_ptr()  # a view of the buffer's rows, no copy kept
            assert torch.equal(m(x), out)
            a += p.shape[0]
        got = attention.projections(attn, x, cos, sin, *attention._ropes(attn), fused)
        _close(got, want, 1e-6)
        with torch.no_grad():  # a change in place is seen by both
            mods[1].weight.mul_(2)
        assert torch.equal(fused[mods[0].out_features : a][: mods[1].out_features], mods[1].weight)


def test_what_does_not_fuse_ends_the_prefix():
    lm = tiny_model("deepseek-v32", num_hidden_layers=1, dtype=torch.float32)
    attn = lm.model.layers[0].self_attn
    sizes = [m.out_features for m in attention._input_linears(attn)]
    # the indexer's float32 weights_proj in a bf16 layer (a loaded checkpoint keeps it in float32)
    attn.to(torch.bfloat16)
    attn.indexer.weights_proj.float()
    assert attention.AbsorbedWeights(attn).input_weight().shape[0] == sum(sizes[:3])
    # a bias on kv_a_proj_with_mqa: only q_a_proj would be left, nothing to fuse
    lm = tiny_model("deepseek-v32", num_hidden_layers=1, dtype=torch.float32)
    attn = lm.model.layers[0].self_attn
    attn.kv_a_proj_with_mqa.bias = torch.nn.Parameter(torch.zeros(sizes[1]))
    assert attention.AbsorbedWeights(attn).input_weight() is None

    class Quantized(torch.nn.Linear):  # not a plain nn.Linear: its forward may not be the weight's product
        pass

    attn.kv_a_proj_with_mqa = Quantized(lm.config.hidden_size, sizes[1], bias=False)
    assert attention.AbsorbedWeights(attn).input_weight() is None
    # projections refuses a buffer that is not a prefix of the projections
    x, cos, sin = _inputs(lm)
    with pytest.raises(ValueError, match="prefix of the input projections"):
        attention.projections(attn, x, cos, sin, *attention._ropes(attn), torch.zeros(sizes[0] + 1, x.shape[-1]))


def test_a_weight_given_new_storage_is_found_and_the_buffer_built_again():
    lm = tiny_model("deepseek-v32", num_hidden_layers=1, dtype=torch.float32)
    attn = lm.model.layers[0].self_attn
    absorbed = attention.AbsorbedWeights(attn)
    first = absorbed.input_weight()
    attn.to(torch.float64)  # new storage for every weight
    second = absorbed.input_weight()
    assert second is not first and second.dtype == torch.float64
    assert attn.q_a_proj.weight.data_ptr() == second.data_ptr()
    new = torch.randn_like(attn.indexer.wk.weight)
    attn.indexer.wk.weight = torch.nn.Parameter(new)  # a replaced Parameter
    third = absorbed.input_weight()
    assert third is not second and attn.indexer.wk.weight.data_ptr() == third[sum(
        m.out_features for m in attention._input_linears(attn)[:2])].data_ptr()  # fmt: skip
    assert torch.equal(attn.indexer.wk.weight, new)
    x, cos, sin = _inputs(lm)
    want = attention.projections(attn, x.double(), cos.double(), sin.double(), *attention._ropes(attn))
    got = attention.projections(attn, x.double(), cos.double(), sin.double(), *attention._ropes(attn), third)
    _close(got, want, 1e-12)


def test_one_compiled_graph_serves_every_layer_with_the_buffer():
    from torch._dynamo.utils import counters

    lm = tiny_model("deepseek-v32", num_hidden_layers=4, dtype=torch.float32)
    torch._dynamo.reset()
    project = _compile.compiled_function(attention.projections, when=lambda: True)
    x, cos, sin = _inputs(lm)
    fused = [attention.AbsorbedWeights(layer.self_attn).input_weight() for layer in lm.model.layers]
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layer, w in zip(lm.model.layers, fused):
            attn = layer.self_attn
            got = project(attn, x, cos, sin, *attention._ropes(attn), w)
            _close(got, attention.projections(attn, x, cos, sin, *attention._ropes(attn)), 1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_the_runtime_fuses_in_decode_steps_only(monkeypatch):
    """Each layer call's projections get the buffer exactly when its step is a decode step (``ctx.decoding``), and
    the tokens are those of the compiled run."""
    lm = tiny_model("deepseek-v32", num_hidden_layers=2, dtype=torch.float32)
    fused, decoding = [], []
    real, real_dsa = attention.projections, attention.dsa_attention
    monkeypatch.setattr(attention, "projections", lambda *a: fused.append(len(a) > 6 and a[6] is not None) or real(*a))
    monkeypatch.setattr(attention, "dsa_attention", lambda attn, ctx, *a: decoding.append(ctx.decoding) or real_dsa(
        attn, ctx, *a))  # fmt: skip
    prompts = [list(range(3, 20)), list(range(40, 49))]
    pages = num_pages_for([len(p) for p in prompts], page_size=4, decode_steps=3)
    outs = {}
    for compile_modules in (True, False):
        fused.clear()
        decoding.clear()
        adapter = TransformersAdapter(lm, kv_dtype="bf16", page_size=4, compile_modules=compile_modules)
        with Runtime(adapter, num_pages=pages, attention="torch", cuda_graphs=False) as rt:
            for p in prompts:
                rt.add_request(p)
            rt.prefill(8)
            outs[compile_modules] = rt.decode(3)
    # eager projections (the last run): one call a layer call, the buffer exactly in the decode steps
    assert fused == decoding and True in decoding and False in decoding, (fused, decoding)
    assert outs[True] == outs[False]
