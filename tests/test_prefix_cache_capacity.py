"""Capacity of the shared-prefix scenario: a page shared by many requests is counted once (hand arithmetic)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtkv.capacity import capacity, shared_prefix_capacity


def test_shared_pages_count_once_in_the_replicated_and_the_sharded_pools():
    rep = shared_prefix_capacity("deepseek-v32", cp_size=8, tokens=1 << 17, prefix_tokens=8200, suffix_tokens=1000)
    # page 64: the prefix has 128 full pages and 8 tokens; each request recomputes those 8 with its own 1000
    assert (rep.shared_pages, rep.private_pages, rep.pages_per_request) == (128, 16, 144)
    pools = capacity("deepseek-v32", cp_size=8, tokens=1 << 17, max_request_tokens=9200)
    assert rep.pools == pools
    replicated = (1 << 17) // 64  # the budget's pool: 2048 pages
    assert rep.requests_replicated == replicated // 144 == 14
    assert rep.requests_replicated_shared == (replicated - 128) // 16 == 120
    assert rep.requests_sharded == pools.sharded_pages // 144
    assert rep.requests_sharded_shared == (pools.sharded_pages - 128) // 16
    assert rep.multiplier == rep.requests_sharded_shared / 14 > 8 * 8


def test_without_a_shared_prefix_the_cache_changes_nothing_and_a_prefix_too_large_fits_no_request():
    none = shared_prefix_capacity("glm5", cp_size=4, tokens=1 << 15, prefix_tokens=0, suffix_tokens=4096)
    assert none.requests_sharded_shared == none.requests_sharded and none.shared_pages == 0
    huge = shared_prefix_capacity("glm5", cp_size=1, tokens=1 << 12, prefix_tokens=1 << 14, suffix_tokens=64)
    assert huge.requests_replicated == huge.requests_replicated_shared == 0
    with pytest.raises(ValueError, match="suffix_tokens must be >= 1, got suffix_tokens=0"):
        shared_prefix_capacity("glm5", cp_size=2, tokens=4096, prefix_tokens=64, suffix_tokens=0)
    with pytest.raises(ValueError, match="prefix_tokens must be >= 0, got prefix_tokens=-1"):
        shared_prefix_capacity("glm5", cp_size=2, tokens=4096, prefix_tokens=-1, suffix_tokens=1)


def test_cli_shared_prefix_scenario_prints_one_json_object():
    cmd = [sys.executable, "-m", "dtkv.capacity", "--preset", "deepseek-v32", "--cp", "8", "--tokens", "131072"]
    cmd += ["--shared-prefix-tokens", "8200", "--suffix-tokens", "1000", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["requests_replicated"] == 14 and out["shared_pages"] == 128
    assert out["pools"]["cp_size"] == 8 and out["multiplier"] > 64
    text = subprocess.run(cmd[:-1], capture_output=True, text=True, check=True).stdout
    assert "sharded + prefix cache vs replicated without" in text
