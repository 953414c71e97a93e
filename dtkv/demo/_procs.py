"""How the demo starts its rank processes (the prefill ranks of :mod:`dtkv.demo._launch`, the decode ranks of
:mod:`dtkv.demo._pd`): :func:`process_context` is a fork server that imported torch, dtkv's runtime and (for a
transformers model) transformers once, so that each rank forks from it instead of importing them again (seconds of
CPU a rank: about 4 s for a transformers model on a 2-core machine); spawn where the platform has no fork server.
And how the parent ends with them: :func:`drain` reads the results left in the queue, :func:`silent_rank` says why
a rank gave none, :func:`remove_store_file` deletes the ranks' ``FileStore`` file.
"""

from __future__ import annotations

import contextlib
import os
import queue

__all__ = [
    "PRELOAD",
    "PRELOAD_TRANSFORMERS",
    "drain",
    "process_context",
    "rank_threads",
    "remove_store_file",
    "silent_rank",
]

PRELOAD = ("torch", "torch.distributed", "dtkv.runtime", "dtkv.demo._run", "dtkv.demo._pd")
"""What the fork server imports before any rank forks from it (:func:`process_context`)."""
PRELOAD_TRANSFORMERS = ("transformers", "dtkv.integrations.transformers")
"""Imported too where the model is a transformers one (every ``--model`` but ``reference``)."""


def process_context(args: dict):
    """The multiprocessing context that starts the demo's ranks: ``"forkserver"`` preloading :data:`PRELOAD` (and
    :data:`PRELOAD_TRANSFORMERS` for a transformers ``args["model"]``), else ``"spawn"``.

    A rank of either kind runs the same target from a fresh state (no parent memory but the server's imports). The
    server starts at the first rank's start, with the environment this process has then; it is one per process, so
    the first call's preload list is the one it imports (a module it cannot import is skipped, and the rank imports
    it itself).
    """
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    extra = PRELOAD_TRANSFORMERS if args.get("model", "reference") != "reference" else ()
    ctx.set_forkserver_preload([*PRELOAD, *extra])
    return ctx


def rank_threads() -> None:
    """One intra-op thread a rank unless ``OMP_NUM_THREADS`` says otherwise (the ranks share the machine's cores):
    set in the environment and in torch, which a fork server's rank has loaded already (it read the variable then)."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def drain(results, most: int) -> list[dict]:
    """Up to ``most`` results already in the queue ``results`` (no waiting)."""
    out: list[dict] = []
    while len(out) < most:
        try:
            out.append(results.get_nowait())
        except queue.Empty:
            break
    return out


def remove_store_file(path: str) -> None:
    """Delete a ``FileStore``'s file once its ranks are gone: the store deletes it when every rank closes it, which
    a rank that died or was killed never does (a file left in the temporary directory for each such run)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def silent_rank(rank: int, exitcode: int | None, timeout_s: float, late: bool) -> str:
    """Why rank ``rank`` gave no result: ``exitcode`` is its process's (``None``: still running when the parent
    gave up on it and killed it, ``late``: at the deadline ``timeout_s`` after the start, else after another rank
    died; negative:
    the signal that ended it)."""
    import signal

    if exitcode is None:
        if late:
            return f"rank {rank} did not report within {timeout_s:g} s (killed)"
        return f"rank {rank} was stopped: another rank died without reporting"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        cause = " (e.g. the kernel's out-of-memory killer)" if exitcode == -signal.SIGKILL else ""
        return f"rank {rank} died of {name}{cause} without reporting; the other ranks' errors follow from it"
    return f"rank {rank} exited with code {exitcode} without reporting; the other ranks' errors follow from it"
