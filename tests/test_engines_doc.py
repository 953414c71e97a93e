"""``docs/engines.md`` says what the code does: the examples' line counts, the view's lifecycle (which the page and
``Materializer``'s docstring state), and the engine hooks the skeletons implement, as read from the engines' files
at the commits the page pins."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from dtkv import MLALatentLayout, PageOwnership, ShardedKVPool
from dtkv.materialize import Materializer, plan_materialize

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "engines.md").read_text()


@pytest.mark.parametrize("script", ["engine_paged_pool.py", "engine_backends.py"])
def test_the_page_gives_each_example_its_line_count(script):
    said = re.search(rf"`examples/{script}` \((\d+) lines\)", PAGE)
    assert said, f"docs/engines.md does not give the length of examples/{script}"
    assert int(said.group(1)) == len((ROOT / "examples" / script).read_text().splitlines())


def _pool(num_layers: int = 4) -> ShardedKVPool:
    lay = MLALatentLayout(page_size=2, kv_lora_rank=3, rope_dim=0, store_dtype=torch.float32)
    pool = ShardedKVPool({"kv": lay}, PageOwnership(1, 16), num_layers=num_layers)
    for layer in range(num_layers):  # every (layer, page, slot, dim) its own value
        t = pool.local("kv", layer)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + 1000 * layer)
    return pool


def test_a_view_holds_its_layer_until_prefetch_of_layer_plus_2_or_a_replan():
    pool = _pool()
    empty = plan_materialize([], [], pool.ownership, 0)
    mat = Materializer(pool, empty, max_view_pages=8)  # start-up: the empty batch, room for the largest one
    assert mat.capacity_pages == 8 and mat.plan.num_view_pages == 0
    mat.replan(plan_materialize([0, 1, 2], [5], pool.ownership, 0))
    v0 = mat.view(0)["kv"]
    held = v0.clone()
    assert torch.equal(held, pool.local("kv", 0)[torch.tensor([0, 1, 2, 5])])
    mat.prefetch(1)
    mat.view(1)
    assert torch.equal(v0, held)  # layer 1 uses the other buffer
    mat.prefetch(2)  # starts gathering layer 2 into layer 0's buffer
    assert not torch.equal(v0, held) and torch.equal(v0[:3], pool.local("kv", 2)[:3])
    mat.view(2)
    mat.prefetch(4)  # past the last layer: nothing
    with pytest.raises(RuntimeError, match="views are double-buffered by layer parity"):
        mat.prefetch(3) or mat.prefetch(1)
    mat.view(3)
    before = mat.view(0)["kv"].clone()
    old = mat.view(0)["kv"]
    mat.replan(plan_materialize([6, 7], [3], pool.ownership, 0))  # same buffers: nothing allocated
    assert mat.capacity_pages == 8
    new = mat.view(0)["kv"]
    assert new.data_ptr() == old.data_ptr() and not torch.equal(old[:3], before[:3])  # the old view now holds it


def test_replan_needs_no_gather_in_flight():
    pool = _pool()
    mat = Materializer(pool, plan_materialize([0], [1], pool.ownership, 0), max_view_pages=4)
    mat.prefetch(0)
    with pytest.raises(RuntimeError, match="replan\\(\\) needs no gather in flight"):
        mat.replan(plan_materialize([2], [3], pool.ownership, 0))


# Hooks as read: sglang base_attn_backend.py @ 43681aaa, vLLM vllm/v1/attention/backend.py @ e379cf37.
SGLANG_HOOKS = {
    "init_forward_metadata": ["forward_batch"],
    "init_cuda_graph_state": ["max_bs", "max_num_tokens"],
    "init_forward_metadata_capture_cuda_graph": ["bs", "num_tokens", "req_pool_indices", "seq_lens", "encoder_lens",
                                                 "forward_mode", "spec_info"],
    "init_forward_metadata_replay_cuda_graph": ["bs", "req_pool_indices", "seq_lens", "seq_lens_sum", "encoder_lens",
                                                "forward_mode", "spec_info", "seq_lens_cpu"],
    "get_cuda_graph_seq_len_fill_value": [],
    "forward_extend": ["q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
    "forward_decode": ["q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
}  # fmt: skip
VLLM_BUILDER_HOOKS = {
    "__init__": ["kv_cache_spec", "layer_names", "vllm_config", "device"],
    "build": ["common_prefix_len", "common_attn_metadata", "fast_build"],
    "build_for_cudagraph_capture": ["common_attn_metadata"],
}


def test_the_skeletons_implement_the_pinned_hooks_and_the_page_names_them():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import engine_backends as eb
    finally:
        sys.path.pop(0)
    for cls, hooks in ((eb.SglangBackend, SGLANG_HOOKS), (eb.VllmBuilder, VLLM_BUILDER_HOOKS)):
        for name, params in hooks.items():
            sig = inspect.signature(getattr(cls, name))
            got = [p.name for p in sig.parameters.values() if p.name != "self" and p.kind != p.KEYWORD_ONLY]
            assert got == params, (cls.__name__, name, got)
            assert name == "__init__" or f"`{name}" in PAGE, name
    for commit in ("43681aaa768047065d50fb746c884077a44ed505", "e379cf37ec69dd7a07c87fe74413abb9193e9500"):
        assert commit in PAGE and commit in (ROOT / "examples" / "engine_backends.py").read_text()
