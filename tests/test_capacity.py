"""dtkv.capacity and ``dtkv capacity``: sizing agrees with hand arithmetic and meets the GLM-5 CP8 target; the CLI
answers in GiB per rank for a model (a preset or a config.json), cp and context, and usage errors exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtkv.capacity import (
    PRESETS,
    capacity,
    context_capacity,
    geometry_from_config,
)


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


def test_cli_prints_one_json_object():
    cmd = [sys.executable, "-m", "dtkv.capacity", "--preset", "glm5", "--cp", "8", "--tokens", "1048576", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)  # stdout holds the one object
    assert out["capacity_multiplier"] >= 7.6 and out["cp_size"] == 8
    assert "cp" not in out  # one name per quantity (0.1.0 repeated cp_size as cp for one release)


@pytest.mark.parametrize("old", ["--cp-size", "--model dsv32", "--model dsv32-bf16"])
def test_the_0_1_spellings_are_usage_errors(old):
    """0.2 removed ``--cp-size`` (``--cp``) and the preset aliases ``dsv32`` / ``dsv32-bf16`` (``deepseek-v32``,
    ``deepseek-v32-bf16``): each is a usage error now (exit 2, one ``error:`` line)."""
    flag, *value = old.split()
    cmd = [sys.executable, "-m", "dtkv.capacity", flag, *(value or ["4"]), "--tokens", "32768", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == "" and "error:" in run.stderr, run.stderr
    with pytest.raises(ValueError, match="preset must be one of"):
        capacity("dsv32", cp_size=4, tokens=1 << 15)


def test_cli_help_gives_every_default_and_what_context_and_tokens_mean():
    cmd = [sys.executable, "-m", "dtkv.capacity", "--help"]
    text = " ".join(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split())
    valued = [a for a in _cli_parser()._actions if a.option_strings and a.nargs is None and a.dest != "help"]
    assert all("(default: " in a.help for a in valued if a.dest != "json"), [a.dest for a in valued]
    for default in ("(default: glm5)", "(default: 8)", "(default: 1048576)", "(default: the context, or --tokens)",
                    "(default: 4096)", "(default: fp8)", "(default: 64)"):  # fmt: skip
        assert default in text, default
    assert "tokens of KV the group holds" in text and "a per-rank budget" in text and "glm-5" in text


def _cli_parser():
    from dtkv._capacity_cli import parser

    return parser()


def _capacity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtkv.capacity", *args], capture_output=True, text=True, timeout=120)


def test_glm5_cp8_one_million_token_context_in_bytes_per_rank():
    """``--context``: the question asked -- bytes per rank replicated vs sharded, and the view's scratch."""
    rep = context_capacity("glm5", cp_size=8, context_tokens=1 << 20)
    page = 64 * 656 + 8448
    assert rep.replicated_bytes_per_rank == 78 * 16384 * page
    assert rep.sharded_bytes_per_rank == 78 * 2048 * page  # 16384 pages over 8 owners
    m = 16384 // 8 + 8  # the scratch of a 1M-token request, as capacity() charges it
    assert rep.scratch_bytes_per_rank == 2 * (8 * m + m) * page
    assert rep.sharded_total_bytes_per_rank == rep.sharded_bytes_per_rank + rep.scratch_bytes_per_rank
    odd = context_capacity("deepseek-v32", cp_size=3, context_tokens=1000, max_request_tokens=100)
    assert odd.replicated_bytes_per_rank == 61 * 16 * page and odd.sharded_bytes_per_rank == 61 * 6 * page  # 16 = 6+5+5
    assert odd.max_request_tokens == 100 and context_capacity("glm5", cp_size=1, context_tokens=1).cp_size == 1


def test_cli_answers_in_gib_per_rank_with_aligned_columns_and_one_json_name_per_quantity():
    run = _capacity("--model", "glm5", "--cp", "8", "--context", "1048576")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    table = [ln for ln in lines[1:] if ln.startswith("  ") and ln.rstrip()[-1].isdigit()]
    assert len(table) == 4 and len({len(ln) for ln in table}) == 1, table  # the values end in one column
    rep = context_capacity("glm5", cp_size=8, context_tokens=1 << 20)
    for what, value in (("replicated", rep.replicated_bytes_per_rank), ("sharded KV (", rep.sharded_bytes_per_rank),
                        ("view scratch", rep.scratch_bytes_per_rank)):  # fmt: skip
        row = next(ln for ln in table if what in ln)
        assert row.endswith(f"{value / (1 << 30):,.2f}"), row
    out = json.loads(_capacity("--model", "glm5", "--cp", "8", "--context", "1048576", "--json").stdout)
    assert out == rep.to_json() and out["cp_size"] == 8 and "cp" not in out
    assert set(out) == {"model", "num_layers", "page_size", "cp_size", "context_tokens", "max_request_tokens",
                        "replicated_bytes_per_rank", "sharded_bytes_per_rank", "scratch_bytes_per_rank",
                        "sharded_total_bytes_per_rank"}  # fmt: skip
    assert json.loads(_capacity("--json").stdout) == out  # --context 1048576 at cp 8 for glm5 is the default


@pytest.mark.parametrize("typed", ["glm-5", "GLM5", "glm_5", "GLM-5"])
def test_cli_takes_model_names_as_people_type_them(typed):
    out = json.loads(_capacity("--model", typed, "--json").stdout)
    assert out["model"] == "glm5"
    assert json.loads(_capacity("--model", "deepseek-v3.2", "--json").stdout)["model"] == "deepseek-v32"
    assert json.loads(_capacity("--preset", "DeepSeek-V3.2-bf16", "--json").stdout)["model"] == "deepseek-v32-bf16"


def _dsv32_config() -> dict:
    return {"model_type": "deepseek_v32", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "index_head_dim": 128, "vocab_size": 129280}  # fmt: skip


def test_a_config_json_gives_the_presets_geometry(tmp_path):
    """``--config PATH``: a DeepSeek-V3.2 config.json (file or directory) sizes exactly as the preset does, with
    fp8 or bf16 MLA rows; an awkward config gets its own layouts."""
    (tmp_path / "config.json").write_text(json.dumps(_dsv32_config()))
    for path in (tmp_path, tmp_path / "config.json"):
        for kv, preset in (("fp8", "deepseek-v32"), ("bf16", "deepseek-v32-bf16")):
            geo = geometry_from_config(path, kv_dtype=kv)
            assert geo.layouts == PRESETS[preset].layouts and geo.num_layers == 61
            got = context_capacity(geo, cp_size=4, context_tokens=100_000)
            want = context_capacity(preset, cp_size=4, context_tokens=100_000)
            assert got.to_json() | {"model": preset} == want.to_json()
    run = _capacity("--config", str(tmp_path), "--cp", "4", "--context", "100000", "--json")  # fp8 by default
    want = context_capacity("deepseek-v32", cp_size=4, context_tokens=100_000)
    assert run.returncode == 0 and json.loads(run.stdout)["sharded_bytes_per_rank"] == want.sharded_bytes_per_rank
    odd = {**_dsv32_config(), "num_hidden_layers": 3, "kv_lora_rank": 96, "qk_rope_head_dim": 16, "index_head_dim": 32}
    (tmp_path / "config.json").write_text(json.dumps(odd))
    geo = geometry_from_config(tmp_path, page_size=5)
    kv, index = dict(geo.layouts)["kv"], dict(geo.layouts)["index"]
    assert (geo.num_layers, geo.page_size, kv.kv_lora_rank, kv.quant_block, index.head_dim) == (3, 5, 96, 32, 32)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--cp", "0"], "--cp must be >= 1, got --cp 0"),
        (["--tokens", "-5"], "--tokens must be >= 1, got --tokens -5"),
        (["--tokens", "1024", "--max-request-tokens", "0"], "--max-request-tokens must be >= 1"),
        (["--shared-prefix-tokens", "10", "--suffix-tokens", "0"], "--suffix-tokens must be >= 1"),
        (["--suffix-tokens", "0"], "--suffix-tokens must be >= 1"),
        (["--shared-prefix-tokens", "-1"], "--shared-prefix-tokens must be >= 0"),
        (["--context", "0"], "--context must be >= 1"),
        (["--context", "10", "--tokens", "10"], "--context sizes one context; --tokens"),
        (["--model", "llama"], "--model must name one of ['deepseek-v32', 'deepseek-v32-bf16', 'glm5']"),
        (["--kv-dtype", "bf16"], "--kv-dtype and --page-size go with --config"),
        (["--config", "no/such/config.json"], "config must be a readable config.json"),
        (["--config", "x", "--model", "glm5"], "--model and --config both name the model"),
    ],
)
def test_cli_out_of_range_flags_are_one_usage_line_with_exit_code_2(args, names):
    """They printed a traceback and exited 1 (the docs' code for a mismatch)."""
    run = _capacity(*args)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and names in lines[0], run.stderr


def test_cli_refuses_a_config_that_is_not_a_dsa_model(tmp_path):
    for body, why in (('{"model_type": "llama", "num_hidden_layers": 32}', "kv_lora_rank=None"), ("[1]", "a list")):
        (tmp_path / "config.json").write_text(body)
        run = _capacity("--config", str(tmp_path / "config.json"))
        assert run.returncode == 2 and why in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_budget_the_scratch_fills_says_so_instead_of_printing_a_zero_multiplier():
    rep = capacity("glm5", cp_size=8, tokens=64)
    assert rep.sharded_pages == 0 and rep.capacity_multiplier == 0 and rep.scratch_takes_the_budget
    run = _capacity("--tokens", "64", "--cp", "8")
    assert run.returncode == 0 and "the view's scratch takes the whole budget" in run.stdout
    assert "0.000x" not in run.stdout, run.stdout
    assert "takes the whole budget" not in _capacity("--tokens", "1048576").stdout


def test_dtkv_capacity_names_itself_in_its_help():
    run = subprocess.run([sys.executable, "-m", "dtkv", "capacity", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("usage: dtkv capacity ")
    assert "python -m dtkv.capacity" not in run.stdout


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


def test_cp_size_is_the_one_name_of_the_group_size():
    """``capacity(cp_size=...)`` and ``CapacityReport.cp_size``: 0.1's ``cp=`` keyword and ``.cp`` field are gone."""
    rep = capacity("deepseek-v32", cp_size=4, tokens=1 << 15)
    assert rep.cp_size == 4 and not hasattr(rep, "cp")
    with pytest.raises(TypeError, match="cp"):
        capacity("deepseek-v32", cp=4, tokens=1 << 15)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'cp_size'"):
        capacity("deepseek-v32", tokens=1 << 15)


def test_the_usage_page_shows_what_the_command_prints():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    shown = re.search(r"```text\n\$ dtkv capacity (.*?)\n(.*?)```", doc, re.S)
    assert shown, "docs/usage.md shows no dtkv capacity run"
    run = subprocess.run([sys.executable, "-m", "dtkv", "capacity", *shown.group(1).split()], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert run.stdout == shown.group(2)
