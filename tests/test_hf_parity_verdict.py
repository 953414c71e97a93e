"""The transformers demo's parity verdict (``dtkv.demo._verdict.parity_of``): tolerances by
model and KV dtype, and the near-tie rule for a bfloat16 model's greedy tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dtkv.demo._verdict import FLIP_MARGIN, MIN_WITHIN, TOLERANCE, parity_of  # noqa: E402


def _diffs(n: int, bad: int, tol: float) -> torch.Tensor:
    """``n`` positions, ``bad`` of them just above ``tol`` (the rest at a tenth of it)."""
    d = torch.full((n,), tol / 10)
    d[:bad] = tol * 1.5
    return d


@pytest.mark.parametrize(("model_dtype", "kv_dtype"), sorted(TOLERANCE))
def test_within_fraction_bound_is_inclusive_and_keyed_by_both_dtypes(model_dtype, kv_dtype):
    tol, need = TOLERANCE[(model_dtype, kv_dtype)], MIN_WITHIN[(model_dtype, kv_dtype)]
    n = 1000
    bad = round(n * (1 - need))
    assert parity_of(model_dtype, kv_dtype, _diffs(n, bad, tol), True)["parity"] is True
    res = parity_of(model_dtype, kv_dtype, _diffs(n, bad + 1, tol), True)
    assert res["parity"] is False and res["within_tolerance"] < need


def test_a_position_beyond_max_diff_fails_whatever_the_fraction():
    d = torch.zeros(1000)
    d[0] = 1.01
    assert parity_of("float32", "fp32", d, True)["parity"] is False


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_bfloat16_token_flips_pass_only_at_near_ties(kv_dtype):
    tol = TOLERANCE[("bfloat16", kv_dtype)]
    d = torch.full((100,), tol / 10)
    near = parity_of("bfloat16", kv_dtype, d, False, [FLIP_MARGIN * tol])
    assert near["parity"] is True and near["tokens_equal"] is False and near["token_flips"] == 1
    far = parity_of("bfloat16", kv_dtype, d, False, [0.0, FLIP_MARGIN * tol * 1.01])
    assert far["parity"] is False and far["token_flips"] == 2
    assert far["max_flip_margin"] == pytest.approx(FLIP_MARGIN * tol * 1.01)


def test_float32_models_must_choose_every_token_as_the_reference():
    d = torch.zeros(100)
    assert parity_of("float32", "bf16", d, False, [0.0])["parity"] is False
    assert parity_of("float32", "bf16", d, True, [])["parity"] is True


def test_a_flashmla_run_is_held_to_the_bfloat16_rule_whatever_the_models_dtype():
    """FlashMLA attends in bf16: a float32 model's run on it gets bf16 noise, so the float32 rule (1e-5..2e-3)
    would call every such run a failure; on the other backends the model's own dtype sets the rule."""
    from dtkv.demo._verdict import verdict_dtype

    assert verdict_dtype("float32", "flashmla") == "bfloat16" and verdict_dtype("bfloat16", "flashmla") == "bfloat16"
    assert verdict_dtype("float32", "torch") == "float32" and verdict_dtype("float32", "triton") == "float32"
    d = torch.full((100,), 0.02)  # bf16-sized noise: fails the float32 rule, passes the bf16 one
    assert parity_of(verdict_dtype("float32", "torch"), "bf16", d, True)["parity"] is False
    assert parity_of(verdict_dtype("float32", "flashmla"), "bf16", d, True)["parity"] is True
