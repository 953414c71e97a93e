"""Decode steps as CUDA graphs (``Runtime(cuda_graphs=...)``, :mod:`dtkv.runtime._graphs`): the switch, the buckets,
and the graph path against the eager one, in one process and on 2, 3 and 4 gloo ranks.

On CPUs the graph path runs emulated (``cuda_graphs="emulate"``: batch buckets and padding rows, page buckets, the
static buffers, the host plans copied into them, lazy builds, new buckets as requests grow, geometry checks; each
step eager over the static buffers instead of a replay), and it must give the eager path's greedy tokens, logits and
stored KV bytes *bitwise*, in both decode modes and for both adapters, through batches of 5 (a prime: bucket 8), 4
and 8 (bucket edges), 2 and 1 as requests finish mid-batch, and requests that join later. The reference model's
float64 math, rounded to its float32 hidden state, gives the same bits for a padded bucket; the transformers model
runs under ``batch_invariant`` (its float32 GEMMs over a padded bucket otherwise differ from the eager batch's in
the last bits: a row's products must not depend on the rows beside it). The CUDA cases capture and replay and must
equal the emulated path bitwise (same kernels, same shapes); they skip without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from dtkv import _env
from dtkv.runtime import Runtime, num_pages_for
from dtkv.runtime._graphs import batch_bucket, page_bucket, resolve_cuda_graphs
from tests._runtime import adapter as make_adapter
from tests._runtime import refused

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _hf():
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")


LENS = (37, 9, 3, 14, 5)  # 5 requests: a prime, bucket 8; one longer than top-k, one page, a partial page


def _prompts(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _runtime(model, graphs, *, decode_mode, group=None, mode=None, kv_dtype="fp8", device="cpu", num_pages=None,
             batch_invariant=None, attention="auto") -> Runtime:  # fmt: skip
    ad = make_adapter(model, kv_dtype=kv_dtype, page_size=4) if device == "cpu" else _on(model, device, kv_dtype)
    bi = model != "reference" if batch_invariant is None else batch_invariant
    pages = num_pages or num_pages_for([*LENS, 11, 6], page_size=4, decode_steps=30, cp_size=4) + 8
    return Runtime(ad, num_pages=pages, group=group, mode=mode, decode_mode=decode_mode, cuda_graphs=graphs,
                   batch_invariant=bi, attention=attention)  # fmt: skip


def _on(model, device, kv_dtype):
    """A fresh adapter of ``model`` on ``device`` (never the tests' cached CPU model)."""
    if model == "reference":
        from dtkv.model import ModelConfig, ReferenceAdapter

        return ReferenceAdapter(ModelConfig(kv_dtype=kv_dtype, page_size=4, num_layers=2), device)
    from dtkv.integrations.transformers import TransformersAdapter, tiny_model

    # bf16: on CUDA, float32 experts' grouped_mm copies its offsets to the host, which a capture refuses
    # (test_experts_that_copy_to_the_host_are_named_before_a_capture)
    lm = tiny_model(model, device=device, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    return TransformersAdapter(lm, kv_dtype=kv_dtype, page_size=4)


def _scenario(rt: Runtime) -> dict:
    """Decode through batches of 5, 4, 2, 1 (requests finishing mid-batch), then 2 again (one joins): tokens, every
    step's logits, each request's stored KV when it finishes (or at the end). Closes ``rt``."""
    try:
        return _scenario_steps(rt)
    finally:
        rt.close()


def _scenario_steps(rt: Runtime) -> dict:
    vocab = rt.model_spec.vocab_size
    for p in _prompts(LENS, vocab):
        rt.add_request(p)
    rt.prefill(8)
    logits, kv = [], {}

    def decode(steps):
        logits.extend(rt.decode(steps, return_logits=True)[1])

    def finish(rid):
        kv[rid] = rt.kv_bytes(rid)
        rt.finish_request(rid)

    decode(5)  # 5 requests (bucket 8)
    finish(1)
    decode(5)  # 4 (a bucket edge)
    finish(0)
    finish(3)
    decode(4)  # 2
    finish(4)
    decode(4)  # 1; the long request grows past its page buckets
    rt.add_request(_prompts((11,), vocab, seed=1)[0])
    rt.prefill(8)
    decode(4)  # 2 again, one new
    for r in rt.requests:
        if not r.finished:
            kv[r.rid] = rt.kv_bytes(r.rid)
    return {"outputs": [list(r.output) for r in rt.requests], "logits": logits, "kv": kv,
            "graphs": None if rt.graphs is None else dict(rt.graphs.stats), "reason": rt.graphs and rt.graphs.reason}  # fmt: skip


def _same(a: dict, b: dict, *, logits_rtol: float = 0.0) -> None:
    """Tokens and KV bytes equal; logits bitwise, or within ``logits_rtol`` of their largest magnitude (a captured
    step on a GPU: cuBLAS may pick another GEMM algorithm under stream capture; 5e-7 seen on an H200)."""
    assert a["outputs"] == b["outputs"]
    assert len(a["logits"]) == len(b["logits"])
    for i, (x, y) in enumerate(zip(a["logits"], b["logits"])):
        diff = float((x.float() - y.float()).abs().max())
        ok = torch.equal(x, y) if logits_rtol == 0 else diff <= logits_rtol * float(x.float().abs().max())
        assert ok, f"step {i}: logits differ by {diff}"
    assert sorted(a["kv"]) == sorted(b["kv"])
    for rid in a["kv"]:
        for name in a["kv"][rid]:
            assert torch.equal(a["kv"][rid][name], b["kv"][rid][name]), f"request {rid}, pool {name!r}"


# ------------------------------------------------------------------------------------------- the switch
def test_the_switch_resolves_per_device_and_refuses_what_cannot_capture():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_cuda_graphs(None, cpu, batch_invariant=False) == "off"
    assert resolve_cuda_graphs(None, gpu, batch_invariant=False) == "capture"
    assert resolve_cuda_graphs(None, gpu, batch_invariant=True) == "off"  # its products loop on the host
    assert resolve_cuda_graphs("emulate", cpu, batch_invariant=True) == "emulate"
    assert resolve_cuda_graphs(False, gpu, batch_invariant=False) == "off"
    assert resolve_cuda_graphs(True, gpu, batch_invariant=False) == "capture"
    kind, msg = refused(resolve_cuda_graphs, True, cpu, batch_invariant=False)
    assert kind == "ValueError" and "cuda_graphs=True captures CUDA graphs, but the model is on cpu" in msg
    assert "cuda_graphs='emulate'" in msg
    kind, msg = refused(resolve_cuda_graphs, True, gpu, batch_invariant=True)
    assert kind == "ValueError" and "batch_invariant=True" in msg
    for bad in ("yes", 1, "capture"):
        kind, msg = refused(resolve_cuda_graphs, bad, cpu, batch_invariant=False)
        assert kind == "TypeError" and f"cuda_graphs={bad!r}" in msg
    # through the runtime: the same rule, and the resolved mode
    kind, msg = refused(_runtime, "reference", True, decode_mode="sharded")
    assert kind == "ValueError" and "the model is on cpu" in msg
    rt = _runtime("reference", None, decode_mode="sharded")
    assert rt.graph_mode == "off" and rt.graphs is None
    rt.close()
    rt = _runtime("reference", "emulate", decode_mode="full")
    assert rt.graph_mode == "emulate" and rt.graphs is not None
    rt.close()


def test_buckets_round_up_within_their_rules():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 24, 25)] == [1, 2, 4, 4, 8, 8, 8, 16, 16, 24,
                                                                                    24, 32]  # fmt: skip
    prev = 0
    for m in range(1, 5000):
        b = page_bucket(m)
        assert m <= b <= m + m / 16 + 1, (m, b)  # at most 1/16 more
        assert b >= prev  # monotone: a growing request moves to larger buckets only
        prev = b
    assert page_bucket(513) == 544 and page_bucket(2049) == 2176 and page_bucket(7) == 7


def test_a_capture_after_the_last_graph_is_gone_takes_a_new_pool(monkeypatch):
    """Buckets share one pool handle while a graph holds it; once none does, the next capture takes a new handle (a
    capture into a pool whose last graph was destroyed, while a tensor of it lives, fails torch's allocator assert
    ``use_count > 0``: ``test_captured_decode_recaptures_after_its_only_graph_was_dropped`` on a GPU)."""
    from types import SimpleNamespace

    from dtkv.runtime._graphs import DecodeGraphs

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("pool", next(handles)))
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets, graphs.pool_handle = {}, None
    first = graphs.capture_pool()
    graphs.buckets["a"] = SimpleNamespace(_graph=object())  # a captured bucket holds the pool
    graphs.buckets["b"] = SimpleNamespace(_graph=None)  # the one being captured
    assert graphs.capture_pool() == first
    del graphs.buckets["a"]  # its batch moved to a larger bucket
    assert graphs.capture_pool() != first


# ------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
@pytest.mark.parametrize("model", ["reference", "deepseek-v32"])
def test_graph_path_equals_the_eager_path(model, decode_mode):
    if model != "reference":
        _hf()
    eager = _scenario(_runtime(model, False, decode_mode=decode_mode))
    graphs = _scenario(_runtime(model, "emulate", decode_mode=decode_mode))
    _same(graphs, eager)
    st = graphs["graphs"]
    assert st["eager_steps"] == 0 and graphs["reason"] == ""
    # batches 5, 4, 2, 1, 2 over growing pages: several buckets, most steps in a bucket built before
    assert st["captures"] >= 5 and st["replays"] >= 10


@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
def test_graph_steps_run_a_step_ahead_of_the_host(decode_mode, monkeypatch):
    """``decode(steps)`` on the graph path reads no step's tokens before it launches the next: each bucket after a
    call's first step takes its ids from the previous step's argmax on the device, while the requests' outputs hold
    placeholders, and the values replace them once the next replay is launched (then the prefix cache hashes the
    computed pages). The tokens, logits and stored KV are the eager runtime's, bitwise; with a progress callback
    every step's tokens are read before it returns."""
    from dtkv.runtime._graphs import DecodeGraphs, PendingTokens

    seen = []
    run = DecodeGraphs.run

    def spy(self, reqs, ids=None):
        seen.append((ids is not None, [r.output[-1] for r in reqs]))
        return run(self, reqs, ids)

    def decode_all(graphs, **kw):
        rt = Runtime(make_adapter("reference", kv_dtype="fp8", page_size=4), num_pages=80, decode_mode=decode_mode,
                     cuda_graphs=graphs, prefix_cache=True)  # fmt: skip
        for p in _prompts(LENS, rt.model_spec.vocab_size):
            rt.add_request(p)
        rt.prefill(8)
        _, logits = rt.decode(6, return_logits=True, **kw)
        out = [list(r.output) for r in rt.requests]
        cached = [len(rt.prefix_cache.lookup(r.tokens)) for r in rt.requests]  # pages cached under the real tokens
        rt.close()
        return out, logits, cached

    eager = decode_all(False)
    monkeypatch.setattr(DecodeGraphs, "run", spy)
    ahead = decode_all("emulate")
    assert ahead[0] == eager[0] and all(torch.equal(a, b) for a, b in zip(ahead[1], eager[1]))
    assert ahead[2] == eager[2]
    assert PendingTokens.PLACEHOLDER not in sum(ahead[0], [])
    # the first step of the call reads the prefill's tokens; the next 5 take theirs from the device
    assert [device for device, _ in seen] == [False] + [True] * 5
    assert all(set(last) == {PendingTokens.PLACEHOLDER} for _, last in seen[1:])
    seen.clear()
    steps = []
    shown = decode_all("emulate", progress=lambda k, n: steps.append(k))
    assert shown[0] == eager[0] and steps == [1, 2, 3, 4, 5, 6]
    assert [device for device, _ in seen] == [False] * 6


def test_pending_tokens_resolve_before_an_eager_step_reads_them(monkeypatch):
    """A step that falls back to eager inside a call (here: the graphs refuse its batch) resolves the previous
    step's tokens first, so the eager model reads the real ids."""
    from dtkv.runtime._graphs import DecodeGraphs

    results = []
    for graphs in (False, "emulate"):
        rt = _runtime("reference", graphs, decode_mode="sharded")
        if graphs:

            def refuse_third(self, reqs, calls=[0], reason=DecodeGraphs.reason_for):  # noqa: B006 - the count
                calls[0] += 1
                return "refused for the test" if calls[0] == 3 else reason(self, reqs)

            monkeypatch.setattr(DecodeGraphs, "reason_for", refuse_third)
        for p in _prompts(LENS, rt.model_spec.vocab_size):
            rt.add_request(p)
        rt.prefill(8)
        results.append(rt.decode(5))
        if graphs:
            assert rt.graphs.stats["eager_steps"] == 1
        rt.close()
    assert results[0] == results[1]


def test_pending_tokens_map_the_next_batch_to_their_rows():
    from dtkv.runtime._graphs import PendingTokens
    from dtkv.runtime._request import Request

    reqs = [Request(rid=i, prompt=[1, 2], output=[3]) for i in range(4)]
    p = PendingTokens(reqs, torch.tensor([10, 11, 12, 13]))
    assert p.ids_for(reqs) is p.tokens
    assert p.ids_for([reqs[2], reqs[0]]).tolist() == [12, 10]
    assert p.ids_for([reqs[1], Request(rid=9, prompt=[1])]) is None
    p.hold()
    assert [r.output for r in reqs] == [[3, -1]] * 4
    p.resolve()
    p.resolve()  # idempotent
    assert [r.output for r in reqs] == [[3, 10], [3, 11], [3, 12], [3, 13]]


def test_full_view_buckets_score_the_batch_in_one_indexer_launch(monkeypatch):
    """A full-view bucket on the fp8 indexer kernel (``attention="triton"``, the interpreter) scores every request
    over its own pages in one ``dtkv::indexer_scores`` launch a layer (sharded decode's kernel; page table
    ``[B, M]`` from the bucket's key blocks), selects with ``dtkv::keys_topk``'s kernel, and selects what the eager
    step's flat table (``dtkv::indexer_logits``) selects: tokens, logits and stored KV of the eager path, bitwise."""
    _hf()
    from dtkv import ops
    from tests.ops_reference import skip_unless

    skip_unless("triton", "cpu")
    calls, scores = [], []
    real, real_scores = ops.indexer_logits, ops.indexer_scores

    def counted(q, w, pages, key_slots, *args, **kw):
        calls.append((q.shape[0], tuple(key_slots.shape)))
        return real(q, w, pages, key_slots, *args, **kw)

    def counted_scores(q, w, pool, page_ids, page_slots, query_pos, **kw):
        scores.append((q.shape[0], tuple(page_ids.shape), kw["q_fp8"]))
        return real_scores(q, w, pool, page_ids, page_slots, query_pos, **kw)

    monkeypatch.setattr(ops, "indexer_logits", counted)
    monkeypatch.setattr(ops, "indexer_scores", counted_scores)
    import dtkv.integrations.transformers._indexer as I

    tables, real_table = [], I._page_table
    monkeypatch.setattr(I, "_page_table", lambda *a: tables.append(1) or real_table(*a))
    topk_calls = []
    real_topk = ops.keys_topk
    monkeypatch.setattr(
        ops, "keys_topk", lambda keys, k, **kw: topk_calls.append(kw["backend"]) or real_topk(keys, k, **kw)
    )
    out = {}
    for graphs in (False, "emulate"):
        rt = _runtime("deepseek-v32", graphs, decode_mode="full", attention="triton", num_pages=48)
        # 23 and 17 tokens: past index_topk (16), so the scores choose the keys; 5: fewer keys than it
        for p in _prompts((23, 17, 5), rt.model_spec.vocab_size):
            rt.add_request(p)
        rt.prefill(24)
        calls.clear()
        scores.clear()
        topk_calls.clear()
        tables.clear()
        outputs, logits = rt.decode(1, return_logits=True)
        out[graphs] = (outputs, logits, rt.kv_bytes(0), list(calls), rt.graphs and dict(rt.graphs.stats))
        out[graphs, "scores"] = list(scores)
        out[graphs, "tables"] = len(tables)
        layers = rt.model_spec.num_layers
        out[graphs, "topk"] = list(topk_calls)
        rt.close()
    # the bucket's selection: dtkv::keys_topk's kernel (many programs a row), one call a layer; eager: none
    assert out["emulate", "topk"] == ["triton"] * len(out["emulate", "scores"]) and out[False, "topk"] == []
    assert out["emulate"][0] == out[False][0]
    assert all(torch.equal(a, b) for a, b in zip(out["emulate"][1], out[False][1]))
    assert all(torch.equal(out["emulate"][2][n], out[False][2][n]) for n in out[False][2])
    assert out["emulate"][4]["eager_steps"] == 0
    # the bucket (batch 3 -> 4 rows): one indexer_scores launch a layer of 4 queries over [4, M] page tables, fp8
    # queries; eager: one indexer_logits launch a layer over one flat table, no indexer_scores
    bucket = out["emulate", "scores"]
    assert len(bucket) >= 1 and out["emulate"][3] == [] and out[False, "scores"] == []
    assert all(n == 4 and len(shape) == 2 and shape[0] == 4 and fp8 for n, shape, fp8 in bucket), bucket
    # the page tables are the step's, not each layer's: built once a forward of the bucket (StepContext.once)
    assert layers >= 2 and len(bucket) == layers * out["emulate", "tables"], (len(bucket), out["emulate", "tables"])
    assert len(out[False][3]) == len(bucket) and all(len(shape) == 1 for _, shape in out[False][3]), out[False][3]


def test_a_pool_whose_buffers_moved_is_captured_again():
    """A bucket reads the pool's buffers where it found them; when they move (or change shape) every bucket is
    dropped and built again over the new ones, and the results stay the eager path's."""
    out = {}
    for graphs in (False, "emulate"):
        rt = _runtime("reference", graphs, decode_mode="sharded")
        for p in _prompts(LENS[:3], 97):
            rt.add_request(p)
        rt.prefill(8)
        rt.decode(3)
        for name in sorted(rt.pool.layouts):  # the same bytes at new addresses (what a re-allocated pool looks like)
            rt.pool._buffers[name] = rt.pool._buffers[name].clone()
        rt.decode(3)
        out[graphs] = ([list(r.output) for r in rt.requests], rt.kv_bytes(0), rt.graphs and dict(rt.graphs.stats))
        rt.close()
    assert out["emulate"][0] == out[False][0]
    assert all(torch.equal(out["emulate"][1][n], out[False][1][n]) for n in out[False][1])
    st = out["emulate"][2]
    assert st["recaptures"] >= 1 and st["captures"] >= 2


def _eager_reason_case(case):
    if case == "debug":
        return "reference", {}, "DTKV_DEBUG"
    if case == "rows":
        return "deepseek-v32", {"kv_dtype": "bf16"}, "index pages stored as rows"
    if case == "shared":
        return "glm5-shared", {}, "reuse the previous layer's selection"
    return "deepseek-v32", {}, "'eager' implementation"


@pytest.mark.parametrize("case", ["debug", "rows", "shared", "experts"])
def test_steps_the_graphs_cannot_hold_run_eager_and_say_why(case, monkeypatch):
    """What a graph cannot hold runs the eager step, with the reason in ``runtime.graphs.reason`` (logged once):
    ``DTKV_DEBUG``'s synchronizing checks, sharded decode of bf16 index rows or of GLM-5's shared-indexer layers (the
    float64 path, planned on the host), transformers' ``"eager"`` MoE experts (a host sync). The tokens are the
    eager runtime's."""
    model, kw, why = _eager_reason_case(case)
    if model != "reference":
        _hf()
    results = {}
    for graphs in (False, "emulate"):
        rt = _runtime(model, graphs, decode_mode="sharded", **kw)
        if case == "experts":
            monkeypatch.setattr(rt.adapter.model.config, "_experts_implementation", "eager")
        for p in _prompts(LENS[:3], rt.model_spec.vocab_size):
            rt.add_request(p)
        rt.prefill(8)
        if case == "debug":
            with _env.debug_mode():
                rt.decode(2)
        else:
            rt.decode(2)
        results[graphs] = ([list(r.output) for r in rt.requests], rt.graphs and (rt.graphs.reason, rt.graphs.stats))
        rt.close()
    assert results["emulate"][0] == results[False][0]
    reason, stats = results["emulate"][1]
    assert why in reason, reason
    assert stats["eager_steps"] == 2


def test_experts_that_copy_to_the_host_are_named_before_a_capture():
    """transformers' MoE experts a capture refuses: ``"eager"`` (a host loop) and ``"grouped_mm"`` with CUDA weights
    that are not bf16 (torch's fallback copies the group offsets to the host: the H200 capture failed with "Cannot
    copy between CPU and CUDA tensors during CUDA graph capture" on the float32 tiny model). bf16 weights, CPU
    weights (no capture) and ``"batched_mm"`` are fine."""
    from types import SimpleNamespace

    from dtkv.integrations.transformers.adapter import _experts_graph_reason

    def weight(device, dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert "'eager' implementation" in _experts_graph_reason("eager", weight("cpu", torch.float32))
    why = _experts_graph_reason("grouped_mm", weight("cuda", torch.float32))
    assert "torch.float32" in why and "batched_mm" in why and "bf16" in why
    assert _experts_graph_reason("grouped_mm", weight("cuda", torch.float16)) != ""
    for impl, dev, dtype in [
        ("grouped_mm", "cuda", torch.bfloat16),
        ("grouped_mm", "cpu", torch.float32),
        ("batched_mm", "cuda", torch.float32),
    ]:
        assert _experts_graph_reason(impl, weight(dev, dtype)) == "", (impl, dev, dtype)
    assert _experts_graph_reason("eager", None) == ""  # no experts


# ------------------------------------------------------------------------------------------- CP ranks
def _graphs_rank(rank, world, model, decode_mode, mode):
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for graphs in (False, "emulate"):
        out[graphs] = _scenario(_runtime(model, graphs, decode_mode=decode_mode, group=dist.group.WORLD, mode=mode))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("decode_mode", "mode"), [("sharded", None), ("sharded", "sharded"), ("full", "replicated")]
)  # fmt: skip
def test_graph_path_equals_the_eager_path_on_ranks(ranks234, decode_mode, mode):
    """Sharded decode over sharded pools (both KV modes) and full-view decode over a replicated pool, on 2, 3 and 4
    ranks: every rank's graph path equals its eager path bitwise, and the ranks agree."""
    results = ranks234.run(_graphs_rank, "reference", decode_mode, mode)
    for res in results:
        _same(res["emulate"], res[False])
        assert res["emulate"]["graphs"]["eager_steps"] == 0
        assert res["emulate"]["outputs"] == results[0]["emulate"]["outputs"]


def _full_over_sharded_pools(rank, world):
    import torch.distributed as dist

    rt = _runtime("reference", "emulate", decode_mode="full", group=dist.group.WORLD)
    for p in _prompts(LENS[:2], 97):
        rt.add_request(p)
    rt.prefill(8)
    rt.decode(2)
    return rt.graphs.reason, dict(rt.graphs.stats)


@pytest.mark.multirank
def test_full_view_decode_over_sharded_pools_runs_eager(ranks2):
    for reason, stats in ranks2.run(_full_over_sharded_pools):
        assert "page-sharded pools" in reason and stats["eager_steps"] == 2 and stats["captures"] == 0


# ------------------------------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
@pytest.mark.parametrize("model", ["reference", "deepseek-v32"])
def test_captured_decode_equals_the_emulated_graph_path(model, decode_mode):
    """On a GPU: the captured and replayed steps equal the graph path run eagerly over the same buffers (tokens and
    KV bitwise, logits to 1e-5 of their scale: cuBLAS may choose other algorithms under capture), and most steps
    replay."""
    if model != "reference":
        _hf()
    runs = {}
    for graphs in (True, "emulate"):
        runs[graphs] = _scenario(_runtime(model, graphs, decode_mode=decode_mode, device="cuda",
                                          batch_invariant=False))  # fmt: skip
    st = runs[True]["graphs"]  # first: a capture that failed leaves eager steps, which need not match bit for bit
    assert st["eager_steps"] == 0 and st["replays"] >= 10, (st, runs[True]["reason"])
    _same(runs[True], runs["emulate"], logits_rtol=1e-5)


@needs_cuda
def test_captured_decode_recaptures_after_its_only_graph_was_dropped():
    """One request decodes past its page bucket twice: each time its only bucket is dropped and the next captured.
    A tensor of the first bucket's pool outlives its graph (as a backend's cached decode schedule can): a capture
    into that pool's handle then fails torch's allocator assert (``use_count > 0``, seen on an H200 under
    ``-n auto``; ``benchmarks/scripts/graph_pool_probe.py``), so it takes a new one."""
    rt = _runtime("reference", True, decode_mode="full", device="cuda", batch_invariant=False)
    try:
        rt.add_request(_prompts((7,), rt.model_spec.vocab_size)[0])  # 2 pages of 4
        rt.prefill(8)
        rt.decode(2)  # captured, then replayed
        (bucket,) = rt.graphs.buckets.values()
        held = bucket._out
        rt.decode(8)  # 9..16 tokens: pages 3 and 4, each a new bucket of batch 1
        st = rt.graphs.stats
        assert st["eager_steps"] == 0 and st["captures"] >= 3, (st, rt.graphs.reason, rt.graphs.refused)
        assert held.is_cuda
    finally:
        rt.close()


@needs_cuda
@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
def test_captured_decode_at_deepseek_v32_dims(decode_mode):
    """A bf16 DeepSeek-V3.2 model at its attention dims (128 heads, kv_lora_rank 512, rope 64, indexer 64 x 128,
    index_topk 2048; 2 layers) with fp8 KV on the runtime's fastest backend: 5 requests of 3000 tokens, captured
    steps equal the emulated graph path bitwise."""
    _hf()
    from dtkv.integrations.transformers import TransformersAdapter, tiny_model

    lm = tiny_model("deepseek-v32", num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64,
                    index_head_dim=128, index_topk=2048, num_hidden_layers=2, hidden_size=1024,
                    dtype=torch.bfloat16, device="cuda")  # fmt: skip
    out = {}
    for graphs in (True, "emulate"):
        ad = TransformersAdapter(lm, kv_dtype="fp8", page_size=64)
        with Runtime(ad, num_pages=num_pages_for([3000] * 5, page_size=64, decode_steps=8), decode_mode=decode_mode,
                     cuda_graphs=graphs) as rt:  # fmt: skip
            for p in _prompts([3000] * 5, 256):
                rt.add_request(p)
            rt.prefill(1024)
            outs, lg = rt.decode(6, return_logits=True)
            out[graphs] = (outs, lg, rt.kv_bytes(2), dict(rt.graphs.stats), rt.attention.name)
    assert out[True][0] == out["emulate"][0]
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out["emulate"][1]))
    assert all(torch.equal(out[True][2][n], out["emulate"][2][n]) for n in out[True][2])
    assert out[True][3]["replays"] >= 4 and out[True][3]["eager_steps"] == 0
    assert math.isfinite(float(out[True][1][-1].abs().max()))


@needs_cuda
def test_captured_buckets_follow_a_pool_whose_buffers_moved():
    """On a GPU a stale graph would read the old buffers: after the pool's buffers move, the buckets are captured
    again and the tokens and KV stay the eager runtime's."""
    out = {}
    for graphs in (False, True):
        rt = _runtime("reference", graphs, decode_mode="sharded", device="cuda")
        for p in _prompts(LENS[:3], 97):
            rt.add_request(p)
        rt.prefill(8)
        rt.decode(3)
        for name in sorted(rt.pool.layouts):
            old = rt.pool._buffers[name]
            rt.pool._buffers[name] = old.clone()
            old.zero_()  # what a stale graph would now read
        rt.decode(3)
        out[graphs] = ([list(r.output) for r in rt.requests], rt.kv_bytes(0), rt.graphs and dict(rt.graphs.stats))
        rt.close()
    assert out[True][0] == out[False][0]
    assert all(torch.equal(out[True][1][n], out[False][1][n]) for n in out[False][1])
    assert out[True][2]["recaptures"] >= 1
