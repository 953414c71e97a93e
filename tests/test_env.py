"""``dtkv._env``: what ``import dtkv`` does with each variable's bad values, in a fresh interpreter each (the
variables are read once, at import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SHOW = "import dtkv, logging; from dtkv import _env; print(_env.transfer_timeout_s(), _env.log_level())"


def _import(**env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DTKV_")} | env
    return subprocess.run([sys.executable, "-c", _SHOW], capture_output=True, text=True, env=full, timeout=120)


@pytest.mark.parametrize("raw", ["inf", "+Inf", "infinity", "nan", "0", "-1", "soon"])
def test_a_transfer_timeout_that_is_not_positive_and_finite_is_refused(raw):
    """Every wait of the transfer path must stay bounded: ``inf`` was accepted and unbounded them."""
    out = _import(DTKV_TRANSFER_TIMEOUT_S=raw)
    assert out.returncode != 0
    assert (
        f"DTKV_TRANSFER_TIMEOUT_S must be a positive finite number of seconds, got DTKV_TRANSFER_TIMEOUT_S='{raw}'"
        in (out.stderr)
    ), out.stderr[-2000:]


def test_a_transfer_timeout_in_range_is_taken():
    out = _import(DTKV_TRANSFER_TIMEOUT_S="2.5")
    assert out.returncode == 0 and out.stdout.split() == ["2.5", "None"], out.stderr


@pytest.mark.parametrize("raw", ["LOUD", "verbose", "Level 5"])
def test_an_unknown_log_level_warns_and_counts_as_unset(raw):
    """It made ``import dtkv`` raise; a knob of messages must never stop the library from importing."""
    out = _import(DTKV_LOGLEVEL=raw)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["30.0", "None"]
    assert "RuntimeWarning: DTKV_LOGLEVEL must be a logging level name" in out.stderr and "ignored" in out.stderr


@pytest.mark.parametrize(("raw", "level"), [("warning", "30"), ("10", "10")])
def test_a_log_level_name_or_number_is_taken(raw, level):
    out = _import(DTKV_LOGLEVEL=raw)
    assert out.returncode == 0 and out.stdout.split() == ["30.0", level] and not out.stderr, out.stderr
