"""The multi-rank harness itself: a rank's failure reaches the test with its message, whatever the failure."""

from __future__ import annotations

import os

import pytest

from tests._multirank import RankError, RankGroup


class _Unpicklable(RuntimeError):
    """An exception whose pickling fails (it holds a lock), as some library exceptions do."""

    def __init__(self, msg: str) -> None:
        import threading

        super().__init__(msg)
        self.lock = threading.Lock()


def _raise_unpicklable(rank: int, world: int) -> int:
    if rank == 1:
        raise _Unpicklable("the real failure of rank 1")
    return rank


def _die(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def _ok(rank: int, world: int) -> int:
    return rank * 10


@pytest.mark.multirank
def test_an_exception_that_does_not_pickle_still_reaches_the_test_and_the_rank_lives():
    g = RankGroup(2, timeout_s=60)
    try:
        with pytest.raises(RankError, match="the real failure of rank 1"):
            g.run(_raise_unpicklable)
        procs = list(g._procs)
        assert g.run(_ok) == [0, 10] and g._procs == procs  # the same processes: none died
    finally:
        g.close()


@pytest.mark.multirank
def test_a_rank_that_dies_is_named_with_its_exit_code_and_the_group_respawns():
    g = RankGroup(2, timeout_s=60)
    try:
        with pytest.raises(RankError, match=r"rank 1 died running _die \(exit code 7\)"):
            g.run(_die)
        assert g.run(_ok) == [0, 10]
    finally:
        g.close()
