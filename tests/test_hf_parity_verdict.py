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


def test_a_flashmla_run_is_held_to_what_rounded_probabilities_cost_the_models_own_forward():
    """FlashMLA rounds attention probabilities to bf16: the run passes when its mean logit difference from the
    float32-attention reference is within ROUNDED_NOISE_RATIO of the model's own rounded forward's, and fails when
    it is not, when a position is past MAX_DIFF, or when a greedy token differs at a margin the noise cannot explain."""
    from dtkv.demo._verdict import MAX_DIFF, ROUNDED_NOISE_RATIO, rounded_attention_check

    base = torch.full((50,), 0.06)
    base[7] = 0.6  # the rounded forward's largest movement
    labels = [f"p{i}" for i in range(50)]
    ok = rounded_attention_check(base * ROUNDED_NOISE_RATIO * 0.99, base, labels, True, [])
    assert ok["ok"] is True and ok["where"] == "p7"
    assert rounded_attention_check(base * ROUNDED_NOISE_RATIO * 1.01, base, labels, True, [])["ok"] is False
    far = base.clone()
    far[3] = MAX_DIFF + 0.01
    assert rounded_attention_check(far, base, labels, True, [])["ok"] is False
    assert rounded_attention_check(base, base, labels, False, [0.5])["ok"] is True  # a tie within the noise
    assert rounded_attention_check(base, base, labels, False, [0.7])["ok"] is False  # past the largest movement


def test_the_demo_checks_a_flashmla_run_against_the_models_own_rounded_forward():
    """The demo's own-forward check as a FlashMLA run gets it (CPU: the logits handed in stand for the run's): the
    model's own rounded forward passes, and a run whose logits are off by more than the rounding explains fails."""
    from dtkv.demo._models import DemoModel
    from dtkv.demo._run import _own_forward_check
    from dtkv.integrations.transformers import reference_logits, tiny_model

    m = DemoModel(name="deepseek-v32", kv_dtype="bf16", page_size=16, device=torch.device("cpu"))
    m.lm = tiny_model("deepseek-v32", seed=1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 256, (40,), generator=g).tolist(), torch.randint(0, 256, (23,), generator=g).tolist()]
    args = {"attention": "flashmla"}
    outputs, rows = [], []
    for p in ps:
        own = reference_logits(m.lm, p, rounded_probabilities=True)
        outputs.append([int(own[-1].argmax())])
        rows.append(own[-8:])
    check, _ = _own_forward_check(m, ps, outputs, rows, args)
    assert check["ok"] is True and check["rounded_forward_mean"] > 0, check
    bad, _ = _own_forward_check(m, ps, outputs, [r + 0.5 * torch.randn(r.shape, generator=g) for r in rows], args)
    assert bad["ok"] is False, bad


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("flip", ["none", "near", "far"])
def test_the_printed_rule_says_what_the_verdict_allows(model_dtype, flip):
    """The verdict and its rule agree: a bfloat16 model's rule states the near-tie exception with its bound and a
    float32 model's states none; whenever tokens differ, the reason lists the reference margins. (A bfloat16 run
    with a flip passed under a rule that read "greedy tokens equal".)"""
    from dtkv.demo._verdict import transformers_check

    kv = "bf16"
    tol = TOLERANCE[(model_dtype, kv)]
    margins = {"none": [], "near": [FLIP_MARGIN * tol * 0.5], "far": [FLIP_MARGIN * tol * 1.5]}[flip]
    c = transformers_check(model_dtype, kv, torch.full((50,), tol / 10), [f"p{i}" for i in range(50)], not margins,
                           margins)  # fmt: skip
    bound = f"{FLIP_MARGIN * tol:.3g}"
    if model_dtype == "bfloat16":
        assert "except at near ties" in c["rule"] and bound in c["rule"]
    else:
        assert "greedy tokens equal (no exception" in c["rule"] and "near ties" not in c["rule"]
    allowed = flip == "none" or (flip == "near" and model_dtype == "bfloat16")
    assert c["ok"] is allowed and c["parity"] is allowed
    assert c["flip_margins"] == margins
    if margins:
        assert f"at reference margins {margins[0]:.2e}" in c["reason"]
        assert ("within the near-tie bound" in c["reason"]) == allowed
    if not c["tokens_equal"] and c["ok"]:  # the only way to pass with a differing token: the stated exception
        assert "except at near ties" in c["rule"]


def test_the_flashmla_rule_names_its_near_tie_bound_and_the_margins():
    from dtkv.demo._verdict import rounded_attention_check

    base = torch.full((10,), 0.06)
    base[2] = 0.6
    c = rounded_attention_check(base, base, [f"p{i}" for i in range(10)], False, [0.5])
    assert c["ok"] and "except at near ties" in c["rule"] and "0.6" in c["rule"]
    assert "at reference margins 5.00e-01 (within 0.6)" in c["reason"] and c["flip_margins"] == [0.5]


def test_a_worst_difference_above_the_tolerance_says_where_it_comes_from():
    """Measured with one process (cp=1): the same worst value at the same position and the sharded logits equal to
    the one-process run's -> the reference's own rounding, not the sharding; otherwise the numbers, no verdict
    change either way; a run that is one process says the comparison is the reference's."""
    from dtkv.demo._verdict import transformers_check

    tol = TOLERANCE[("float32", "bf16")]
    d = torch.full((200,), tol / 10)
    d[37] = 0.1
    labels = [f"request 0 position {i}" for i in range(200)]

    def check(one):
        return transformers_check("float32", "bf16", d, labels, True, [], one_process=one)

    same = check({"worst": 0.1, "where": labels[37], "vs_sharded": 0.0})
    assert same["ok"] and "not the sharding" in same["reason"] and "bitwise equal to that run's" in same["reason"]
    assert same["one_process_where"] == labels[37] and same["sharded_vs_one_process"] == 0.0
    close = check({"worst": 0.1, "where": labels[37], "vs_sharded": tol / 2})
    assert "not the sharding" in close["reason"] and f"within {tol / 2:.1e} of" in close["reason"]
    moved = check({"worst": 0.02, "where": labels[3], "vs_sharded": 0.09})
    assert moved["ok"] and "not the sharding" not in moved["reason"] and "differs from it by up to" in moved["reason"]
    alone = check(None)
    assert "one process (cp=1): the difference is the comparison with the model's own forward" in alone["reason"]
    assert "one process" not in check(False)["reason"]  # not measured (multi-turn)
    within = transformers_check("float32", "bf16", torch.full((9,), tol / 2), labels[:9], True, [],
                                one_process={"worst": 0.0, "where": "", "vs_sharded": 0.0})  # fmt: skip
    assert within["reason"].startswith("within ") and "one process" not in within["reason"]
