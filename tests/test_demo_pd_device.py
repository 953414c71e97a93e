"""``--pd`` on the device the run has, and never a silent wait on a decode group that is gone.

- ``--decode-device`` (auto, cpu, cuda): where the decode group runs, checked before any rank starts (a GPU-only
  attention backend in CPU decode processes, ``--decode-cp M`` on fewer than M GPUs: one usage line, exit 2);
- a decode rank that fails logs it at once, and the parent stops the prefill ranks waiting on it and names the
  failure: before, the prefill ranks waited for decode's post until ``--timeout`` and the run said only "only 0
  of 2 ranks reported within T s" (the issue's "waits until --timeout, nothing logged");
- a rank's hand-off waits end before the parent gives it up, so that its own error is what gets reported.

The hand-off of CUDA pools itself (through pinned host memory on Mooncake's non-cuda wheel) runs on a GPU in
``tests/test_gpu_matrix.py``; its CPU emulation is ``tests/test_transfer_handoff.py``.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import textwrap
import time

import pytest
import torch


def _demo(*args: str, timeout: int = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtkv.demo", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, **kw)  # fmt: skip


def _args(*argv: str) -> dict:
    from dtkv.demo._args import parse

    args, error = parse(list(argv))
    assert error is None, error
    return args


@pytest.mark.parametrize(
    ("device", "gpus", "decode_cp", "want"),
    [("cuda", 1, 1, "cuda"), ("cuda", 1, 2, "cpu"), ("cuda", 2, 2, "cuda"), ("cpu", 2, 1, "cpu")],
)
def test_auto_decodes_on_the_gpus_when_there_is_one_per_decode_rank(monkeypatch, device, gpus, decode_cp, want):
    from dtkv.demo._cli import _decode_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = {**_args("--pd", "--decode-cp", str(decode_cp)), "device": device}
    assert _decode_device(args) == want
    assert _decode_device({**args, "decode_device": "cpu"}) == "cpu"


def test_the_decode_device_is_checked_before_any_rank_starts(monkeypatch):
    from dtkv.demo._cli import _device_error

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = {**_args("--pd", "--decode-cp", "2", "--decode-device", "cuda"), "device": "cpu"}
    assert _device_error(args, 1) == (
        "--decode-device cuda puts each decode rank on a GPU of its own (NCCL): --decode-cp 2 needs 2 visible "
        "GPU(s), got 1"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = {**_args("--pd", "--decode-device", "cuda"), "device": "cpu"}
    assert _device_error(args, 1).startswith("--decode-device cuda needs a CUDA device")
    args = {**_args("--pd", "--attention", "flashmla"), "device": "cpu", "decode_device": "cpu"}
    assert "--attention flashmla is not available" in _device_error(args, 1)


def test_decode_device_without_pd_is_a_usage_error():
    out = _demo("--decode-device", "cpu")
    assert out.returncode == 2 and "--decode-device is where --pd's decode group runs: add --pd" in out.stderr


def test_a_ranks_transfer_waits_end_before_the_parent_gives_it_up():
    from dtkv.demo._pd import transfer_timeout

    assert transfer_timeout({"timeout": 40.0}) == 40.0  # torchrun: no parent deadline
    left = transfer_timeout({"timeout": 40.0, "deadline_unix": time.time() + 20.0})
    assert 14.0 < left <= 15.0  # 20 s left, 5 s kept to report
    assert transfer_timeout({"timeout": 40.0, "deadline_unix": time.time() - 3.0}) == 1.0


class _Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False


def test_the_decode_groups_failure_is_seen_without_blocking():
    from dtkv.demo._pd import DecodeGroup

    results: queue.Queue = queue.Queue()
    group = DecodeGroup(processes=[_Proc(None), _Proc(None)], results=results, store=None, rank_args={}, size=2)
    assert group.failure() is None
    results.put({"rank": 1, "outputs": []})
    assert group.failure() is None and len(group.answers) == 1
    group.processes[0].exitcode = -9  # killed without answering
    assert group.failure() == "decode rank 0 exited with code -9"
    results.put({"rank": 0, "error": "RuntimeError: boom"})
    assert group.failure() == "decode rank 0: RuntimeError: boom"
    assert [g["rank"] for g in group.result(timeout_s=0.1)] == [0, 1]  # the answers drained are kept


def test_a_failing_decode_rank_logs_at_once(monkeypatch, caplog):
    from dtkv.demo import _pd

    def boom(*a, **k):
        raise RuntimeError("no decode here")

    monkeypatch.setattr(_pd, "_decode_rank", boom)
    monkeypatch.setattr(_pd, "setup_cli_logging", lambda **k: None)
    out: queue.Queue = queue.Queue()
    with caplog.at_level(logging.ERROR, logger="dtkv.demo"):
        _pd._worker(0, 1, {"timeout": 5.0}, [[1, 2]], 0, "ns", "/nonexistent", out)
    assert out.get_nowait() == {"rank": 0, "error": "RuntimeError: no decode here"}
    assert [r.getMessage() for r in caplog.records] == ["decode rank 0 failed: RuntimeError: no decode here"]


_DRIVER = """
import sys
import dtkv.demo._pd as pd


def _cannot_start(*args, **kwargs):  # also in the spawned decode process, which imports this file as __mp_main__
    raise RuntimeError("injected: this decode rank cannot start")


pd._decode_rank = _cannot_start
if __name__ == "__main__":
    from dtkv.demo._cli import main

    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.multirank
@pytest.mark.mooncake
@pytest.mark.slow  # three processes start torch: ~50 s on 2 cores
def test_a_failed_decode_group_stops_the_prefill_ranks_and_says_why(tmp_path):
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine (non-cuda wheel + libibverbs1)")
    driver = tmp_path / "demo_driver.py"
    driver.write_text(textwrap.dedent(_DRIVER))
    timeout = 240
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(driver), "--pd", "--json", "--tokens", "200", "--chunk", "64",
                          "--timeout", str(timeout)], capture_output=True, text=True, timeout=timeout + 120,
                         check=False, cwd=tmp_path)  # fmt: skip
    elapsed = time.monotonic() - t0
    assert out.returncode == 1, out.stderr[-3000:]
    assert "decode rank 0 failed: RuntimeError: injected: this decode rank cannot start" in out.stderr
    assert "the decode group failed, so the prefill ranks were stopped" in out.stdout, out.stdout
    assert "ranks reported within" not in out.stdout + out.stderr
    assert elapsed < timeout, f"the run waited {elapsed:.0f} s for a decode group that was gone"
