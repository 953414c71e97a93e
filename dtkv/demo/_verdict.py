"""The demo's parity verdicts: one per phase that ran, each with its rule and its worst case and why.

Every check is a dict ``{"ok", "rule", "worst", "where", "reason"}`` (JSON); ``parity`` is true when every check
is. The rules:

- reference model, ``prefill``: prefill logits, greedy tokens and every stored KV byte are bitwise those of the
  replicated-KV baseline (both runs split the tokens over the ranks the same way, so they run the same float64
  arithmetic); ``decode``: bitwise too for full-view decode; sharded decode changes only the float64 summation
  order (the split softmax merged by LSE), so tokens must be equal and logits within :data:`SHARDED_DECODE_RTOL`
  relative (``tests/test_decode_model.py``).
- transformers models, ``prefill_decode``: every prompt and decode position against the model's own forward under
  ``stable_topk`` with keys in the pools' formats (:mod:`dtkv.integrations.transformers`): per-position max
  ``|logit diff|`` within :data:`TOLERANCE` at a fraction >= :data:`MIN_WITHIN` of positions, none above
  :data:`MAX_DIFF`, greedy tokens equal (a bfloat16 model's may differ only at a near tie: :data:`FLIP_MARGIN`; the
  printed rule says so and the reason lists the margins, so the rule and the verdict never disagree). A run
  on FlashMLA (bf16 probabilities) is held instead to the noise that rounding costs the model's own forward
  (:func:`rounded_attention_check`). The worst difference is explained, not excused: rank 0 serves the same
  prompts in one process (cp=1) and compares it with the same reference (:func:`one_process_note`); the same
  worst value at the same position, with the sharded logits equal to the one-process run's, means it is the
  reference's own rounding, not the sharding.
- ``prefix_cache``: tokens, logits and KV bytes bitwise equal to the run without the cache (transformers models run
  batch-invariant products for it); with sharded decode the logits within the sharded-decode bound (the cache
  moves pages, so the merge sums in another order) and, for the float32 transformers models, the KV bytes are not
  compared (a decoded token's row comes from the shards in one run and from a prefill step in the other).
- ``pd``: the decode group's KV bytes on their owners equal the prefill's (a digest of every layer and pool) and
  its greedy tokens equal the prefill group's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "FLIP_MARGIN",
    "MAX_DIFF",
    "MIN_WITHIN",
    "ROUNDED_NOISE_RATIO",
    "SHARDED_DECODE_ATOL",
    "SHARDED_DECODE_RTOL",
    "TOLERANCE",
    "check",
    "one_process_note",
    "parity_of",
    "rounded_attention_check",
    "tokens_rule",
    "transformers_check",
]

SHARDED_DECODE_RTOL = 1e-9
"""Reference model: sharded-decode logits against full-view decode, relative to their scale (float64 noise ~1e-15)."""
SHARDED_DECODE_ATOL = 1e-4
"""Transformers models: sharded (absorbed MLA, split softmax) against full-view decode, float32 (measured <=1.1e-5)."""
TOLERANCE = {
    ("float32", "fp32"): 1e-5,
    ("float32", "fp8"): 1e-4,
    ("float32", "bf16"): 2e-3,
    ("bfloat16", "fp32"): 3e-2,
    ("bfloat16", "fp8"): 3e-2,
    ("bfloat16", "bf16"): 3e-2,
}
"""Per-position logit tolerance against the model's own forward, by (model dtype, KV dtype). Float32 models:
float32 summation-order noise, amplified by the stored format's rounding (measurements in
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
"""Fraction of positions that must be within the tolerance, by (model dtype, KV dtype). The model is discontinuous
(MoE top-2 routing, index top-k): noise flips a near-tie at an isolated position, and the logits there jump. A bf16
model's noise is the last bit of every op, so such positions are more frequent (CPU: 94.8-100% within 3e-2, tokens
always equal; 2 H200s: 98.1-99.4%). fp8 KV adds a discontinuity of its own: a last-bit difference in a key before
quantization can move it to the next fp8 code (1/16 of its value), so float32 models with fp8 KV get the lower
bound (CPU >= 97%; 2 H200s: 94.2-99.0%)."""
FLIP_MARGIN = 2.0
"""A bfloat16 model's greedy token may differ from the reference's only at a near tie: where the reference's own
margin between the two tokens is at most ``FLIP_MARGIN * tolerance``. Float32 models must choose every token as
the reference does."""
MAX_DIFF = 1.0
"""Bound on any position's logit difference."""


ROUNDED_NOISE_RATIO = 1.5
"""A run on FlashMLA: its mean logit difference from the float32-attention reference may be at most this many
times the mean difference of the model's own forward with rounded probabilities (eager attention: softmax rounded
to bf16 before it multiplies V, what FlashMLA does) from the same reference. Measured on one H200, the tiny models
in bf16 at FlashMLA's dims: DeepSeek-V3.2 0.0875 vs 0.0855, GLM-5 0.0811 vs 0.0790
(``benchmarks/results/demo_flashmla_h200_2026-12-01.md``)."""


def rounded_attention_check(
    diffs: torch.Tensor, base: torch.Tensor, labels: list[str], tokens_equal: bool, margins: list[float]
) -> dict:
    """The verdict of a run on a kernel that rounds attention probabilities to bf16 (FlashMLA).

    ``diffs``: per position, the run's max ``|logit diff|`` from the model's own forward with float32 attention;
    ``base``: the same for the model's own forward with rounded probabilities (what that rounding costs the model
    itself). Parity: the run's mean within :data:`ROUNDED_NOISE_RATIO` of the base's, no position above
    :data:`MAX_DIFF`, and a greedy token may differ from the reference's only where the reference's margin is
    within the largest logit movement the model's own rounded forward shows (a tie that close is noise)."""
    mean, base_mean = float(diffs.mean()), float(base.mean())
    worst, base_worst = float(diffs.max()), float(base.max())
    flips_ok = all(m <= base_worst for m in margins)
    ok = mean <= ROUNDED_NOISE_RATIO * base_mean + 1e-6 and worst <= MAX_DIFF and flips_ok
    at = int(diffs.argmax())
    rule = (
        "every prompt and decode position against the model's own forward (stable index top-k, keys in the pools' "
        f"formats, float32 attention): mean |logit diff| <= {ROUNDED_NOISE_RATIO:g} x that of the model's own "
        f"forward with bf16-rounded attention probabilities (as FlashMLA computes), none > {MAX_DIFF:g}, greedy "
        f"tokens equal except at near ties: a token may differ where the reference's margin is <= that forward's "
        f"largest logit movement ({base_worst:.3g} here)"
    )
    reason = f"mean {mean:.3g} vs the rounded forward's {base_mean:.3g} (max {worst:.3g} vs {base_worst:.3g})"
    if margins:
        reason += (f"; {len(margins)} greedy token(s) differ, at reference margins {_margins_text(margins)} "
                   f"({'within' if flips_ok else 'past'} {base_worst:.3g})")  # fmt: skip
    return check(
        ok, rule, worst, labels[at] if labels else "", reason, parity=bool(ok), tokens_equal=bool(tokens_equal),
        token_flips=len(margins), max_flip_margin=max(margins, default=0.0), flip_margins=sorted(margins, reverse=True),
        mean_abs_logit_diff=mean,
        max_abs_logit_diff=worst, rounded_forward_mean=base_mean, rounded_forward_max=base_worst,
    )  # fmt: skip


def check(ok: bool, rule: str, worst: float, where: str = "", reason: str = "", **extra) -> dict:
    """One phase's verdict (JSON-able)."""
    return {"ok": bool(ok), "rule": rule, "worst": float(worst), "where": where, "reason": reason, **extra}


def parity_of(
    model_dtype: str, kv_dtype: str, diffs: torch.Tensor, tokens_equal: bool, flip_margins: Sequence[float] = ()
) -> dict:
    """The transformers verdict from per-position max abs logit differences ``[num_positions]`` and, for every greedy
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


def _margins_text(margins: Sequence[float], limit: int = 4) -> str:
    shown = ", ".join(f"{m:.2e}" for m in sorted(margins, reverse=True)[:limit])
    return shown + (f", ... ({len(margins)} in all)" if len(margins) > limit else "")


def tokens_rule(model_dtype: str, tol: float) -> str:
    """The greedy-token part of the transformers rule, as :func:`parity_of` applies it."""
    if model_dtype == "bfloat16":
        return (
            "greedy tokens equal except at near ties: a token may differ where the reference's margin between its "
            f"token and the one chosen is <= {FLIP_MARGIN:g} x {tol:g} = {FLIP_MARGIN * tol:.3g}"
        )
    return "greedy tokens equal (no exception: a float32 model chooses every token as its own forward does)"


def one_process_note(worst: float, where: str, one: dict | None, tol: float) -> tuple[str, dict]:
    """Where the worst difference from the model's own forward comes from, measured with one process.

    ``one``: the same comparison for the same prompts served by one process (cp=1, no sharding): ``worst``,
    ``where`` (its largest difference from the same reference) and ``vs_sharded`` (the largest difference between
    the sharded run's logits and its own); ``None`` when the run is one process itself. Returns the sentence for
    the check's reason and its JSON fields. When one process shows the same worst difference at the same position
    and the sharded run stays within ``tol`` of it everywhere, the difference is the reference's own rounding
    (its full-sequence forward sums in another order than dtkv's kernels, and at a near tie of the MoE
    router or the index top-k that flips a choice), not the sharding.
    """
    if one is None:
        return ("one process (cp=1): the difference is the comparison with the model's own forward, whose "
                "rounding differs from dtkv's kernels", {})  # fmt: skip
    fields = {"one_process_worst": one["worst"], "one_process_where": one["where"],
              "sharded_vs_one_process": one["vs_sharded"]}  # fmt: skip
    same = one["where"] == where and abs(one["worst"] - worst) <= tol
    if one["vs_sharded"] <= tol and same:
        agree = "bitwise equal to" if one["vs_sharded"] == 0 else f"within {one['vs_sharded']:.1e} of"
        text = (f"one process (cp=1) gives the same {one['worst']:.2e} at the same position, and the sharded run's "
                f"logits are {agree} that run's: the reference's own rounding (its full-sequence forward sums in "
                "another order than dtkv's kernels), not the sharding")  # fmt: skip
    else:
        text = (f"one process (cp=1) gives {one['worst']:.2e} at {one['where'] or '-'}; the sharded run differs "
                f"from it by up to {one['vs_sharded']:.2e}")  # fmt: skip
    return text, fields


def transformers_check(
    model_dtype: str,
    kv_dtype: str,
    diffs: torch.Tensor,
    labels: list[str],
    tokens_equal: bool,
    margins: list[float],
    one_process: dict | None | Literal[False] = False,
) -> dict:
    """:func:`parity_of` as a check: its rule, the worst position (``labels[i]`` names position ``i``) and why.

    ``one_process``: the one-process measurement of :func:`one_process_note` (``None``: this run is one process;
    ``False``: not measured, as in ``--multi-turn``). It explains a worst case above the tolerance; it never
    changes the verdict.
    """
    v = parity_of(model_dtype, kv_dtype, diffs, tokens_equal, margins)
    tol, need = v["tolerance"], v["min_within_tolerance"]
    at = int(diffs.argmax()) if diffs.numel() else 0
    worst = v["max_abs_logit_diff"]
    where = labels[at] if labels else ""
    extra: dict = {}
    if worst <= tol:
        reason = f"within {tol:g}: float32 summation order (CP splits the matmuls and the sparse attention)"
    elif worst <= MAX_DIFF:
        reason = (
            f"above {tol:g} at {100 * (1 - v['within_tolerance']):.1f}% of positions (allowed "
            f"{100 * (1 - need):.0f}%): a near tie of the MoE router or the index top-k, broken otherwise there"
        )
        if one_process is not False:
            note, extra = one_process_note(worst, where, one_process, tol)
            reason += f"; {note}"
    else:
        reason = f"above the bound {MAX_DIFF:g} on any position: a real difference"
    if not v["tokens_equal"]:
        if model_dtype == "bfloat16":
            bound = FLIP_MARGIN * tol
            allowed = f"{'within' if v['max_flip_margin'] <= bound else 'past'} the near-tie bound {bound:.3g}"
        else:
            allowed = "a float32 model may not differ"
        reason += (f"; {v['token_flips']} greedy token(s) differ, at reference margins {_margins_text(margins)} "
                   f"({allowed})")  # fmt: skip
    rule = (
        f"every prompt and decode position against the model's own forward (stable index top-k, keys in the "
        f"pools' formats): |logit diff| <= {tol:g} at >= {100 * need:.0f}% of positions, none > {MAX_DIFF:g}, "
        f"{tokens_rule(model_dtype, tol)}"
    )
    flips = sorted(margins, reverse=True)
    return check(v["parity"], rule, worst, where, reason, flip_margins=flips, **v, **extra)
