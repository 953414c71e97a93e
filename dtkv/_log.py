"""Logging of dtkv's command-line tools, and the per-phase progress lines of the demos and benchmarks.

Library modules only create loggers (``logger = logging.getLogger(__name__)``, all under ``"dtkv"``) and never
add a handler. A command-line tool calls :func:`setup_cli_logging` once at the start of its ``main`` (and a
spawned worker process at the start of its target, with its ``rank``): one handler on the ``dtkv`` logger, on
stderr, so that stdout keeps only the tool's own output (``--json`` objects stay parseable). Its level is
``DTKV_LOGLEVEL`` (read in :mod:`dtkv._env`), else ``INFO``.

Lines look like ``[dtkv r0 09:41:07.123 I] prefill chunk 3/8``: the rank (when one is known: the ``rank``
given to :func:`setup_cli_logging`, else the default process group's rank, else torchrun's ``RANK``), the
time, the level's initial. A process of one side of a prefill/decode run says which (``side=``):
``[dtkv prefill r0 ...]``, ``[dtkv decode r1 ...]``, since both groups number their ranks from 0.

Records that a tool's processes would repeat (:data:`ONCE_PER_PROCESS`: the attention backend each runtime
resolves) reach the handler once per process: every runtime of a demo run resolves its backend again.

Progress: :func:`progress` logs one line at ``INFO`` on the ``dtkv.progress`` logger, by default on rank 0
only; :class:`Progress` counts the steps of a phase (``prefill chunk 3/8``) and :func:`phase` times one::

    from dtkv._log import Progress, phase, progress, setup_cli_logging

    setup_cli_logging()                      # in main(); in a spawned worker: setup_cli_logging(rank=rank)
    with phase("ranks up"):                  # "ranks up ..." then "ranks up: 2.1 s"
        ...
    chunks = Progress("prefill chunk", total=8)
    for _ in range(8):
        ...
        chunks.step()                        # "prefill chunk 1/8 (0.4 s)", ...
    progress("transfer: %d requests sent", 2, all_ranks=True)   # every rank, each line with its rank

``DTKV_LOGLEVEL=WARNING`` silences the progress lines; ``DEBUG`` adds the library's debug records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

from dtkv._env import log_level

__all__ = [
    "LOGGER",
    "ONCE_PER_PROCESS",
    "PROGRESS_LOGGER",
    "Progress",
    "current_rank",
    "phase",
    "progress",
    "setup_cli_logging",
]

LOGGER = "dtkv"
"""The logger every dtkv module logs under (``dtkv.<module>``)."""
PROGRESS_LOGGER = "dtkv.progress"
"""The logger of :func:`progress` lines."""

ONCE_PER_PROCESS: tuple[str, ...] = ("dtkv.attention",)
"""Loggers whose records the CLI handler prints once per process and message (repeats are dropped)."""

_fixed_rank: int | None = None
_side: str | None = None


def current_rank() -> int | None:
    """This process's rank: the one :func:`setup_cli_logging` was given, else the default process group's (when
    one is initialized), else torchrun's ``RANK``, else ``None``. Never imports ``torch``."""
    if _fixed_rank is not None:
        return _fixed_rank
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    raw = os.environ.get("RANK", "")
    return int(raw) if raw.isdigit() else None


def _label() -> str:
    """What a line names its process by: ``dtkv``, ``dtkv r0`` or, with a side, ``dtkv prefill r0``."""
    rank = current_rank()
    parts = ["dtkv"] + ([_side] if _side else []) + ([f"r{rank}"] if rank is not None else [])
    return " ".join(parts)


class _Formatter(logging.Formatter):
    """``[dtkv r0 09:41:07.123 I] message`` (no rank part when the rank is unknown)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        where = _label()
        head = f"[{where} {stamp} {record.levelname[:1]}] "
        text = head + record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _OncePerProcess(logging.Filter):
    """Drops a record of a :data:`ONCE_PER_PROCESS` logger whose message this process already printed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(record.name == n or record.name.startswith(n + ".") for n in ONCE_PER_PROCESS):
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (test harnesses swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_cli_logging(
    *, rank: int | None = None, side: str | None = None, level: int | str | None = None
) -> logging.Handler:
    """Install dtkv's one stderr handler on the ``dtkv`` logger (idempotent); returns it.

    For command-line tools and their worker processes only: library code never calls it.

    Args:
        rank: this process's rank, shown in every line (default: :func:`current_rank` at each line).
        side: the group this process belongs to when there are two (``"prefill"`` or ``"decode"``), shown before
            the rank: ``[dtkv decode r1 ...]`` (default: none).
        level: the ``dtkv`` logger's level (default ``DTKV_LOGLEVEL``, else ``INFO``).
    """
    global _fixed_rank, _side
    if rank is not None:
        _fixed_rank = int(rank)
    if side is not None:
        _side = str(side)
    env = log_level()
    chosen = level if level is not None else (env if env is not None else logging.INFO)
    logger = logging.getLogger(LOGGER)
    logger.setLevel(chosen)
    for h in logger.handlers:
        if isinstance(h, _StderrHandler):
            return h
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    handler.addFilter(_OncePerProcess())
    logger.addHandler(handler)
    return handler


def progress(msg: str, *args: object, all_ranks: bool = False) -> None:
    """One progress line at ``INFO`` (``msg % args``, lazily formatted) on rank 0, or on every rank."""
    if all_ranks or (current_rank() or 0) == 0:
        logging.getLogger(PROGRESS_LOGGER).info(msg, *args)


class Progress:
    """Counts the steps of one phase: ``step()`` logs ``"<what> k/total (seconds since the last step)"``.

    Args:
        what: the phase's steps, e.g. ``"prefill chunk"`` or ``"decode step"``.
        total: the number of steps (``None``: unknown, lines read ``"<what> k"``).
        all_ranks: log on every rank (default: rank 0 only).
    """

    def __init__(self, what: str, total: int | None = None, *, all_ranks: bool = False) -> None:
        self.what, self.total, self.all_ranks = what, total, all_ranks
        self.count = 0
        self._last = time.perf_counter()

    def step(self, detail: str = "") -> None:
        """One step done; ``detail`` is appended to the line."""
        self.count += 1
        now = time.perf_counter()
        of = f"/{self.total}" if self.total is not None else ""
        extra = f", {detail}" if detail else ""
        progress("%s %d%s (%.1f s%s)", self.what, self.count, of, now - self._last, extra, all_ranks=self.all_ranks)
        self._last = now


@contextlib.contextmanager
def phase(what: str, *, all_ranks: bool = False) -> Iterator[None]:
    """Log ``"<what> ..."`` on entry and ``"<what>: <seconds> s"`` on a normal exit (nothing extra on an error:
    the error reports itself)."""
    progress("%s ...", what, all_ranks=all_ranks)
    t0 = time.perf_counter()
    yield
    progress("%s: %.1f s", what, time.perf_counter() - t0, all_ranks=all_ranks)
