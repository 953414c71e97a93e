"""``python -m dtkv.demo``: the default run and its JSON output (the README's main job)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.multirank
def test_default_demo_json_reports_parity_and_one_cpth_bytes():
    out = subprocess.run(
        [sys.executable, "-m", "dtkv.demo", "--json"], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["cp"] == 2 and res["tokens"] == 1536 and res["chunks"] >= 3
    assert res["kv_bytes_per_rank"] * res["cp"] == res["kv_bytes_replicated"]
    assert res["capacity_multiplier"] == pytest.approx(2.0)
    assert res["direct_rows"] > 0 and res["mode"] == "sharded_direct"


def test_demo_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "dtkv.demo", "--cp", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--cp must be >= 1, got 0" in out.stderr


@pytest.mark.multirank
@pytest.mark.mooncake
def test_demo_pd_hands_requests_to_a_decode_process_over_mooncake():
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    cmd = [
        sys.executable,
        "-m",
        "dtkv.demo",
        "--pd",
        "--json",
        "--tokens",
        "600",
        "--chunk",
        "128",
        "--kv-dtype",
        "fp8",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["pd_parity"] is True
    assert res["pd_entries"] >= res["pd_min_entries"] > 0 and res["pd_bytes"] > 0
