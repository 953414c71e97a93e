"""The prefill path on a GPU never waits for the device in dtkv's code: planning a step (its index tensors reach the
device in one pinned, non-blocking copy) and dtkv's calls of the run phase (the KV writes, the views, the extend
indexer and its top-k, the attention backend's indices and kernel) run under ``torch.cuda.set_sync_debug_mode
("error")``, which raises at any host synchronization. The model's own modules (projections, norms, MoE) are not
checked: they are the model's.

Skipped without CUDA. Run on one H200 by ``benchmarks/scripts/gpu_h33e_check.sh``.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from dtkv.attention import availability
from dtkv.runtime import Runtime, StepContext, num_pages_for

pytestmark = pytest.mark.gpu
_NO_FLASHMLA = bool(torch.cuda.is_available() and availability("flashmla", "cuda"))
BACKENDS = ["triton", pytest.param("flashmla", marks=pytest.mark.skipif(_NO_FLASHMLA, reason="needs FlashMLA"))]


@contextlib.contextmanager
def _no_sync():
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _guarded(fn, calls: list[str], name: str):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        calls.append(name)
        with _no_sync():
            return fn(*args, **kwargs)

    return call


VOCAB = 256  # tiny_model's vocabulary


def _ids(start: int, stop: int) -> list[int]:
    """Token ids ``start..stop-1`` wrapped into the vocabulary (prompts longer than it)."""
    return [t % VOCAB for t in range(start, stop)]


def _runtime(attention: str, prompts: list[int]) -> Runtime:
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    from dtkv.integrations.transformers import TransformersAdapter, tiny_model

    lm = tiny_model("deepseek-v32", device="cuda", dtype=torch.bfloat16, num_attention_heads=64,
                    num_key_value_heads=64, kv_lora_rank=512, qk_rope_head_dim=64, index_n_heads=64,
                    index_head_dim=128, index_topk=128)  # fmt: skip
    assert lm.config.vocab_size == VOCAB, lm.config.vocab_size
    pages = num_pages_for(prompts, page_size=64)
    return Runtime(TransformersAdapter(lm, kv_dtype="fp8", page_size=64), num_pages=pages, attention=attention)


@pytest.mark.parametrize("attention", BACKENDS)
def test_planning_a_step_does_not_synchronize(monkeypatch, attention):
    """The plan's fields (one pinned buffer, one copy) equal those of a field-by-field ``.to(device)`` of the same
    step on a twin runtime."""
    import dataclasses

    import dtkv.runtime._plan as P

    plans = []
    for one_copy in (True, False):
        if not one_copy:
            monkeypatch.setattr(P, "_to_device", lambda fields, device: {k: t.to(device) for k, t in fields.items()})
        rt = _runtime(attention, [700, 300])
        a, b = rt.add_request(_ids(0, 700)), rt.add_request(_ids(0, 300))
        rt.step([a, b], [256, 256])
        with _no_sync() if one_copy else contextlib.nullcontext():
            plans.append(rt.plan_step([a, b], [256, 44]))
        rt.close()
    plan, want = plans
    assert plan.key_start.is_cuda and plan.key_end.device == plan.locs.device == torch.device("cuda", 0)
    for f in dataclasses.fields(plan):
        got, ref = getattr(plan, f.name), getattr(want, f.name)
        if isinstance(got, torch.Tensor):
            assert got.dtype == ref.dtype and torch.equal(got, ref), f.name
    start = torch.searchsorted(plan.key_req, plan.req_idx)
    assert torch.equal(plan.key_start, start) and torch.equal(plan.key_end, start + plan.positions + 1)


@pytest.mark.parametrize("attention", BACKENDS)
def test_dtkv_calls_of_prefill_steps_do_not_synchronize(monkeypatch, attention):
    """Three chunks of a 700-token prompt (rows past ``index_topk`` visible keys: the indexer, the top-k's
    histogram passes, the attention) with every dtkv call of the run phase guarded."""
    import dtkv.integrations.transformers.attention as A

    rt = _runtime(attention, [700])
    warm = rt.add_request(_ids(3, 300))
    rt.prefill(256)  # kernel compiles and caches first
    rt.finish_request(warm.rid)
    calls: list[str] = []
    for name in ("write", "views"):
        monkeypatch.setattr(StepContext, name, _guarded(getattr(StepContext, name), calls, name))
    monkeypatch.setattr(A, "select_topk", _guarded(A.select_topk, calls, "select_topk"))
    for name in ("indices", "prefill"):
        monkeypatch.setattr(rt.attention, name, _guarded(getattr(rt.attention, name), calls, name))
    req = rt.add_request(_ids(0, 700))
    rt.prefill(256)
    assert req.num_computed == 700 and len(req.output) == 1
    layers = rt.model_spec.num_layers
    assert calls.count("select_topk") == 3 * layers and calls.count("prefill") == 3 * layers
    rt.close()
