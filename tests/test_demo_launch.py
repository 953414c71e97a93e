"""``dtkv.demo._launch.spawn``: a rank that gives no result is named with the reason -- the signal or exit code that
ended it, or the deadline -- so that the other ranks' errors (a peer that left a collective: "Connection reset by
peer") read as the consequence they are. The ranks here are forked, so that they run this file's stand-in for the
demo's rank (no process group)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time

import pytest

from dtkv.demo import _launch

pytestmark = pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="forks its ranks")


def _spawn(monkeypatch, behave, world: int = 2, timeout: float = 60.0) -> list[dict]:
    files = []

    def rank_main(rank, world, args, init_file=None):
        with open(init_file, "a"):  # what the ranks' FileStore creates
            pass
        behave(rank)
        return {"rank": rank, "outputs": []}

    real_mkstemp = _launch.tempfile.mkstemp

    def mkstemp(**kw):
        fd, path = real_mkstemp(**kw)
        files.append(path)
        return fd, path

    monkeypatch.setattr(_launch, "process_context", lambda args: mp.get_context("fork"))
    monkeypatch.setattr(_launch, "_rank_main", rank_main)
    monkeypatch.setattr(_launch, "setup_cli_logging", lambda **kw: None)
    monkeypatch.setattr(_launch.tempfile, "mkstemp", mkstemp)
    got = _launch.spawn({"cp": world, "timeout": timeout, "pd": False})
    assert len(files) == 1 and not os.path.exists(files[0]), "the ranks' store file outlived them"
    return got


def _die_of(sig):
    def behave(rank):
        if rank == 1:
            faulthandler.disable()  # pytest's, inherited: no traceback dump for the signal
            os.kill(os.getpid(), sig)
            time.sleep(30)

    return behave


@pytest.mark.parametrize("sig,name", [(signal.SIGKILL, "SIGKILL"), (signal.SIGSEGV, "SIGSEGV")])
def test_a_rank_killed_by_a_signal_is_named_with_it(monkeypatch, sig, name):
    got = _spawn(monkeypatch, _die_of(sig), world=3)
    assert [g["rank"] for g in got] == [0, 1, 2]
    assert "error" not in got[0] and "error" not in got[2]
    assert got[1]["error"].startswith(f"rank 1 died of {name}")
    assert ("out-of-memory killer" in got[1]["error"]) == (sig == signal.SIGKILL)


def test_a_rank_that_exits_without_reporting_is_named_with_its_exit_code(monkeypatch):
    def behave(rank):
        if rank == 0:
            os._exit(3)

    got = _spawn(monkeypatch, behave)
    assert got[0] == {"rank": 0, "error": got[0]["error"]} and "rank 0 exited with code 3" in got[0]["error"]
    assert "error" not in got[1]


@pytest.mark.slow  # the parent grants the survivors 10 s to finish
def test_a_rank_left_waiting_by_a_dead_one_is_stopped_and_said_so(monkeypatch):
    def behave(rank):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # rank 0: waits for rank 1 (a collective it never joins)

    t0 = time.monotonic()
    got = _spawn(monkeypatch, behave)
    assert time.monotonic() - t0 < 30
    assert got[0]["error"] == "rank 0 was stopped: another rank died without reporting"
    assert got[1]["error"].startswith("rank 1 died of SIGKILL")


@pytest.mark.slow  # the parent grants the ranks 10 s after the deadline
def test_a_rank_past_the_deadline_is_killed_and_said_so(monkeypatch):
    def behave(rank):
        if rank == 1:
            time.sleep(60)

    got = _spawn(monkeypatch, behave, timeout=1.5)
    assert "error" not in got[0]
    assert got[1]["error"] == "rank 1 did not report within 1.5 s (killed)"


def test_the_decode_group_deletes_its_ranks_store_file(tmp_path):
    """``--pd``'s decode group (:class:`dtkv.demo._pd.DecodeGroup`): its ranks' ``FileStore`` file goes once its
    result is in, also when a rank left no answer."""
    import queue

    from dtkv.demo._pd import DecodeGroup

    path = tmp_path / "store"
    path.write_bytes(b"")
    group = DecodeGroup(processes=[], results=queue.Queue(), store=None, rank_args={}, size=1, init_file=str(path))
    assert group.result(timeout_s=0.1) == [{"rank": -1, "error": "the decode group did not answer within 0.1 s"}]
    assert not path.exists()


def _kill_self() -> None:
    faulthandler.disable()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_decode_rank_that_dies_is_named_with_its_signal(tmp_path):
    """:meth:`dtkv.demo._pd.DecodeGroup.result`: a decode rank that died without answering is named with its
    signal (was: "the decode group did not answer within T s", at once)."""
    from dtkv.demo._pd import DecodeGroup

    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_kill_self, daemon=True)
    proc.start()
    group = DecodeGroup(processes=[proc], results=ctx.Queue(), store=None, rank_args={}, size=1)
    t0 = time.monotonic()
    got = group.result(timeout_s=60)
    assert time.monotonic() - t0 < 15
    assert len(got) == 1 and got[0]["rank"] == 0 and got[0]["error"].startswith("rank 0 died of SIGKILL"), got
