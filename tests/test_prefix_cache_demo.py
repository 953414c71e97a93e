"""``python -m dtkv.demo --multi-turn``: the conversation and shared-prompt requests with and without the prefix
cache, on 2 gloo ranks: parity, hit rate and tokens saved in the JSON object."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._failure import failure_text


@pytest.mark.multirank
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_multi_turn_demo_json_reports_parity_hit_rate_and_tokens_saved():
    cmd = [sys.executable, "-m", "dtkv.demo", "--multi-turn", "--json", "--tokens", "96", "--chunk", "32"]
    cmd += ["--page-size", "4", "--turns", "3", "--shared-requests", "2", "--kv-dtype", "fp8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, failure_text(out)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["tokens_equal"] and res["logits_equal"] and res["kv_equal"]
    assert res["requests"] == 5 and res["cp"] == 2 and res["mode"] == "sharded_direct"
    assert 0.5 < res["prefix_hit_rate"] < 1
    assert res["prefill_tokens_saved"] == res["prefill_tokens_no_cache"] - res["prefill_tokens"] > 0
    assert res["shared_pages_distinct"] < res["shared_pages_referenced"] == res["shared_pages_no_cache"]


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--pd"], "--multi-turn and --pd are separate runs"),
        (["--turns", "0"], "--turns must be >= 1, got 0"),
    ],
)
def test_multi_turn_demo_rejects_bad_arguments(extra, msg):
    cmd = [sys.executable, "-m", "dtkv.demo", "--multi-turn", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and msg in out.stderr


@pytest.mark.multirank
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_multi_turn_demo_with_sharded_decode_and_an_evicting_pool():
    """``--multi-turn --decode sharded --pool-pages``: the cache evicts, tokens and KV bytes stay bitwise, logits
    within 1e-9 relative (the cache moves pages, so the sharded merge sums in another order)."""
    cmd = [sys.executable, "-m", "dtkv.demo", "--multi-turn", "--json", "--tokens", "96", "--chunk", "32"]
    cmd += ["--page-size", "4", "--turns", "3", "--shared-requests", "3", "--decode", "sharded", "--pool-pages", "20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, failure_text(out)
    res = json.loads(out.stdout)
    assert res["parity"] is True and res["evicted_pages"] > 0 and res["decode"] == "sharded"
    assert res["tokens_equal"] and res["kv_equal"] and set(res["checks"]) == {"prefix_cache", "prefill_decode"}
    assert res["checks"]["prefix_cache"]["worst"] <= 1e-9 * 100  # absolute worst of float64 logits of scale ~10
