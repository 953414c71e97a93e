"""``dtkv._log``: the command-line tools' stderr lines -- the process label (rank, and the side of a PD run) and the
records printed once per process. Each case runs in a fresh interpreter (the label is process state)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _stderr(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stderr.splitlines()


@pytest.mark.parametrize(
    ("setup", "label"),
    [
        ("setup_cli_logging()", "[dtkv "),
        ("setup_cli_logging(rank=3)", "[dtkv r3 "),
        ("setup_cli_logging(rank=0, side='prefill')", "[dtkv prefill r0 "),
        ("setup_cli_logging(rank=1, side='decode')", "[dtkv decode r1 "),
    ],
)
def test_a_line_names_its_process_by_side_and_rank(setup, label):
    """PD prefill and decode ranks both count from 0; the side tells them apart (they shared ``r0`` / ``r1``)."""
    lines = _stderr(
        f"from dtkv._log import progress, setup_cli_logging\n{setup}\nprogress('hello %d', 7, all_ranks=True)"
    )
    assert len(lines) == 1 and lines[0].startswith(label) and lines[0].endswith("I] hello 7"), lines


def test_the_attention_backend_line_is_printed_once_per_process():
    """Every runtime resolves its attention backend and logs the choice; a process prints it once (the plain demo
    printed it 4 times, a PD run 7). Other records, and another backend's line, still print."""
    code = (
        "import logging\n"
        "from dtkv._log import progress, setup_cli_logging\n"
        "setup_cli_logging(rank=0)\n"
        "log = logging.getLogger('dtkv.attention._resolve')\n"
        "for _ in range(3):\n"
        "    log.info('dtkv attention backend: %s (%s)', 'torch', 'asked for')\n"
        "    progress('step')\n"
        "log.info('dtkv attention backend: %s (%s)', 'triton', 'asked for')\n"
    )
    lines = _stderr(code)
    assert sum("attention backend: torch" in ln for ln in lines) == 1, lines
    assert sum("attention backend: triton" in ln for ln in lines) == 1 and sum("] step" in ln for ln in lines) == 3
