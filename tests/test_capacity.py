"""dtkv.capacity: meta-tensor sizing agrees with hand arithmetic and meets the GLM-5 CP8 target."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtkv.capacity import PRESETS, capacity


def test_glm5_cp8_one_million_tokens_multiplier_is_at_least_0_95_cp():
    rep = capacity("glm5", cp_size=8, tokens=1 << 20)
    # Independent arithmetic: 78 layers x 16384 pages x (64 * 656 + 8448) bytes per page.
    assert rep.kv_bytes_replicated == 78 * 16384 * (64 * 656 + 8448)
    # Scratch: two layers of (view of 8 * M pages + M send pages), M = 16384 / 8 + 8, both layouts.
    m = 16384 // 8 + 8
    assert rep.scratch_bytes_per_rank == 2 * (8 * m + m) * (64 * 656 + 8448)
    assert rep.kv_bytes_per_rank + rep.scratch_bytes_per_rank <= rep.kv_bytes_replicated
    assert rep.capacity_multiplier >= 0.95 * 8
    assert rep.sharded_tokens == rep.sharded_pages * 64


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
def test_multiplier_grows_with_cp_and_never_exceeds_it(cp_size):
    rep = capacity("dsv32", cp_size=cp_size, tokens=1 << 17)
    assert 0 < rep.capacity_multiplier <= cp_size


def test_rejects_unknown_preset_and_bad_sizes():
    with pytest.raises(ValueError, match="preset must be one of"):
        capacity("llama", cp_size=8, tokens=1024)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        capacity("glm5", cp_size=0, tokens=1024)
    assert set(PRESETS) >= {"glm5"}


@pytest.mark.parametrize("flag", ["--cp-size", "--cp"])
def test_cli_prints_one_json_object(flag):
    cmd = [sys.executable, "-m", "dtkv.capacity", "--preset", "glm5", flag, "8", "--tokens", "1048576", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["capacity_multiplier"] >= 7.6 and out["cp_size"] == 8
    assert out["cp"] == 8  # the old key, kept for one release


def test_deprecated_cp_keyword_and_field_warn_and_agree():
    new = capacity("dsv32", cp_size=4, tokens=1 << 15)
    with pytest.warns(DeprecationWarning, match=r"capacity\(cp=\.\.\.\) is deprecated"):
        old = capacity("dsv32", cp=4, tokens=1 << 15)
    assert old == new
    with pytest.warns(DeprecationWarning, match=r"CapacityReport\.cp is deprecated"):
        assert new.cp == 4
    with pytest.raises(TypeError, match="pass cp_size= only"), pytest.warns(DeprecationWarning):
        capacity("dsv32", cp_size=4, cp=2, tokens=1 << 15)
    with pytest.raises(TypeError, match="missing required keyword argument: 'cp_size'"):
        capacity("dsv32", tokens=1 << 15)
