"""``python -m dtkv.demo``: the default run and its JSON output (the README's main job), torchrun, transformers
models."""

from __future__ import annotations

import json
import os
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
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
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


def _json_objects(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]


def _torchrun(nproc: int, *demo_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "dtkv.demo", *demo_args]  # fmt: skip


@pytest.mark.multirank
def test_torchrun_demo_runs_one_job_on_torchruns_group_and_prints_one_json_object():
    """``torchrun --nproc-per-node 2 -m dtkv.demo --json``: one 2-rank job, exactly one JSON object, from rank 0.

    (Before, every torchrun process started its own 2-rank demo and printed its own object.)"""
    out = subprocess.run(_torchrun(2, "--json"), capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    objs = _json_objects(out.stdout)
    assert len(objs) == 1 and len(out.stdout.strip().splitlines()) == 1, out.stdout
    res = objs[0]
    assert res["cp"] == 2 and res["parity"] is True and res["kv_bytes_per_rank"] * 2 == res["kv_bytes_replicated"]


def test_demo_rejects_arguments_that_do_not_fit_the_run():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}  # as torchrun sets them
    out = subprocess.run(
        [sys.executable, "-m", "dtkv.demo", "--cp", "3"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2 and "--cp must equal torchrun's WORLD_SIZE=2 (or be left out), got --cp 3" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dtkv.demo", "--kv-dtype", "fp32"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--kv-dtype fp32 and --dtype are for --model deepseek-v32|glm5" in out.stderr


@pytest.mark.multirank
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_demo_runs_a_transformers_model_and_reports_parity_with_its_own_forward():
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    cmd = [sys.executable, "-m", "dtkv.demo", "--model", "glm5", "--cp", "3", "--tokens", "200", "--chunk", "64",
           "--kv-dtype", "fp8", "--split", "round_robin", "--page-size", "1", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["parity"] is True and res["tokens_equal"] is True and res["cp"] == 3
    assert res["max_abs_logit_diff"] <= res["tolerance"] == 1e-4 and res["within_tolerance"] == 1.0
    assert (
        res["model"] == "glm5"
        and res["mode"] == "sharded"
        and res["kv_bytes_per_rank"] * 3 == res["kv_bytes_replicated"]
    )


@pytest.mark.multirank
@pytest.mark.mooncake
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_torchrun_demo_of_a_transformers_model_hands_off_to_decode_over_mooncake():
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    args = ("--model", "deepseek-v32", "--tokens", "200", "--chunk", "64", "--pd", "--json")
    out = subprocess.run(_torchrun(2, *args), capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    objs = _json_objects(out.stdout)
    assert len(objs) == 1, out.stdout
    res = objs[0]
    assert res["cp"] == 2 and res["parity"] is True and res["pd_parity"] is True and res["mode"] == "sharded_direct"
    assert res["pd_outputs"] == res["generated"] and res["pd_bytes"] > 0
