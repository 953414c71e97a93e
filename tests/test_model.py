"""End-to-end CP prefill of the reference model: every KV mode, split and KV dtype agree.

Tolerances: all CP modes share one split of tokens over ranks, so they run the same float64 arithmetic on the
same rows and must agree bit for bit (logits, tokens, stored KV bytes). The single-process run batches tokens
differently, so float64 reductions may sum in another order (relative error ~1e-16); rounding to bf16/fp32 makes
a stored difference possible only for a value within ~1e-16 of a rounding boundary, so we require identical
tokens, logits within 1e-9 relative (a million times the float64 noise, far below any real bug) and report
the fraction of identical KV bytes, which must be >= 99.9%.
"""

from __future__ import annotations

import pytest
import torch

from dtkv.model import ModelConfig
from tests._runtime import reference_runtime

PROMPT_LENS = (101, 47, 6)  # a long request (3 chunks), a medium one, a short one that falls back
CHUNK = 40


def _prompts(cfg: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(cfg, mode, split, group, *, prefetch=False, decode_steps=2, debug=False):
    import dtkv

    eng = reference_runtime(cfg, mode=mode, split=split, group=group, num_pages=96)
    for p in _prompts(cfg):
        eng.add_request(p)
    logits = []
    with dtkv.debug_mode(debug):
        while any(r.num_computed < len(r.prompt) for r in eng.requests):
            todo = [r for r in eng.requests if r.num_computed < len(r.prompt)]
            lens = [min(CHUNK, len(r.prompt) - r.num_computed) for r in todo]
            logits.append(eng.step(todo, lens, prefetch=prefetch))
            for r, row in zip(todo, logits[-1]):
                if r.num_computed == len(r.prompt):
                    r.output.append(int(row.argmax()))
        outputs = eng.decode(decode_steps)
    kv = [eng.kv_bytes(r.rid) for r in eng.requests]
    return {"logits": logits, "outputs": outputs, "kv": kv, "stats": dict(eng.stats)}


def _all_modes(rank, world, kv_dtype, split):
    import torch.distributed as dist

    cfg = ModelConfig(kv_dtype=kv_dtype, page_size=4)
    group = dist.group.WORLD
    modes = ["replicated", "sharded"] + (["sharded_direct"] if split == "zigzag" else [])
    runs = {m: _run(cfg, m, split, group) for m in modes}
    runs["sharded_prefetch"] = _run(cfg, "sharded", split, group, prefetch=True)
    runs["single"] = _run(cfg, "single", split, None)
    base = runs["replicated"]
    out = {"rank": rank, "stats": {m: r["stats"] for m, r in runs.items()}}
    for m, r in runs.items():
        out[m] = {
            "outputs_equal": r["outputs"] == base["outputs"],
            "logits_bitwise": all(torch.equal(a, b) for a, b in zip(r["logits"], base["logits"])),
            "logits_max_rel": max(
                float((a - b).abs().max() / b.abs().max()) for a, b in zip(r["logits"], base["logits"])
            ),
            "kv_bitwise": all(torch.equal(a[n], b[n]) for a, b in zip(r["kv"], base["kv"]) for n in a),
            "kv_equal_fraction": sum(int((a[n] == b[n]).sum()) for a, b in zip(r["kv"], base["kv"]) for n in a)
            / sum(a[n].numel() for a in base["kv"] for n in a),
        }
    out["outputs"] = base["outputs"]
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("split", ["zigzag", "round_robin"])
def test_cp_modes_are_bitwise_identical_and_match_single_process(ranks, kv_dtype, split):
    _check_all_modes(ranks.run(_all_modes, kv_dtype, split), split)


@pytest.mark.multirank
def test_cp_modes_at_three_ranks(ranks3):
    """An odd group size: uneven page ownership, segments of other lengths."""
    _check_all_modes(ranks3.run(_all_modes, "fp8", "zigzag"), "zigzag")


def _check_all_modes(results, split):
    for res in results:
        for mode in ("sharded", "sharded_prefetch", "sharded_direct"):
            if mode not in res:
                continue
            r = res[mode]
            assert r["outputs_equal"] and r["logits_bitwise"] and r["kv_bitwise"], (mode, r)
        single = res["single"]
        assert single["outputs_equal"], single
        assert single["logits_max_rel"] < 1e-9, single
        assert single["kv_equal_fraction"] >= 0.999, single
        assert res["outputs"] == results[0]["outputs"]
    if split == "zigzag":  # direct writes happened, and the partial first pages went through the handoff path
        assert sum(r["stats"]["sharded_direct"]["direct_rows"] for r in results) > 0
        assert sum(r["stats"]["sharded_direct"]["handoff_rows"] for r in results) > 0


def test_single_mode_is_deterministic_and_rejects_bad_prompts():
    cfg = ModelConfig(page_size=4)
    a, b = _run(cfg, "single", "zigzag", None), _run(cfg, "single", "zigzag", None)
    assert a["outputs"] == b["outputs"] and all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))
    eng = reference_runtime(cfg, mode="single", num_pages=8)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 97\), got 97"):
        eng.add_request([1, 97])
    with pytest.raises(ValueError, match="mode must be one of"):
        reference_runtime(cfg, mode="shared", num_pages=8)
    with pytest.raises(ValueError, match="needs split='zigzag'"):
        reference_runtime(cfg, mode="sharded_direct", split="round_robin", num_pages=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_cuda_engine_matches_cpu(kv_dtype):
    """On CUDA the ops run their Triton kernels; float64 math on another device may differ in the last bits, so
    tokens must match and logits agree to 1e-9 of their scale; KV rows quantized from equal inputs are equal.
    Attention is the float64 torch reference on both (the default on CUDA is a float32/bf16 kernel)."""
    cfg = ModelConfig(kv_dtype=kv_dtype, page_size=4)
    runs = {}
    for device in ("cpu", "cuda"):
        eng = reference_runtime(cfg, mode="single", num_pages=96, device=device, attention="torch")
        for p in _prompts(cfg):
            eng.add_request(p)
        first = eng.prefill(CHUNK)
        runs[device] = (first, eng.decode(2), [eng.kv_bytes(r.rid) for r in eng.requests])
    assert runs["cpu"][0] == runs["cuda"][0] and runs["cpu"][1] == runs["cuda"][1]
    same = sum(int((a[n] == b[n]).sum()) for a, b in zip(runs["cpu"][2], runs["cuda"][2]) for n in a)
    total = sum(a[n].numel() for a in runs["cpu"][2] for n in a)
    assert same / total >= 0.999
