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
    assert set(res["checks"]) == {"prefill", "decode"} and all(c["ok"] and c["rule"] for c in res["checks"].values())
    rows = res["prefill_rows"]  # the prompt's rows add up; progress lines on stderr, stdout the one JSON object
    assert rows["direct"] + rows["handed_off"] + rows["all_gathered"] == rows["tokens"] == 1536
    assert len(out.stdout.strip().splitlines()) == 1 and "[dtkv" in out.stderr


def test_demo_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "dtkv.demo", "--cp", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--cp must be >= 1, got 0" in out.stderr


@pytest.mark.multirank
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_demo_pd_hands_requests_to_a_decode_process(transfer_engine):
    """``--pd``, once per ``--transfer-engine`` (the fixture skips an engine that is not installed)."""
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
        "--transfer-engine",
        transfer_engine,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout  # no engine log line on stdout
    res = json.loads(out.stdout)
    assert res["parity"] is True and res["pd_parity"] is True and res["pd_engine"] == transfer_engine
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
    assert out.returncode == 2 and "--kv-dtype fp32 and --dtype are for transformers models" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dtkv.demo", "--decode-cp", "3"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--decode-cp is the size of --pd's decode group: add --pd" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dtkv.demo", "--model", "no/such/dir"], capture_output=True, text=True, timeout=60
    )
    assert (
        out.returncode == 2
        and "--model must be one of ['reference', 'deepseek-v32', 'glm5'] or a checkpoint" in out.stderr
    )


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
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_torchrun_demo_of_a_transformers_model_hands_off_to_decode(transfer_engine):
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    args = ("--model", "deepseek-v32", "--tokens", "200", "--chunk", "64", "--pd", "--decode-cp", "3", "--decode",
            "sharded", "--json", "--transfer-engine", transfer_engine)  # fmt: skip
    out = subprocess.run(_torchrun(2, *args), capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    objs = _json_objects(out.stdout)
    assert len(objs) == 1, out.stdout
    res = objs[0]
    assert res["cp"] == 2 and res["parity"] is True and res["pd_parity"] is True and res["mode"] == "sharded_direct"
    assert res["pd_outputs"] == res["generated"] and res["pd_bytes"] > 0 and res["decode_cp"] == 3
    assert res["pd_engine"] == transfer_engine


@pytest.mark.multirank
@pytest.mark.slow  # > 10 s on 2 cores: outside the quick subset (-m 'not slow')
def test_torchrun_demo_of_a_transformers_model_with_the_prefix_cache_and_sharded_decode():
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    args = ("--model", "glm5", "--multi-turn", "--decode", "sharded", "--turns", "2", "--shared-requests", "2",
            "--tokens", "96", "--chunk", "32", "--page-size", "4", "--json")  # fmt: skip
    out = subprocess.run(_torchrun(3, *args), capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    objs = _json_objects(out.stdout)
    assert len(objs) == 1, out.stdout
    res = objs[0]
    assert res["cp"] == 3 and res["parity"] is True and set(res["checks"]) == {"prefix_cache", "prefill_decode"}
    assert res["prefix_hit_rate"] > 0.4 and res["decode"] == "sharded"


def test_demo_package_modules_import_no_circle():
    """Each ``dtkv/demo`` module imports (at any depth of its code) only demo modules that do not import it back."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "dtkv" / "demo"
    deps = {}
    for f in root.glob("*.py"):
        name = "dtkv.demo" if f.stem == "__init__" else f"dtkv.demo.{f.stem}"
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dtkv.demo"):
                found |= {node.module} if node.module != "dtkv.demo" else {f"dtkv.demo.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("dtkv.demo")}
        deps[name] = {d for d in found if d != name}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 1:
            raise AssertionError(f"import circle: {' -> '.join(path + [m])}")
        if state.get(m) == 2 or m not in deps:
            return
        state[m] = 1
        for d in sorted(deps[m]):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(deps):
        visit(m, [])
    assert {"dtkv.demo._cli", "dtkv.demo._run", "dtkv.demo._pd", "dtkv.demo._verdict"} <= deps.keys()


def test_demo_help_names_every_default_and_unit():
    import argparse

    from dtkv.demo._args import parser

    valued = [a for a in parser()._actions if a.option_strings and not isinstance(a, argparse._StoreTrueAction)]
    valued = [a for a in valued if not isinstance(a, argparse._HelpAction)]
    assert len(valued) == 20
    for a in valued:
        assert "(default: " in a.help, a.option_strings
    out = subprocess.run([sys.executable, "-m", "dtkv.demo", "--help"], capture_output=True, text=True, timeout=60)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0 and "tokens per KV page (default: 16)" in text and "(default: 300 s)" in text


@pytest.mark.multirank
def test_demo_table_rows_add_up_and_progress_goes_to_stderr():
    """``--tokens 256 --chunk 64``: the prompt rows are direct + handed off + all-gathered = 256 (decode's rows on
    their own line), the scratch row sits under the capacity multiplier, every verdict prints its rule; progress
    lines go to stderr."""
    cmd = [sys.executable, "-m", "dtkv.demo", "--tokens", "256", "--chunk", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    row = next(ln for ln in lines if "prefill KV rows" in ln)
    nums = [int(t) for t in row.replace("=", " ").split() if t.isdigit()]
    assert nums[0] + nums[1] + nums[2] == nums[3] == 256, row
    i = next(k for k, ln in enumerate(lines) if "capacity multiplier" in ln)
    assert "view scratch" in lines[i + 1], lines[i : i + 2]
    assert sum("  rule " in ln for ln in lines) == 2 and any("parity: prefill" in ln for ln in lines)
    assert "prefill chunk 1/3" in out.stderr and "decode step 4/4" in out.stderr  # 171 + 85 tokens, 64 a chunk
    # (the JSON's rows and the clean stdout of --json: test_default_demo_json_reports_parity_and_one_cpth_bytes)


@pytest.mark.multirank
def test_demo_loads_a_checkpoint_directory(tmp_path):
    """``--model PATH``: a checkpoint ``save_pretrained`` wrote loads through the transformers loader and reports
    parity with its own forward, here with sharded decode over fp8 pages (``dtkv.decode.DecodeStep`` layers)."""
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    from dtkv.integrations.transformers import tiny_model

    tiny_model("glm5", seed=3).save_pretrained(tmp_path / "ckpt")
    cmd = [sys.executable, "-m", "dtkv.demo", "--json", "--model", str(tmp_path / "ckpt"), "--tokens", "96",
           "--chunk", "32", "--decode", "sharded", "--kv-dtype", "fp8"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["parity"] is True and res["model"] == str(tmp_path / "ckpt") and res["model_dtype"] == "float32"
    assert (
        res["decode"] == "sharded"
        and res["decode_comm_bytes_per_step"] > 0
        and set(res["checks"]) == {"prefill_decode"}
    )
    assert res["decode_rows"]["owner_kept"] == res["decode_rows"]["tokens"] > 0


MUST_SHOW = {
    "glm5-multi-turn-cp3": ["--model", "glm5", "--multi-turn", "--cp", "3"],
    "deepseek-v32-sharded-decode-cp3-fp8": ["--model", "deepseek-v32", "--decode", "sharded", "--cp", "3",
                                           "--kv-dtype", "fp8"],
    "glm5-pd-cp2-to-decode-cp3-sharded": ["--model", "glm5", "--pd", "--cp", "2", "--decode-cp", "3", "--decode",
                                         "sharded"],
}  # fmt: skip


@pytest.mark.multirank
@pytest.mark.slow  # the demo's default sizes (1536 tokens): 15-70 s each on 2 cores
@pytest.mark.skipif(os.environ.get("DTKV_TEST_LONG", "0") != "1", reason="set DTKV_TEST_LONG=1 (smaller runs below)")
@pytest.mark.parametrize("name", sorted(MUST_SHOW))
def test_demo_default_sizes_of_the_transformers_modes(name):
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    if "pd" in name:
        pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    out = subprocess.run([sys.executable, "-m", "dtkv.demo", "--json", *MUST_SHOW[name]], capture_output=True,
                         text=True, timeout=900, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["parity"] is True, res["checks"]
    if "multi-turn" in name:
        assert res["prefix_hit_rate"] > 0.5 and res["checks"]["prefix_cache"]["reason"] == "bitwise equal"
    if "sharded" in name and "pd" not in name:
        assert res["decode"] == "sharded" and res["decode_comm_bytes_per_step"] > 0
    if "pd" in name:
        assert res["pd_parity"] and res["decode_cp"] == 3 and res["pd_decode_mode"] == "sharded"
        assert res["pd_kv_bytes_per_decode_rank"] * 3 == res["pd_kv_bytes_replicated"]
        assert res["checks"]["pd"]["ok"] and res["pd_outputs"] == res["generated"]


@pytest.mark.multirank
def test_demo_pd_into_a_sharded_decode_group_of_another_size(transfer_engine):
    """``--pd --cp 2 --decode-cp 3 --decode sharded``, reference model: the decode owners hold the prefill's bytes
    and the decode group's tokens are the prefill group's."""
    cmd = [sys.executable, "-m", "dtkv.demo", "--json", "--pd", "--decode-cp", "3", "--decode", "sharded",
           "--tokens", "200", "--chunk", "64", "--kv-dtype", "fp8", "--transfer-engine", transfer_engine]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["parity"] is True and res["pd_parity"] is True and set(res["checks"]) == {"prefill", "decode", "pd"}
    assert (
        res["pd_outputs"] == res["generated"]
        and res["pd_kv_bytes_per_decode_rank"] * 3 == res["pd_kv_bytes_replicated"]
        and res["pd_engine"] == transfer_engine
    )
