"""dtkv.capacity: meta-tensor sizing agrees with hand arithmetic and meets the GLM-5 CP8 target."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtkv.capacity import PRESET_ALIASES, PRESETS, capacity, shared_prefix_capacity


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
    rep = capacity("deepseek-v32", cp_size=cp_size, tokens=1 << 17)
    assert 0 < rep.capacity_multiplier <= cp_size


def test_rejects_unknown_preset_and_bad_sizes():
    with pytest.raises(ValueError, match="preset must be one of"):
        capacity("llama", cp_size=8, tokens=1024)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        capacity("glm5", cp_size=0, tokens=1024)
    assert set(PRESETS) >= {"glm5"}


@pytest.mark.parametrize("flag", ["--cp", "--cp-size"])
def test_cli_prints_one_json_object(flag):
    cmd = [sys.executable, "-m", "dtkv.capacity", "--preset", "glm5", flag, "8", "--tokens", "1048576", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)  # stdout holds the one object; warnings go to stderr
    assert out["capacity_multiplier"] >= 7.6 and out["cp_size"] == 8
    assert out["cp"] == 8  # the old key, kept for one release
    assert ("--cp-size is deprecated" in run.stderr) == (flag == "--cp-size")


@pytest.mark.parametrize("old", sorted(PRESET_ALIASES))
def test_old_preset_names_warn_and_give_the_new_names_reports(old):
    new = PRESET_ALIASES[old]
    with pytest.warns(DeprecationWarning, match=rf"preset '{old}' is deprecated.*use preset '{new}'"):
        rep = capacity(old, cp_size=4, tokens=1 << 15)
    assert rep == capacity(new, cp_size=4, tokens=1 << 15) and rep.preset == new
    with pytest.warns(DeprecationWarning):
        shared = shared_prefix_capacity(old, cp_size=4, tokens=1 << 15, prefix_tokens=100, suffix_tokens=10)
    assert shared == shared_prefix_capacity(new, cp_size=4, tokens=1 << 15, prefix_tokens=100, suffix_tokens=10)
    cmd = [sys.executable, "-m", "dtkv.capacity", "--preset", old, "--cp", "4", "--tokens", "32768", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert json.loads(run.stdout)["preset"] == new and f"--preset {old} is deprecated" in run.stderr


def test_cli_help_gives_every_default_and_what_tokens_means():
    cmd = [sys.executable, "-m", "dtkv.capacity", "--help"]
    text = " ".join(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split())
    for default in ("default glm5", "default 8", "default 1048576", "default: --tokens", "default 4096"):
        assert default in text, default
    assert "per-rank KV budget, in tokens" in text and "not a context length" in text


def test_capacity_imports_no_kernels_triton_or_materializer():
    """``python -m dtkv.capacity`` is arithmetic: the ops (and Triton), the materializer and the transfer
    package stay unimported (they cost seconds of import time)."""
    code = (
        "import sys, runpy; sys.argv = ['dtkv.capacity', '--json']; "
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: runpy.run_module('dtkv.capacity', run_name='__main__')\n"
        "    except SystemExit: pass\n"
        "heavy = ('triton', 'dtkv.ops', 'dtkv.materialize', 'dtkv.transfer', 'dtkv.model')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_deprecated_cp_keyword_and_field_warn_and_agree():
    new = capacity("deepseek-v32", cp_size=4, tokens=1 << 15)
    with pytest.warns(DeprecationWarning, match=r"capacity\(cp=\.\.\.\) is deprecated"):
        old = capacity("deepseek-v32", cp=4, tokens=1 << 15)
    assert old == new
    with pytest.warns(DeprecationWarning, match=r"CapacityReport\.cp is deprecated"):
        assert new.cp == 4
    with pytest.raises(TypeError, match="pass cp_size= only"), pytest.warns(DeprecationWarning):
        capacity("deepseek-v32", cp_size=4, cp=2, tokens=1 << 15)
    with pytest.raises(TypeError, match="missing required keyword argument: 'cp_size'"):
        capacity("deepseek-v32", tokens=1 << 15)
