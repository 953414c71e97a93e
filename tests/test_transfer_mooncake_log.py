"""Mooncake's benign start-up error line stays quiet unless MC_LOG_LEVEL asks for Mooncake's log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtkv.transfer import mooncake_available

_OK, _WHY = mooncake_available()
pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not _OK, reason=_WHY)]

ROOT = Path(__file__).resolve().parent.parent
_TWO_ENGINES = """
import torch
from dtkv.transfer import MooncakeEngine
a, b = MooncakeEngine(), MooncakeEngine()
x, y = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
a.register([x]); b.register([y])
assert a.write(b.session, [x.data_ptr()], [y.data_ptr()], [64]) == 0 and torch.equal(x, y)
a.close(); b.close()
print("ok")
"""


def _stderr(level: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if level is not None:
        env["MC_LOG_LEVEL"] = level
    out = subprocess.run([sys.executable, "-c", _TWO_ENGINES], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    return out.stderr


@pytest.mark.parametrize("level", [None, "ERROR"])
def test_a_successful_start_prints_no_mooncake_error_line(level):
    err = _stderr(level)
    assert "Local segment descriptor not found" not in err and "InitGoogleLogging" not in err, err


def test_a_verbose_mc_log_level_shows_mooncakes_log_again():
    assert "Local segment descriptor not found" in _stderr("WARNING")
