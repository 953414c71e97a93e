"""``TransformersAdapter(compile_modules=...)``: the model's norms and MLP / MoE blocks, and the attention's
projections, compiled in decode steps.

The compiled decode gives the eager decode's tokens and KV (inductor on a CPU, float32: logits within 1e-5 of their
scale), only decode steps take the compiled forwards (prefill and ``batch_invariant`` run the originals), closing
the runtime leaves the model as loaded, and bad input raises with nothing bound.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")

from dtkv.integrations.transformers import (  # noqa: E402
    TransformersAdapter,
    _compile,  # noqa: E402
    tiny_model,
)
from dtkv.runtime import Runtime, num_pages_for  # noqa: E402

LENS = (13, 5, 1)  # a prime, a partial page, one token


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENS]


def _lm():
    return tiny_model("deepseek-v32", num_hidden_layers=3, dtype=torch.float32)


def _bound(lm) -> list[str]:
    """Names of the modules of ``lm`` with an instance ``forward``."""
    return [name for name, m in lm.named_modules() if "forward" in vars(m)]


def _run(lm, *, compile_modules, steps=4, batch_invariant=False, graphs="emulate"):
    ad = TransformersAdapter(lm, kv_dtype="fp8", page_size=4, compile_modules=compile_modules)
    pages = num_pages_for(LENS, page_size=4, decode_steps=steps + 2)
    with Runtime(ad, num_pages=pages, cuda_graphs=graphs, batch_invariant=batch_invariant) as rt:
        for p in _prompts(rt.model_spec.vocab_size):
            rt.add_request(p)
        rt.prefill(8)
        kv = rt.kv_bytes(0)  # prefill's KV (its steps stay eager)
        outs, logits = rt.decode(steps, return_logits=True)
        bound = _bound(lm)
    return {"outs": outs, "logits": logits, "kv": kv, "bound": bound}


def _counting(monkeypatch) -> dict:
    """Replace ``torch.compile`` in the module with one that counts the compiled forwards' calls (no compiler)."""
    calls = {"n": 0}

    def fake_compile(fn, **kw):
        assert kw == {"fullgraph": True}

        def compiled(*a, **k):
            calls["n"] += 1
            return fn(*a, **k)

        return compiled

    monkeypatch.setattr(_compile.torch, "compile", fake_compile)
    return calls


def test_compiled_decode_gives_the_eager_decode():
    """Inductor on a CPU: the same tokens as the eager modules, logits within 1e-5 of their scale, prefill's KV
    bytes unchanged (a decode step's rows may round to other fp8 codes: the fused norms sum in another order);
    while the runtime is open the norms and MLP / MoE blocks have their compiled forwards (the attention's norms
    compile inside its projections, no forward of their own), after it none do."""
    lm = _lm()
    eager = _run(lm, compile_modules=False)
    compiled = _run(lm, compile_modules=True)
    assert compiled["outs"] == eager["outs"]
    for a, b in zip(compiled["logits"], eager["logits"]):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    assert all(torch.equal(compiled["kv"][n], eager["kv"][n]) for n in eager["kv"])
    names = set(compiled["bound"]) - set(eager["bound"])
    layer = "model.layers.2."
    assert {layer + n for n in ("input_layernorm", "post_attention_layernorm", "mlp")} <= names
    assert not {layer + n for n in ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")} & names
    assert "model.layers.0.mlp" in names  # a dense MLP
    assert _bound(lm) == []


def test_only_decode_steps_take_the_compiled_forwards(monkeypatch):
    calls = _counting(monkeypatch)
    lm = _lm()
    ad = TransformersAdapter(lm, kv_dtype="fp8", page_size=4, compile_modules=True)
    with Runtime(ad, num_pages=num_pages_for(LENS, page_size=4, decode_steps=4), cuda_graphs="emulate") as rt:
        for p in _prompts(rt.model_spec.vocab_size):
            rt.add_request(p)
        rt.prefill(8)
        assert calls["n"] == 0
        rt.decode(1)
        per_step = calls["n"]
        assert per_step == 3 * 4  # 3 layers x (2 norms, the MLP / MoE, the attention's projections)
        rt.decode(2)
        assert calls["n"] == 3 * per_step


def test_batch_invariant_runs_the_original_forwards(monkeypatch):
    """Under ``batch_invariant`` (a TorchFunctionMode) the products must see every call: no compiled call."""
    calls = _counting(monkeypatch)
    _run(_lm(), compile_modules=True, steps=2, batch_invariant=True, graphs=False)
    assert calls["n"] == 0


def test_defaults_and_bad_input():
    lm = _lm()
    assert TransformersAdapter(lm).compile_modules is False  # a CPU model
    with pytest.raises(TypeError, match=r"compile_modules must be a bool or None, got compile_modules='yes'"):
        TransformersAdapter(lm, compile_modules="yes")
    assert _bound(lm) == []


def test_a_module_bound_elsewhere_refuses_the_bind_and_binds_nothing():
    lm = _lm()
    lm.model.layers[1].mlp.forward = lambda x: x  # someone else's forward
    ad = TransformersAdapter(lm, kv_dtype="fp8", page_size=4, compile_modules=True)
    with pytest.raises(ValueError, match=r"modules must not have a bound forward to compile, got one on"):
        Runtime(ad, num_pages=16)
    assert _bound(lm) == ["model.layers.1.mlp"]  # the attention modules were unbound again


def test_moe_blocks_with_syncing_experts_stay_eager():
    lm = _lm()
    with_moe = {id(m) for m in _compile.compile_targets(lm, moe_ok=True)}
    without = {id(m) for m in _compile.compile_targets(lm, moe_ok=False)}
    moe = [layer.mlp for layer in lm.model.layers if hasattr(layer.mlp, "experts")]
    assert moe and all(id(m) in with_moe and id(m) not in without for m in moe)
    assert id(lm.model.layers[0].mlp) in without  # the dense MLP compiles either way
    lm.set_experts_implementation("eager")
    ad = TransformersAdapter(lm, kv_dtype="fp8", page_size=4, compile_modules=True)
    with Runtime(ad, num_pages=16, cuda_graphs=False):
        assert all("forward" not in vars(m) for m in moe)


@pytest.mark.gpu
def test_captured_compiled_decode_on_a_gpu():
    """bf16 on CUDA (the default there): compiled modules capture into the decode graphs (every step replays
    after the first of its bucket) and the first step's logits stay within 2% of their scale of the eager
    modules' (bf16 norms fused: other roundings)."""
    lm = tiny_model("deepseek-v32", num_hidden_layers=3, dtype=torch.bfloat16, device="cuda")
    assert TransformersAdapter(lm).compile_modules is True
    runs = {}
    for on in (True, False):
        ad = TransformersAdapter(lm, kv_dtype="fp8", page_size=4, compile_modules=on)
        with Runtime(ad, num_pages=num_pages_for(LENS, page_size=4, decode_steps=8), cuda_graphs=True) as rt:
            for p in _prompts(rt.model_spec.vocab_size):
                rt.add_request(p)
            rt.prefill(8)
            outs, logits = rt.decode(6, return_logits=True)
            runs[on] = (logits, dict(rt.graphs.stats))
    st = runs[True][1]
    assert st["eager_steps"] == 0 and st["replays"] >= 4, st
    a, b = runs[True][0][0].float(), runs[False][0][0].float()
    assert float((a - b).abs().max()) <= 2e-2 * float(b.abs().max())
    assert _bound(lm) == []


def test_a_module_whose_compile_fails_runs_eager_from_then_on(monkeypatch, caplog):
    """Dynamo's recompile limit under fullgraph (a process running many configurations of one class, such as a
    test session) raises while tracing: that module runs its original forward, and a warning names its class."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    tried = {"n": 0}

    def failing_compile(fn, **kw):
        def compiled(*a, **k):
            tried["n"] += 1
            raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

        return compiled

    monkeypatch.setattr(_compile.torch, "compile", failing_compile)
    monkeypatch.setattr(_compile, "_WARNED", set())
    lm = _lm()
    eager = _run(lm, compile_modules=False, steps=2)
    with caplog.at_level("WARNING", logger=_compile.__name__):
        got = _run(lm, compile_modules=True, steps=2)
    assert got["outs"] == eager["outs"]
    assert all(torch.equal(a, b) for a, b in zip(got["logits"], eager["logits"]))
    assert tried["n"] == 10  # each of the 9 modules and the projections tried once, then eager
    assert "runs its eager forward from now on" in caplog.text and "FailOnRecompileLimitHit" in caplog.text


def test_the_projections_compile_once_for_every_layer():
    """One graph serves every layer (the modules are arguments, their parameters the graph's inputs; Dynamo would
    raise on a recompile here), and it computes what the eager function does (inductor on a CPU, float32)."""
    from torch._dynamo.utils import counters

    from dtkv.integrations.transformers import attention

    lm = tiny_model("deepseek-v32", num_hidden_layers=4, dtype=torch.float32)
    torch._dynamo.reset()
    project = _compile.compiled_function(attention.projections, when=lambda: True)
    x = torch.randn(1, 5, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = lm.model.rotary_emb(x, torch.arange(3, 8)[None])
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layer in lm.model.layers:
            attn = layer.self_attn
            got = project(attn, x, cos, sin, *attention._ropes(attn))
            want = attention.projections(attn, x, cos, sin, *attention._ropes(attn))
            flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
            assert len(flat_got) == len(flat_want) == 6
            for a, b in zip(flat_got, flat_want):
                assert a.shape == b.shape and a.dtype == b.dtype
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1
