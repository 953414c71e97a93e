"""A reusable pool of gloo ranks for multi-rank tests.

``RankGroup(world_size)`` spawns ``world_size`` processes once, each joined to a gloo process group through a
FileStore (no ports, so parallel runs never collide). ``group.run(fn, *args)`` pickles ``fn`` (an importable,
module-level function) to every rank, calls ``fn(rank, world_size, *args)`` and returns the per-rank results,
re-raising the first rank's exception with its remote traceback. A call that outlives ``timeout_s`` kills the
group (the next ``run`` respawns it), so a broken collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankError", "RankGroup"]


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _worker(rank: int, world: int, init_file: str, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(init_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(rank, world, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            text = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            try:
                conn.send(("err", text, e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle must not kill the rank silently
                conn.send(("err", text, RankError(text)))
    dist.destroy_process_group()


def _context():
    """Where ranks start: a fork server that imported torch once (each rank is a fork of it, so a group of four
    starts in a fraction of a second instead of four torch imports), or fresh interpreters where there is none. A
    rank sees the environment the server started with: the first group's (``tests/conftest.py`` sets
    ``TRITON_INTERPRET`` before any)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dtkv"])
    return ctx


class RankGroup:
    """``world_size`` long-lived gloo ranks; see the module docstring."""

    def __init__(self, world_size: int, *, timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._init_file: str | None = None

    def _start(self) -> None:
        ctx = _context()
        fd, init_file = tempfile.mkstemp(prefix="dtkv_store_")
        os.close(fd)
        os.unlink(init_file)
        self._init_file = init_file
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world_size, init_file, child), daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; per-rank results in rank order.

        With ``return_exceptions=True`` a rank's exception object stands in its result instead of raising.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for c in self._conns:
            c.send((fn, args, kwargs))
        results: list[Any] = []
        errors: list[str] = []
        for r, c in enumerate(self._conns):
            if not c.poll(self.timeout_s):
                self.close()
                raise TimeoutError(f"rank {r} did not answer within {self.timeout_s} s running {fn.__name__}")
            try:
                status, *payload = c.recv()
            except EOFError:  # the rank's process died: say how, and what the others said
                self._procs[r].join(timeout=5)
                code = self._procs[r].exitcode
                self.close()
                raise RankError(
                    f"rank {r} died running {fn.__name__} (exit code {code}); before it: {errors}"
                ) from None
            if status == "ok":
                results.append(payload[0])
            else:
                errors.append(payload[0])
                results.append(payload[1])
        if errors and not return_exceptions:
            raise RankError("\n".join(errors))
        return results

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs, self._conns = [], []
        if self._init_file is not None:  # the FileStore's file: a killed rank never deletes it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._init_file)
            self._init_file = None
