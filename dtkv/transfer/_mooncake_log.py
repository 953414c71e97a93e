"""Mooncake's own log (glog) while a transfer engine starts: quiet unless asked for.

Mooncake 0.3.13 logs through glog and sets glog's threshold from ``MC_LOG_LEVEL`` (``TRACE``, ``INFO``,
``WARNING`` or ``ERROR``; dtkv's default is ``ERROR``) when ``mooncake.engine`` is imported; glog's own
``GLOG_minloglevel`` is overridden by it (measured: no effect). At ``ERROR`` every
``TransferEngine.initialize`` in P2PHANDSHAKE mode still prints, on a successful start::

    WARNING: Logging before InitGoogleLogging() is written to STDERR
    E1201 09:18:27.009780  9570 transfer_metadata.cpp:1098] Local segment descriptor not found

(the engine looks its own segment up before it has registered one). :func:`quiet_start` raises glog's threshold
to FATAL for the duration of that one call and puts it back after, when ``MC_LOG_LEVEL`` is unset or ``ERROR``;
a more verbose ``MC_LOG_LEVEL`` (``WARNING``, ``INFO``, ``TRACE``) is a request for Mooncake's log, and then
nothing is hidden. Outside the start, Mooncake's errors print as before. A failed start is reported by dtkv
with :data:`START_LOG_HINT`.

The threshold is glog's ``FLAGS_minloglevel``, found in the glog library the Mooncake wheel bundles (an already
loaded library, opened with ``RTLD_NOLOAD``); where it cannot be found, :func:`quiet_start` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["START_LOG_HINT", "quiet_start"]

START_LOG_HINT = " (Mooncake's own log of the start was quiet: set MC_LOG_LEVEL=WARNING to see it)"
"""Appended to the error of a failed start whose log :func:`quiet_start` hid."""

_GLOG_FATAL = 3
_MIN_LOG_LEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's `int32 FLAGS_minloglevel` (namespace fLI)
_lock = threading.Lock()


def _wants_mooncake_log() -> bool:
    return os.environ.get("MC_LOG_LEVEL", "ERROR").strip().upper() not in ("", "ERROR")


def _min_log_level() -> ctypes.c_int | None:
    """glog's ``FLAGS_minloglevel`` in the library ``mooncake.engine`` loaded, or ``None``."""
    try:
        import mooncake
    except Exception:  # noqa: BLE001 - no Mooncake, nothing to quiet
        return None
    site = Path(mooncake.__file__).resolve().parent.parent
    for lib in sorted(site.glob("mooncake*.libs/libglog*.so*")):
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(str(lib), mode=os.RTLD_NOLOAD), _MIN_LOG_LEVEL)
        except (OSError, ValueError):
            continue
    return None


@contextlib.contextmanager
def quiet_start() -> Iterator[bool]:
    """Inside the block, glog prints only FATAL lines (see the module docstring); yields whether it quieted."""
    flag = None if _wants_mooncake_log() else _min_log_level()
    if flag is None:
        yield False
        return
    with _lock:
        old = flag.value
        flag.value = max(old, _GLOG_FATAL)
        try:
            yield True
        finally:
            flag.value = old
