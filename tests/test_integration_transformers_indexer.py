"""The transformers adapter's extend-step indexer and absorbed weights (``dtkv.integrations.transformers.attention``).

- :func:`select_topk` on the ``torch`` backend gives, bit for bit, what the dense implementation it replaced gave
  (``[N, I, K]`` scores, a dense ``[N, K]`` visibility mask, a stable sort: :func:`_dense_topk` below), in any
  number of query blocks, and never allocates a tensor of ``N * K`` elements or more when the blocks are smaller
  than the chunk (the dense one allocated ``N * I * K``).
- The fp8 indexer: the Triton kernel (interpreter) selects what the ``torch`` backend's fp8 math selects;
  :func:`uses_fp8_indexer` / :func:`indexer_precision` say where it runs; a run with it matches the parity reference
  that mirrors it (``reference_logits(..., fp8_indexer=True)``) and not the one that does not; sharded decode takes
  the same indexer math as the extend steps (greedy tokens equal to full-view decode).
- ``kv_b_proj``'s halves are taken once per bind (:class:`AbsorbedWeights`), not on every call, as views where the
  dtype already matches.

Products compare under :func:`dtkv.runtime.batch_invariant` where bits are asserted (a BLAS GEMM's last bits depend
on its row count, which the blocks change). Logit tolerances are those of ``tests/test_integration_transformers.py``
(fp8 KV: 1e-4 at >= 97% of positions).
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")

from dtkv import IndexerFp8Layout, MLALatentLayout  # noqa: E402
from dtkv.integrations.transformers import (  # noqa: E402
    TransformersAdapter,
    geometry_of,
    kv_layouts,
    reference_logits,
    tiny_model,
)
from dtkv.integrations.transformers import _indexer as X  # noqa: E402
from dtkv.integrations.transformers import attention as A  # noqa: E402
from dtkv.kvio import read_rows  # noqa: E402
from dtkv.runtime import Runtime, batch_invariant  # noqa: E402
from tests._tensors import NewTensors  # noqa: E402
from tests.ops_reference import backend_ok  # noqa: E402

needs_interpreter = pytest.mark.skipif(not backend_ok("triton", "cpu"), reason="needs Triton in interpreter mode")


def _dense_topk(indexer, ctx, q_NIJ, w_NI, keys_KJ) -> torch.Tensor:
    """The extend indexer before bounded blocks (dtkv 0.2's ``_select_topk``), the reference of the torch path."""
    plan = ctx.plan
    scores = torch.matmul(q_NIJ.float(), keys_KJ.transpose(0, 1).float()) * indexer.softmax_scale  # [N, I, K]
    scores = torch.relu(scores)
    index_NK = torch.matmul(w_NI.unsqueeze(-2), scores).squeeze(-2)
    visible = (plan.key_req[None, :] == plan.req_idx[:, None]) & (plan.key_pos[None, :] <= plan.positions[:, None])
    index_NK = index_NK.masked_fill(~visible, float("-inf"))
    k = indexer.index_topk
    if index_NK.shape[-1] < k:
        pad = index_NK.new_full((index_NK.shape[0], k - index_NK.shape[-1]), float("-inf"))
        index_NK = torch.cat((index_NK, pad), dim=1)
    top_val, top_col = torch.sort(index_NK, dim=-1, descending=True, stable=True)
    top_val, top_col = top_val[:, :k], top_col[:, :k].clamp(max=plan.key_locs.shape[0] - 1)
    locs = torch.where(top_val > float("-inf"), plan.key_locs[top_col], torch.full_like(top_col, -1))
    if plan.mat_plan is None:
        return locs
    from dtkv import ops

    return ops.remap(locs, plan.mat_plan.page_map, page_size=ctx.page_size)


def _layer_inputs(name, kv_dtype, *, attention="torch", index_topk=16, first=(40, 13), second=(31, 20), seed=0):
    """A runtime after a first step of two requests (the second's prompt repeats tokens: equal keys, exact ties),
    and the second step's plan, context and layer-0 indexer inputs (the layer's index rows written)."""
    torch.set_num_threads(1)
    lm = tiny_model(name, seed=seed, index_topk=index_topk)
    rt = Runtime(TransformersAdapter(lm, kv_dtype=kv_dtype, page_size=8), num_pages=64, attention=attention)
    rt.add_request(list(range(100, 171)))
    rt.add_request([7, 7, 7, 7, 9] * 7)
    rt.step(rt.requests, list(first))
    plan = rt.plan_step(rt.requests, list(second))
    ctx = rt.context(plan)
    attn = lm.model.layers[0].self_attn
    with torch.no_grad():
        hidden = lm.model.layers[0].input_layernorm(lm.model.embed_tokens(plan.ids[None]))
        cos, sin = lm.model.rotary_emb(hidden, plan.positions[None])
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
        iq, ik, iw = A._indexer_rows(attn.indexer, hidden, q_resid, cos, sin, A._ropes(attn)[1])
        ctx.write("index", 0, ik)
        view = ctx.views(0, ("index",))["index"]
    return rt, ctx, attn.indexer, iq, iw, view


@pytest.mark.parametrize("blocks", ["one", "many"])
@pytest.mark.parametrize(("name", "kv_dtype"), [("deepseek-v32", "bf16"), ("glm5", "fp8"), ("deepseek-v32", "fp32")])
def test_torch_select_is_bitwise_the_dense_stable_sort(monkeypatch, name, kv_dtype, blocks):
    """Two requests (one with history, one of repeated tokens: ties), ``index_topk`` above some queries' visible
    keys; one block or blocks of 3 queries: the view slots of the dense implementation, bit for bit."""
    rt, ctx, indexer, iq, iw, view = _layer_inputs(name, kv_dtype)
    if blocks == "many":
        heads, keys = iq.shape[1], ctx.plan.key_slots.shape[0]
        monkeypatch.setattr(X, "TORCH_BLOCK_BYTES", 3 * (4 * heads + 48) * keys)
    keys_KJ = read_rows(view, ctx.layouts["index"], iq.dtype)[ctx.plan.key_slots]
    with torch.no_grad(), batch_invariant():
        want = _dense_topk(indexer, ctx, iq, iw, keys_KJ)
        got = A.select_topk(indexer, ctx, iq, iw, view)
    rt.close()
    assert got.shape == want.shape == (iq.shape[0], indexer.index_topk)
    assert bool((want == -1).any()) and bool((want >= 0).any())  # padded and real entries both occur
    assert torch.equal(got, want)


def test_torch_select_never_allocates_n_by_k(monkeypatch):
    """With blocks of 3 queries no tensor the indexer computes reaches ``N * K`` elements (the dense path built
    ``N * I * K`` scores and an ``N * K`` mask); the keys ``[J, K]`` stay below it too."""
    rt, ctx, indexer, iq, iw, view = _layer_inputs("deepseek-v32", "bf16", first=(40, 13), second=(25, 15))
    n, heads, dims = iq.shape
    keys = ctx.plan.key_slots.shape[0]
    assert n * keys > dims * keys, "the check needs N > J"
    monkeypatch.setattr(X, "TORCH_BLOCK_BYTES", 3 * (4 * heads + 48) * keys)
    shapes, dense = NewTensors(), NewTensors()
    keys_KJ = read_rows(view, ctx.layouts["index"], iq.dtype)[ctx.plan.key_slots]
    with torch.no_grad():
        with shapes:
            A.select_topk(indexer, ctx, iq, iw, view)
        with dense:
            _dense_topk(indexer, ctx, iq, iw, keys_KJ)
    rt.close()
    assert max(shapes.numels) < n * keys, (max(shapes.numels), n, keys)
    assert max(shapes.numels) >= 3 * heads * keys  # a block's products were seen: the mode recorded the path
    assert max(dense.numels) >= n * heads * keys  # what the check catches: the dense path's [N, I, K] scores


def test_uses_fp8_indexer_rules_and_switch():
    fp8, bf16 = IndexerFp8Layout(page_size=8, head_dim=32), MLALatentLayout(page_size=8, kv_lora_rank=32, rope_dim=0)
    assert A.uses_fp8_indexer("triton", fp8) and A.uses_fp8_indexer("flashmla", fp8)
    assert not A.uses_fp8_indexer("torch", fp8) and not A.uses_fp8_indexer("triton", bf16)
    with A.indexer_precision("fp8"):
        assert A.uses_fp8_indexer("torch", fp8) and not A.uses_fp8_indexer("torch", bf16)
        with A.indexer_precision("exact"):
            assert not A.uses_fp8_indexer("triton", fp8)
        assert A.uses_fp8_indexer("torch", fp8)
    assert not A.uses_fp8_indexer("torch", fp8)
    with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'fp8', 'exact'\), got mode='bf16'"):
        with A.indexer_precision("bf16"):
            pass


def test_fp8_queries_round_as_the_reference_rounds_them():
    """The adapter's fp8 query rounding is bitwise the reference's (``round_trip`` through an indexer layout)."""
    from dtkv.kvio import round_trip

    q = torch.randn(5, 4, 32).bfloat16()
    got = A.fp8_indexer_queries(q)
    assert got.dtype == torch.float32
    assert torch.equal(got, round_trip(q.float(), IndexerFp8Layout(page_size=1, head_dim=32)))


class _Recorded:
    """A Triton kernel whose launches are recorded (``kernel[grid](...)``)."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@needs_interpreter
@pytest.mark.parametrize("path", ["exact", "grouped", "fused"])
@pytest.mark.parametrize("name", ["deepseek-v32", "glm5"])
def test_fp8_kernel_selects_what_the_torch_fp8_math_selects(name, path, monkeypatch):
    """fp8 KV: the Triton backend's kernel (interpreter; several query blocks) against the torch backend's fp8
    formula (:func:`indexer_precision` ``"fp8"``): the same view slots. Their logits differ by float32 rounding
    (the kernel applies the key scale after the head sum), far below these random keys' gaps. On the ``grouped``
    path (the selection's grouped bound, settings that take it at these few rows) the selection computes the group
    maxima itself (the default); on the ``fused`` path (:data:`FUSED_GROUP_MAXIMA`) the indexer's epilogue writes
    them and the selection's own launch for them never runs."""
    topk_mod = sys.modules["dtkv.ops.logits_topk"]
    maxima = []
    if path != "exact":
        grouped = {"ratio": 1, "min_rows": 1, "scan_block": 32, "group_block": 16}
        monkeypatch.setattr(topk_mod, "GROUP_CONFIG", {**topk_mod.GROUP_CONFIG, **grouped})
        real_kernel = topk_mod._group_max_kernel
        monkeypatch.setattr(topk_mod, "_group_max_kernel", _Recorded(real_kernel, maxima))
    if path == "fused":
        monkeypatch.setattr(X, "FUSED_GROUP_MAXIMA", True)
        monkeypatch.setattr(topk_mod, "_group_max_kernel", None)  # not launched: the indexer wrote the maxima
    rt, ctx, indexer, iq, iw, view = _layer_inputs(name, "fp8", attention="triton")
    assert A.uses_fp8_indexer(ctx.attention.name, ctx.layouts["index"])
    monkeypatch.setattr(X, "FP8_BLOCK_BYTES", 4 * 5 * ctx.plan.key_slots.shape[0])  # blocks of 5 queries (float32)
    calls = []
    real = X.ops.indexer_logits
    monkeypatch.setattr(
        X.ops, "indexer_logits", lambda *a, **k: calls.append((k["backend"], k["group"])) or real(*a, **k)
    )
    with torch.no_grad():
        got = A.select_topk(indexer, ctx, iq, iw, view)
        rt.attention = ctx.attention = type("TorchName", (), {"name": "torch"})()
        with A.indexer_precision("fp8"):
            want = A.select_topk(indexer, ctx, iq, iw, view)
    rt.close()
    assert [b for b, _ in calls] == ["triton"] * -(-iq.shape[0] // 5)  # the kernel ran, one call a block; not on torch
    assert all((grp > 0) == (path == "fused") for _, grp in calls), calls
    assert bool(maxima) == (path == "grouped"), maxima
    assert torch.equal(got, want)


def _serve(name, kv_dtype, *, decode_mode="full", steps=2):
    torch.set_num_threads(1)
    lm = tiny_model(name)
    rt = Runtime(TransformersAdapter(lm, kv_dtype=kv_dtype, page_size=16), num_pages=64, decode_mode=decode_mode)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 23)]
    for p in prompts:
        rt.add_request(p)
    _, logits = rt.prefill(32, return_logits=True)
    outputs, decode_logits = rt.decode(steps, return_logits=True)
    rt.close()
    return lm, prompts, outputs, logits, decode_logits


def _diffs(lm, kv_dtype, prompts, outputs, logits, decode_logits, *, fp8_indexer):
    layouts = kv_layouts(geometry_of(lm), kv_dtype, 1)
    diffs, equal = [], True
    for i, p in enumerate(prompts):
        ref = reference_logits(lm, p + outputs[i][:-1], layouts=layouts, fp8_indexer=fp8_indexer)
        got = torch.cat([logits[i]] + [step[i : i + 1] for step in decode_logits])
        diffs.append((ref - got).abs().amax(-1))
        equal &= ref[len(p) - 1 :].argmax(-1).tolist() == outputs[i]
    return torch.cat(diffs), equal


def test_fp8_indexer_run_matches_the_reference_that_mirrors_it():
    """fp8 KV with the fp8 indexer (the torch backend's fp8 math): within the fp8 tolerance of the reference with
    ``fp8_indexer=True`` (tokens equal, >= 97% of positions within 1e-4), and visibly off the exact reference
    (the flag is what makes the comparison meaningful)."""
    with A.indexer_precision("fp8"):
        lm, prompts, outputs, logits, steps = _serve("deepseek-v32", "fp8")
    mirrored, equal = _diffs(lm, "fp8", prompts, outputs, logits, steps, fp8_indexer=True)
    assert equal and float((mirrored <= 1e-4).float().mean()) >= 0.97 and float(mirrored.max()) <= 1.0
    exact, _ = _diffs(lm, "fp8", prompts, outputs, logits, steps, fp8_indexer=False)
    assert float(exact.mean()) > 100 * float(mirrored.mean()), (float(exact.mean()), float(mirrored.mean()))


@pytest.mark.parametrize("precision", ["auto", "fp8"])
def test_sharded_decode_takes_the_extend_indexer_math(precision):
    """Sharded decode (one process: the pages are all local) scores with the same indexer as the extend steps:
    greedy tokens equal to full-view decode's, logits within the sharded-decode bound (1e-4), with the exact
    indexer (``auto`` on torch) and with the fp8 one."""
    with A.indexer_precision(precision):
        _, _, full_out, _, full_steps = _serve("glm5", "fp8", steps=3)
        _, _, shard_out, _, shard_steps = _serve("glm5", "fp8", decode_mode="sharded", steps=3)
    assert shard_out == full_out
    assert max(float((a - b).abs().max()) for a, b in zip(shard_steps, full_steps)) <= 1e-4


def test_absorbed_weights_are_taken_once_per_bind():
    """A Triton-backend run (absorbed form, interpreter) of two prefill chunks and two decode steps reads each
    layer's ``kv_b_proj`` weight once (float32, the Triton backend's query dtype; before: once a layer a forward);
    a second runtime binds anew."""
    if not backend_ok("triton", "cpu"):
        pytest.skip("needs Triton in interpreter mode")
    torch.set_num_threads(1)
    lm = tiny_model("deepseek-v32")
    weights = {id(layer.self_attn.kv_b_proj.weight) for layer in lm.model.layers}

    class Conversions(TorchFunctionMode):
        """Counts the torch calls that take a ``kv_b_proj`` weight (the absorbed form's only reads of it)."""

        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Conversions.count += any(id(a) in weights for a in args)
            return func(*args, **(kwargs or {}))

    for _ in range(2):
        rt = Runtime(TransformersAdapter(lm, kv_dtype="bf16", page_size=16), num_pages=32, attention="triton")
        rt.add_request(list(range(18)))
        with torch.no_grad(), Conversions():
            rt.prefill(9)
            rt.decode(2)
        rt.close()
    assert Conversions.count == 2 * len(lm.model.layers), Conversions.count


def test_absorbed_weights_are_views_in_the_weights_dtype():
    lm = tiny_model("deepseek-v32")
    attn = lm.model.layers[1].self_attn
    w = attn.kv_b_proj.weight
    absorbed = A.AbsorbedWeights(attn)
    w_uk, w_uv_t = absorbed.get(torch.float32)
    assert absorbed.get(torch.float32)[0] is w_uk  # kept, not taken again
    lo, hi = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
    assert lo <= w_uk.data_ptr() < hi and lo <= w_uv_t.data_ptr() < hi  # views of the weight: no copy
    h, nope, v, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    full = w.view(h, nope + v, r)
    assert torch.equal(w_uk, full[:, :nope]) and torch.equal(w_uv_t, full[:, nope:].transpose(1, 2))
    b_uk, _ = absorbed.get(torch.bfloat16)
    assert b_uk.dtype == torch.bfloat16 and torch.equal(b_uk, full[:, :nope].bfloat16())


def test_absorbed_products_run_in_the_backends_query_dtype_or_the_weights_if_wider():
    """FlashMLA takes bf16 queries: a bf16 model's absorbed products are bf16 GEMMs, a float32 model's stay
    float32 (bf16 factors of a float32 weight moved the fake-FlashMLA run's greedy tokens); Triton: float32."""

    class Backend:
        def __init__(self, dtype):
            self.dtype = dtype

        def cast_queries(self, q):
            return q.to(self.dtype)

    lm = tiny_model("deepseek-v32")
    attn = lm.model.layers[0].self_attn
    assert A._backend_dtype(Backend(torch.bfloat16), attn) == torch.float32
    assert A._backend_dtype(Backend(torch.float32), attn) == torch.float32
    lm16 = tiny_model("deepseek-v32", dtype=torch.bfloat16)
    assert A._backend_dtype(Backend(torch.bfloat16), lm16.model.layers[0].self_attn) == torch.bfloat16
    assert A._backend_dtype(Backend(torch.float32), lm16.model.layers[0].self_attn) == torch.float32


class _Ops(TorchDispatchMode):
    """Records ``(function of dsa_attention's modules, aten op, output shapes and dtypes)`` of every op a function
    of ``attention.py`` / ``_indexer.py`` runs itself inside the block (a registered dtkv op counts once, not its
    internals, its wrapper is transparent; what the attention backend or the kernel it calls runs is not
    recorded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, list[tuple[tuple[int, ...], torch.dtype]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = next((f for f in reversed(traceback.extract_stack()) if ("/dtkv/" in f.filename
                      and "/dtkv/ops/" not in f.filename) or f.filename.endswith("fake_flash_mla.py")), None)  # fmt: skip
        if frame is not None and frame.filename.endswith(("transformers/attention.py", "transformers/_indexer.py")):
            where = frame.name
            outs = out if isinstance(out, (tuple, list)) else (out,)
            shapes = [(tuple(t.shape), t.dtype) for t in outs if isinstance(t, torch.Tensor)]
            self.ops.append((where, func.overloadpacket.__name__, shapes))
        return out


def test_fast_path_selects_from_float_logits_and_copies_no_queries(monkeypatch):
    """A step on the FlashMLA path (a CPU stand-in of ``flash_mla``, ``tests/fake_flash_mla.py``; the ops on their
    torch backend) with fp8 KV, a bf16 model at FlashMLA's dims: the top-k runs one ``dtkv::logits_topk`` of the
    indexer's float32 logits a block (no int64 keys over the key table), and the absorbed attention concatenates
    and copies nothing (the latent query, the rotated rope query and the value heads are written in place)."""
    import dtkv.attention._flashmla as fm
    import dtkv.attention._resolve as res
    import tests.fake_flash_mla as fake

    monkeypatch.setattr(fm, "availability", lambda name, device: "")
    monkeypatch.setattr(res, "availability", lambda name, device: "")
    monkeypatch.setattr(fm, "flashmla_module", lambda: (fake, ""))
    lm = tiny_model("deepseek-v32", seed=1, dtype=torch.bfloat16, num_attention_heads=64, num_key_value_heads=64,
                    kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_topk=64)  # fmt: skip
    rt = Runtime(TransformersAdapter(lm, kv_dtype="fp8", page_size=64), num_pages=8, attention="flashmla")
    rt.add_request(list(range(100, 210)))
    rt.step(rt.requests, [70])
    plan = rt.plan_step(rt.requests, [40])
    n = plan.ids.shape[0]
    mode = _Ops()
    with torch.no_grad(), mode:
        rt.forward(plan)
    rt.close()
    by = lambda fn: [(op, shapes) for where, op, shapes in mode.ops if where == fn]  # noqa: E731
    topk_ops, attn_ops = by("select_topk"), by("_absorbed_attention")
    layers = lm.config.num_hidden_layers
    # float32 logits and dtkv::logits_topk, one of each a block (a block here: the whole step)
    names = [op for op, _ in topk_ops]
    assert names.count("indexer_logits") == names.count("logits_topk") == layers and "topk" not in names, names
    assert not {"cat", "clone", "contiguous"} & {op for op, _ in attn_ops}
    heads, rope = lm.config.num_attention_heads, lm.config.qk_rope_head_dim
    copies = [(op, shapes[0]) for op, shapes in attn_ops if op in ("copy_", "_to_copy")]
    assert copies == [], copies  # the rope part is written rotated into the query buffer, once a layer:
    assert [op for op, _ in attn_ops].count("rope_interleave_into") == layers, attn_ops
    query = ("empty", [((n, heads, lm.config.kv_lora_rank + rope), torch.bfloat16)])
    assert attn_ops.count(query) == layers, attn_ops
