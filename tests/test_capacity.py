"""dtkv.capacity: meta-tensor sizing agrees with hand arithmetic and meets the GLM-5 CP8 target."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtkv.capacity import PRESETS, capacity


def test_glm5_cp8_one_million_tokens_multiplier_is_at_least_0_95_cp():
    rep = capacity("glm5", cp=8, tokens=1 << 20)
    # Independent arithmetic: 78 layers x 16384 pages x (64 * 656 + 8448) bytes per page.
    assert rep.kv_bytes_replicated == 78 * 16384 * (64 * 656 + 8448)
    # Scratch: two layers of (view of 8 * M pages + M send pages), M = 16384 / 8 + 8, both layouts.
    m = 16384 // 8 + 8
    assert rep.scratch_bytes_per_rank == 2 * (8 * m + m) * (64 * 656 + 8448)
    assert rep.kv_bytes_per_rank + rep.scratch_bytes_per_rank <= rep.kv_bytes_replicated
    assert rep.capacity_multiplier >= 0.95 * 8
    assert rep.sharded_tokens == rep.sharded_pages * 64


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_multiplier_grows_with_cp_and_never_exceeds_it(cp):
    rep = capacity("dsv32", cp=cp, tokens=1 << 17)
    assert 0 < rep.capacity_multiplier <= cp


def test_rejects_unknown_preset_and_bad_sizes():
    with pytest.raises(ValueError, match="preset must be one of"):
        capacity("llama", cp=8, tokens=1024)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        capacity("glm5", cp=0, tokens=1024)
    assert set(PRESETS) >= {"glm5"}


def test_cli_prints_one_json_object():
    cmd = [sys.executable, "-m", "dtkv.capacity", "--preset", "glm5", "--cp", "8", "--tokens", "1048576", "--json"]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert out["capacity_multiplier"] >= 7.6 and out["cp"] == 8
