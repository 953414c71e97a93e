"""The 0.1 entry points keep working for one release, each with its ``DeprecationWarning``: ``dtkv.model.ModelRunner``
and ``dtkv.integrations.transformers.DSAModelRunner`` (now :class:`dtkv.runtime.Runtime` over an adapter, with the
old arguments, attribute names and defaults), the old ``StepPlan`` field names, and the modules that moved into the
runtime and the demo package. Each gives exactly what the new entry point gives."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from dtkv.model import ModelConfig, ModelRunner, ReferenceAdapter
from dtkv.runtime import Runtime

DEPRECATED = r"is deprecated and will be removed in the next release; use "
CFG = ModelConfig(page_size=4, num_layers=2, kv_dtype="fp8")
PROMPTS = [[(5 * i + 1) % 97 for i in range(23)], [3, 1, 4, 1, 5, 9, 2, 6, 5]]


def _run(runner, chunk):
    for p in PROMPTS:
        runner.add_request(p)
    first = runner.prefill(chunk)
    return first, runner.decode(3), [runner.kv_bytes(r.rid) for r in runner.requests]


def test_model_runner_is_a_runtime_over_the_reference_adapter_with_the_old_names():
    with pytest.warns(DeprecationWarning, match=r"dtkv\.model\.ModelRunner " + DEPRECATED + r"dtkv\.runtime\.Runtime"):
        old = ModelRunner(CFG, mode="single", num_pages=32)
    new = Runtime(ReferenceAdapter(CFG), num_pages=32)
    assert isinstance(old, Runtime) and old.cfg is old.adapter.cfg and old.model is old.adapter.model
    assert old.spec == old.ownership_spec and old.mode == new.mode == "single"
    (f_old, o_old, kv_old), (f_new, o_new, kv_new) = _run(old, 8), _run(new, 8)
    assert f_old == f_new and o_old == o_new
    assert all(torch.equal(a[n], b[n]) for a, b in zip(kv_old, kv_new) for n in a)  # the same bytes
    with pytest.raises(ValueError, match="chunk must be >= 1, got chunk=0"):
        old.prefill(0)
    with pytest.warns(DeprecationWarning, match=r"dtkv\.model\.PrefillEngine"):
        import dtkv.model

        assert dtkv.model.PrefillEngine is ModelRunner


def test_the_old_step_plan_names_read_the_new_fields():
    rt = Runtime(ReferenceAdapter(CFG), num_pages=16)
    req = rt.add_request(PROMPTS[1])
    plan = rt.plan_step([req], [9])
    for old, new in (("ids_local", "ids"), ("pos_local", "positions"), ("locs_local", "locs"),
                     ("last_rows_gathered", "last_rows")):  # fmt: skip
        with pytest.warns(DeprecationWarning, match=rf"StepPlan\.{old} " + DEPRECATED):
            assert torch.equal(getattr(plan, old), getattr(plan, new))
    with pytest.warns(DeprecationWarning, match=r"StepPlan\.req_view_locs"):
        (view_locs,) = plan.req_view_locs
    assert torch.equal(view_locs, plan.key_slots[plan.key_indptr[0] : plan.key_indptr[1]])


def test_dsa_model_runner_is_a_runtime_over_the_transformers_adapter_with_the_old_names():
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    from dtkv.integrations.transformers import DSAModelRunner, TransformersAdapter, tiny_model

    lm = tiny_model("glm5")
    with pytest.warns(DeprecationWarning, match=r"DSAModelRunner " + DEPRECATED + r"dtkv\.runtime\.Runtime"):
        old = DSAModelRunner(lm, num_pages=24, page_size=4, kv_dtype="fp8")
    with old:
        assert old.model is lm and old.kv_dtype == "fp8" and old.cp_size == 1 and old.mode == "single"
        assert old.layouts is old.adapter.layouts and old.geometry.num_layers == 3 and old.family.returns_topk
        first_old, out_old = _run(old, 8)[:2]
        with pytest.warns(DeprecationWarning, match=r"DSAModelRunner\.free_request " + DEPRECATED):
            old.free_request(0)
        assert old.requests[0].finished and old.requests[0].pages == []
    with pytest.raises(ValueError, match="direct_writes=True needs split='zigzag'"):
        with pytest.warns(DeprecationWarning):
            DSAModelRunner(lm, num_pages=8, split="round_robin", direct_writes=True)
    with Runtime(TransformersAdapter(lm, kv_dtype="fp8", page_size=4), num_pages=24) as new:
        assert _run(new, 8)[:2] == (first_old, out_old)
    with pytest.warns(DeprecationWarning, match=r"AttentionContext " + DEPRECATED + r"dtkv\.runtime\.StepContext"):
        from dtkv.integrations.transformers import AttentionContext
    from dtkv.runtime import StepContext

    assert AttentionContext is StepContext


@pytest.mark.parametrize(
    ("module", "name", "new"),
    [
        ("dtkv.model.pd", "send_prefilled", "dtkv.runtime.pd.send_prefilled"),
        ("dtkv.model.pd", "receive_prefilled", "dtkv.runtime.pd.receive_prefilled"),
        ("dtkv.model.kvio", "token_rows", "dtkv.runtime.kvio.read_rows"),
        ("dtkv.model.kvio", "write_rows", "dtkv.runtime.kvio.write_rows"),
        ("dtkv.model.sharded_decode", "sharded_decode_step", "Runtime.decode_step"),
        ("dtkv.integrations.transformers.pd", "send_prefilled", "dtkv.runtime.pd.send_prefilled"),
        ("dtkv.integrations.transformers.pd", "request_bytes", "dtkv.runtime.pd.request_bytes"),
    ],
)
def test_moved_functions_warn_and_forward(module, name, new):
    if "transformers" in module:
        pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    import inspect

    fn = getattr(importlib.import_module(module), name)
    params = inspect.signature(fn).parameters.values()
    required = [p for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} " + DEPRECATED + new.replace(".", r"\.")):
        try:
            fn(*([None] * max(len(required), 6 if not required else 0)))
        except (AttributeError, TypeError, ValueError):  # the arguments are nonsense; the warning came first
            pass


def test_the_workloads_module_moved_to_the_demo_package():
    sys.modules.pop("dtkv.model.workloads", None)
    with pytest.warns(DeprecationWarning, match=r"dtkv\.model\.workloads " + DEPRECATED + r"dtkv\.demo\.workloads"):
        old = importlib.import_module("dtkv.model.workloads")
    import dtkv.demo.workloads as new

    assert old.run_workload is new.run_workload and old.chat_workload is new.chat_workload
