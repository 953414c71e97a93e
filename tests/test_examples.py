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
def test_engine_paged_pool_drives_dtkv_from_a_req_to_token_map():
    text = _run("engine_paged_pool.py")
    lines = [ln for ln in text.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2 and all("every view row equal to the computed rows: True" in ln for ln in lines), text
