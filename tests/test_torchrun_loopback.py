"""``tests/_torchrun.py``: a torchrun job launched by a test rendezvouses on loopback only (``MASTER_ADDR`` is
127.0.0.1, gloo binds ``lo``), whatever this machine's hostname resolves to; before, ``MASTER_ADDR`` was the
host's FQDN and the torchrun demo test hung in gloo's rendezvous for 300 s on a GPU machine without a network."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests._failure import failure_text
from tests._torchrun import loopback_env, torchrun

_WORKER = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
line = f"rank {dist.get_rank()} master {os.environ['MASTER_ADDR']} gloo {os.environ['GLOO_SOCKET_IFNAME']} sum {int(t)}"
os.write(1, (line + "\\n").encode())  # one write: print's text and newline are two, and the ranks share the pipe
dist.destroy_process_group()
"""


@pytest.mark.multirank
def test_a_torchrun_job_of_a_test_rendezvouses_on_loopback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run(torchrun(2, str(script)), capture_output=True, text=True, timeout=180, check=False,
                         env=loopback_env(env))  # fmt: skip
    assert out.returncode == 0, failure_text(out)
    # the ranks share one stdout pipe: read the lines by pattern, so two lines that met mid-line still count
    lines = sorted(re.findall(r"rank \d+ master \S+ gloo \S+ sum \d+", out.stdout))
    assert lines == ["rank 0 master 127.0.0.1 gloo lo sum 2", "rank 1 master 127.0.0.1 gloo lo sum 2"], out.stdout


def test_loopback_env_keeps_an_interface_the_caller_named():
    assert loopback_env({"GLOO_SOCKET_IFNAME": "eth1"})["GLOO_SOCKET_IFNAME"] == "eth1"
    assert loopback_env({})["GLOO_SOCKET_IFNAME"] == "lo"
