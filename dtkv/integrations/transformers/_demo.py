"""``python -m dtkv.demo --model deepseek-v32|glm5``: one rank's run and the summary (used by :mod:`dtkv.demo`).

Each rank wraps the same tiny random model (:func:`tiny_model`, seeded) in a :class:`DSAModelRunner`, runs
chunked CP prefill and greedy decode, and rank 0 compares every prompt and decode logit with the model's own
forward (:func:`reference_logits` with the pools' formats; see :mod:`dtkv.integrations.transformers`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtkv.integrations.transformers.reference import reference_logits, tiny_model
from dtkv.integrations.transformers.runner import DSAModelRunner, num_pages_for

__all__ = ["DTYPES", "FLASHMLA_DIMS", "MIN_WITHIN", "TOLERANCE", "parity_of", "run_rank", "summary"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLASHMLA_DIMS = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
}
"""``--attention flashmla``: :func:`tiny_model` at FlashMLA's dims (and pages of 64 tokens; the indexer's rope of 64
dims needs more than 64 indexer dims)."""
TOLERANCE = {
    ("float32", "fp32"): 1e-5,
    ("float32", "fp8"): 1e-4,
    ("float32", "bf16"): 2e-3,
    ("bfloat16", "fp32"): 3e-2,
    ("bfloat16", "fp8"): 3e-2,
    ("bfloat16", "bf16"): 3e-2,
}
"""Per-position logit tolerance against the reference, by (model dtype, KV dtype). Float32 models: float32
summation-order noise, amplified by the stored format's rounding (measurements in
``tests/test_integration_transformers.py``). bfloat16 models: the logits themselves are bf16, so a last-bit
difference anywhere shows as an ulp of the logits (2**-7 at magnitude 1); measured on CPU: <= 7.8e-3."""
MIN_WITHIN = {
    ("float32", "fp32"): 0.97,
    ("float32", "bf16"): 0.97,
    ("float32", "fp8"): 0.90,
    ("bfloat16", "fp32"): 0.90,
    ("bfloat16", "bf16"): 0.90,
    ("bfloat16", "fp8"): 0.90,
}
"""Fraction of positions that must be within the tolerance, by (model dtype, KV dtype). The model is
discontinuous (MoE top-2 routing, index top-k): noise flips a near-tie at an isolated position, and the logits
there jump. A bf16 model's noise is the last bit of every op (the sparse attention sums in another order than
SDPA), so such positions are more frequent (CPU: 94.8-100% within 3e-2, tokens always equal; 2 H200s: 98.1-99.4%).
fp8 KV adds a discontinuity of its own: a last-bit difference in a key before quantization can move it to the
next fp8 code (1/16 of its value), so float32 models with fp8 KV get the lower bound (CPU >= 97%; 2 H200s, where
cuBLAS sums the chunked and the whole-sequence projections in different orders: 94.2-99.0%)."""
FLIP_MARGIN = 2.0
"""A bfloat16 model's greedy token may differ from the reference's only at a near tie: where the reference's own
margin between the two tokens is at most ``FLIP_MARGIN * tolerance`` (each logit moved by at most the noise).
Float32 models must choose every token as the reference does."""
MAX_DIFF = 1.0
"""Bound on any position's logit difference."""


def parity_of(
    model_dtype: str, kv_dtype: str, diffs: torch.Tensor, tokens_equal: bool, flip_margins: list[float] = ()
) -> dict:
    """The demo's verdict from per-position max abs logit differences ``[num_positions]`` and, for every greedy
    token that differs from the reference's, the reference's margin between its token and the one chosen."""
    tol = TOLERANCE[(model_dtype, kv_dtype)]
    within = int((diffs <= tol).sum()) / diffs.numel() if diffs.numel() else 1.0  # exact (no float32 mean)
    worst = float(diffs.max()) if diffs.numel() else 0.0
    min_within = MIN_WITHIN[(model_dtype, kv_dtype)]
    flips_ok = tokens_equal or (model_dtype == "bfloat16" and max(flip_margins, default=0.0) <= FLIP_MARGIN * tol)
    return {
        "parity": bool(flips_ok and within >= min_within and worst <= MAX_DIFF),
        "tokens_equal": bool(tokens_equal),
        "token_flips": len(flip_margins),
        "max_flip_margin": max(flip_margins, default=0.0),
        "max_abs_logit_diff": worst,
        "mean_abs_logit_diff": float(diffs.mean()) if diffs.numel() else 0.0,
        "within_tolerance": within,
        "tolerance": tol,
        "min_within_tolerance": min_within,
    }


def run_rank(rank: int, world: int, args: dict, group, device: torch.device, prompts: list[list[int]]) -> dict:
    """One rank's demo run (collective over ``group``); rank 0 also compares with the reference."""
    dtype = DTYPES[args["dtype"]]
    attention = args.get("attention", "torch")
    dims = FLASHMLA_DIMS if attention == "flashmla" else {}
    page_size = 64 if attention == "flashmla" else args["page_size"]
    lm = tiny_model(args["model"], seed=args["seed"], dtype=dtype, device=device, **dims)
    num_pages = num_pages_for(
        [len(p) for p in prompts], page_size=page_size, decode_steps=args["decode_steps"], cp_size=world
    )
    runner = DSAModelRunner(
        lm,
        group=group,
        num_pages=num_pages,
        page_size=page_size,
        kv_dtype=args["kv_dtype"],
        split=args["split"],
        attention=attention,
    )
    for p in prompts:
        runner.add_request(p)
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    _, logits = runner.prefill(args["chunk"], prefetch=True, return_logits=True)
    pd_report = {}
    if args.get("pd_port"):
        from dtkv.integrations.transformers._demo_pd import send_from_rank

        pd_report = send_from_rank(runner, args)
    outputs, decode_logits = runner.decode(args["decode_steps"], return_logits=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    runner.close()
    out = {
        "rank": rank,
        "outputs": outputs,
        "mode": runner.mode,
        "seconds": seconds,
        "steps": runner.stats["steps"],
        "kv_bytes_per_rank": runner.pool.bytes_per_rank(),
        "kv_bytes_replicated": runner.pool.replicated_bytes(),
        "scratch_bytes_per_rank": runner.stats["scratch_bytes"],
        "direct_rows": runner.stats["direct_rows"],
        "handoff_rows": runner.stats["handoff_rows"],
        **pd_report,
    }
    if rank == 0:
        out.update(_compare(lm, runner, prompts, outputs, logits, decode_logits, args))
    return out


def _compare(lm, runner, prompts, outputs, logits, decode_logits, args) -> dict:
    """Per-position differences against the model's own forward: with the pools' formats (the verdict) and at
    full precision (the cost of the KV format itself, reported only)."""
    res = {}
    for key, layouts in (("", runner.layouts), ("_full_precision", None)):
        diffs, tokens_equal, margins = [], True, []
        for i, p in enumerate(prompts):
            ref = reference_logits(lm, p + outputs[i][:-1], layouts=layouts)
            got = torch.cat([logits[i]] + [step[i : i + 1] for step in decode_logits]).to(ref.device)
            diffs.append((ref - got).abs().amax(-1).cpu())
            gen = ref[len(p) - 1 :]
            for row, want, chosen in zip(gen, gen.argmax(-1).tolist(), outputs[i]):
                if want != chosen:  # teacher-forced on dtkv's tokens, so later positions still compare
                    margins.append(float(row[want] - row[chosen]))
            tokens_equal &= not margins
        d = torch.cat(diffs)
        if key:
            res["max_abs_logit_diff_full_precision"] = float(d.max())
            res["tokens_equal_full_precision"] = bool(tokens_equal)
        else:
            res.update(parity_of(args["dtype"], args["kv_dtype"], d, tokens_equal, margins))
    return res


def summary(args: dict, results: list[dict], wall: float, device: str) -> dict:
    """The demo's JSON object from every rank's result (rank 0 carries the comparison)."""
    r0 = results[0]
    per_rank = max(r["kv_bytes_per_rank"] for r in results)
    scratch = max(r["scratch_bytes_per_rank"] for r in results)
    agree = all(r["outputs"] == r0["outputs"] for r in results)
    return {
        "parity": bool(r0["parity"] and agree),
        "max_abs_logit_diff": r0["max_abs_logit_diff"],
        "mean_abs_logit_diff": r0["mean_abs_logit_diff"],
        "within_tolerance": r0["within_tolerance"],
        "tolerance": r0["tolerance"],
        "min_within_tolerance": r0["min_within_tolerance"],
        "tokens_equal": r0["tokens_equal"],
        "token_flips": r0["token_flips"],
        "max_flip_margin": r0["max_flip_margin"],
        "reference": "the model's own forward (stable index top-k ties, keys in the pools' formats)",
        "max_abs_logit_diff_full_precision": r0["max_abs_logit_diff_full_precision"],
        "tokens_equal_full_precision": r0["tokens_equal_full_precision"],
        "model": args["model"],
        "attention": args.get("attention", "torch"),
        "dtype": args["dtype"],
        "cp": args["cp"],
        "tokens": args["tokens"],
        "requests": args["requests"],
        "chunk": args["chunk"],
        "page_size": 64 if args.get("attention") == "flashmla" else args["page_size"],
        "kv_dtype": args["kv_dtype"],
        "split": args["split"],
        "mode": r0["mode"],
        "device": device,
        "steps": r0["steps"],
        "kv_bytes_per_rank": per_rank,
        "kv_bytes_replicated": r0["kv_bytes_replicated"],
        "scratch_bytes_per_rank": scratch,
        "capacity_multiplier": r0["kv_bytes_replicated"] / per_rank,
        "direct_rows": sum(r["direct_rows"] for r in results),
        "handoff_rows": sum(r["handoff_rows"] for r in results),
        "seconds_sharded": max(r["seconds"] for r in results),
        "wall_seconds": wall,
        "generated": r0["outputs"],
    }
