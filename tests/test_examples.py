"""The scripts in examples/ run as a user runs them (``python examples/<name>.py``) and check what they print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("cp,page_size", [(2, 4), (3, 1)])
def test_multi_rank_flow_views_hold_every_computed_row(cp, page_size):
    text = _run("multi_rank_flow.py", "--cp", str(cp), "--page-size", str(page_size))
    lines = [ln for ln in text.splitlines() if ln.startswith("rank ")]
    assert len(lines) == cp and all("equal to the computed rows: True" in ln for ln in lines), text
    assert all(f"stores {1 / cp:.2f}" in ln or f"stores {1 / cp + 0.01:.2f}" in ln for ln in lines), text


@pytest.mark.multirank
@pytest.mark.parametrize(("cp", "page_size"), [(2, 4), (2, 1), (3, 5)])
def test_engine_paged_pool_runs_the_main_path_from_a_req_to_token_map(cp, page_size):
    """fp8 layouts, compute-owner pages and direct writes, one Materializer replanned per batch with nothing
    allocated after start-up, every fp8 view row equal to the row computed for it. Page size 1 makes every split
    page-aligned (nothing handed off); 5 with 3 ranks leaves chunks starting mid-page (rows handed off)."""
    text = _run("engine_paged_pool.py", "--cp", str(cp), "--page-size", str(page_size))
    lines = [ln for ln in text.splitlines() if ln.startswith("rank ")]
    assert len(lines) == cp and all("fp8 views equal to the computed rows: True" in ln for ln in lines), text
    assert all("one Materializer replanned" in ln and ", 0 allocated since start-up" in ln for ln in lines), text
    handed = [int(ln.split(" handed off")[0].rsplit(" ", 1)[-1]) for ln in lines]
    assert (sum(handed) == 0) == (page_size == 1), text


def test_engine_backend_skeletons_run_an_extend_batch():
    """The sglang backend and vLLM builder skeletons of docs/engines.md, driven with stand-ins for the engines'
    batch objects: the kernel sees every key row as the layer wrote it, and both engines' maps give the same rows."""
    text = _run("engine_backends.py")
    assert "view rows equal to the written rows: True" in text, text
