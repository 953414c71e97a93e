"""``benchmarks/scripts/runtime_ab.py``: each variant switches off what it names (the rope op's use, the dequantize
op's kernel) and nothing else, and its results name it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtkv.ops
from dtkv.attention import _flashmla
from dtkv.integrations.transformers import attention as hf_attention

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "runtime_ab.py"


def _load():
    spec = importlib.util.spec_from_file_location("runtime_ab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def ab(monkeypatch):
    """The script's module, with what ``apply`` replaces put back after the test."""
    monkeypatch.setattr(hf_attention, "fuses_query_rope", hf_attention.fuses_query_rope)
    monkeypatch.setattr(_flashmla, "_bf16_rows", _flashmla._bf16_rows)
    return _load()


@pytest.mark.parametrize("variant", ["both", "no-rope-op", "no-dequant-op", "neither"])
def test_a_variant_switches_off_what_it_names(ab, monkeypatch, variant):
    rope, rows = hf_attention.fuses_query_rope, _flashmla._bf16_rows
    calls = []

    def spy(kv, layout, **kw):
        calls.append(kw)
        return torch.zeros((2, 3))

    monkeypatch.setattr(dtkv.ops, "dequantize_mla_rows", spy)
    ab.apply(variant)
    assert (hf_attention.fuses_query_rope is rope) == (variant in ("both", "no-dequant-op"))
    if variant in ("no-rope-op", "neither"):
        assert hf_attention.fuses_query_rope(None, None, None, None) is False
    assert (_flashmla._bf16_rows is rows) == (variant in ("both", "no-rope-op"))
    if variant in ("no-dequant-op", "neither"):
        assert _flashmla._bf16_rows(torch.zeros(1), None).shape == (2, 1, 3)
        assert calls == [{"dtype": torch.bfloat16, "backend": "torch"}]


def test_an_unknown_variant_is_refused(ab):
    with pytest.raises(ValueError, match=r"variant must be one of .*got 'fast'"):
        ab.apply("fast")


def test_the_command_needs_an_out_dir():
    out = subprocess.run([sys.executable, str(SCRIPT), "--variant", "both", "--", "--smoke"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "pass bench_runtime.py an --out-dir" in out.stderr


@pytest.mark.slow  # a smoke prefill through the benchmark: about 13 s on 2 cores
def test_the_results_name_their_variant(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--variant", "neither", "--", "--smoke", "--phases", "prefill", "--adapters",
           "transformers", "--prefill", "64x16", "--no-profile", "--no-kernels", "--out-dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (jsonl,) = (tmp_path / "neither").glob("runtime_*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert rows and all(r["variant"] == "neither" and r["ok"] for r in rows)
    (md,) = (tmp_path / "neither").glob("runtime_*.md")
    assert "runtime_ab.py --variant neither` (both one-pass ops off)" in md.read_text()
