"""Every model takes an attention backend: ``Runtime(ReferenceAdapter(cfg), attention=...)`` and
``Runtime(TransformersAdapter(model, ...), attention=...)``.

On CPU the Triton backend runs under the interpreter, so the same seam the GPU uses (the reference model's attention
over stored pages; the transformers models' absorbed form through ``kv_b_proj`` and, with fp8 KV, the fp8 indexer
kernel) is checked here against the torch path: greedy tokens equal, logits within float32 rounding. Tolerance: the Triton kernel computes in float32 (the
reference model's float64 queries are cast), and the transformers torch path expands keys instead (another
summation order, and bf16 KV rounded at other points); measured max relative logit differences: <= 1.2e-7 on the
reference model, <= 9e-5 on the transformers models (GLM-5, bf16 KV). ``1e-3`` of the logits' scale bounds both.
"""

from __future__ import annotations

import re

import pytest
import torch

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime, num_pages_for
from tests._runtime import reference_runtime
from tests.ops_reference import backend_ok

pytestmark = pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="needs Triton in interpreter mode")


def _reference_run(attention, kv_dtype, mode="single", group=None):
    cfg = ModelConfig(kv_dtype=kv_dtype, page_size=4, num_layers=2)
    eng = reference_runtime(cfg, mode=mode, group=group, num_pages=64, attention=attention)
    g = torch.Generator().manual_seed(1)
    for n in (37, 11):
        eng.add_request(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist())
    logits = [eng.step(eng.requests, [20, 11])]
    logits.append(eng.step(eng.requests[:1], [17]))
    first = [int(row.argmax()) for row in logits[-1]]
    eng.requests[0].output.append(first[0])
    eng.requests[1].output.append(int(logits[0][1].argmax()))
    logits.append(eng.decode_step(eng.requests))
    return eng, logits


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_reference_model_triton_vs_torch(kv_dtype):
    eng_t, want = _reference_run("torch", kv_dtype)
    eng_k, got = _reference_run("triton", kv_dtype)
    assert eng_t.attention.name == "torch" and eng_k.attention.name == "triton"
    assert eng_k.attention.reason == "attention='triton' asked for"
    for a, b in zip(got, want):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-3


def test_reference_model_default_on_cpu_is_torch_and_flashmla_is_refused_up_front():
    eng = Runtime(ReferenceAdapter(ModelConfig(page_size=4)), num_pages=8)
    assert eng.attention.name == "torch" and eng.attention.reason == "auto on cpu: fastest available that fits"
    with pytest.raises(NotImplementedError, match=re.escape("attention='flashmla' is unavailable")):
        Runtime(ReferenceAdapter(ModelConfig(page_size=4)), num_pages=8, attention="flashmla")


def _sharded_triton(rank, world, kv_dtype):
    import torch.distributed as dist

    _, got = _reference_run("triton", kv_dtype, mode="sharded_direct", group=dist.group.WORLD)
    _, single = _reference_run("triton", kv_dtype)
    return [torch.equal(a, b) for a, b in zip(got, single)]


@pytest.mark.multirank
def test_reference_model_triton_on_cp_ranks_equals_single(ranks2):
    """The kernel computes each query on its own (no cross-row reduction): CP and single agree bit for bit."""
    for res in ranks2.run(_sharded_triton, "fp8"):
        assert all(res), res


# ----------------------------------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")


def _hf_run(name, attention, kv_dtype):
    from dtkv.integrations.transformers import TransformersAdapter, tiny_model

    torch.set_num_threads(1)
    lm = tiny_model(name)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 9)]
    pages = num_pages_for([len(p) for p in prompts], page_size=16, decode_steps=2)
    adapter = TransformersAdapter(lm, kv_dtype=kv_dtype, page_size=16)
    with Runtime(adapter, num_pages=pages, attention=attention) as rt:
        for p in prompts:
            rt.add_request(p)
        _, logits = rt.prefill(32, return_logits=True)
        outputs, steps = rt.decode(2, return_logits=True)
        return rt.attention.name, outputs, torch.cat(logits + steps)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("name", ["deepseek-v32", "glm5"])
def test_transformers_absorbed_triton_vs_expanded_torch(name, kv_dtype):
    """Both with the same indexer: with fp8 KV the Triton backend runs the fp8 indexer kernel by default, so the
    torch run takes its fp8 math too (``indexer_precision("fp8")``; bf16 KV: the exact indexer on both)."""
    from dtkv.integrations.transformers.attention import indexer_precision

    with indexer_precision("fp8"):
        got_name, got_out, got = _hf_run(name, "triton", kv_dtype)
        want_name, want_out, want = _hf_run(name, "auto", kv_dtype)
    assert (got_name, want_name) == ("triton", "torch")
    assert got_out == want_out
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-3
