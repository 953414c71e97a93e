"""Every ``DTKV_*`` environment variable, read in this one place.

| variable | values | default | effect |
| --- | --- | --- | --- |
| ``DTKV_DEBUG`` | 0/1 | 0 | synchronizing ownership checks in writes and materialization |
| ``DTKV_BACKEND`` | auto/torch/triton | auto | default op backend (``auto``: Triton on CUDA, else torch) |
| ``DTKV_LOGLEVEL`` | a ``logging`` level name or number | unset | level of the ``dtkv`` logger (see below) |
| ``DTKV_TRANSFER_TIMEOUT_S`` | positive finite seconds | 30 | bound on every wait of the Mooncake transfer path |
| ``DTKV_TRANSFER_SECRET`` | a string | unset | shared key: rendezvous-store values are HMAC-SHA256 signed and checked |

Variables are read once, at import. A value that breaks its rule raises ``ValueError`` naming the variable
(``DTKV_TRANSFER_TIMEOUT_S=inf`` too: every wait stays bounded), except ``DTKV_LOGLEVEL``, which only tunes
messages: an unknown level warns (``RuntimeWarning``) and counts as unset, so ``import dtkv`` never fails on it.
Tests flip switches through the context managers below (:func:`debug_mode`, :func:`default_backend`), never by
editing ``os.environ``.

Logging: dtkv configures no logging of its own accord. Only an explicit ``DTKV_LOGLEVEL`` sets the level of
the ``dtkv`` logger (at import; no handler is added: the program's handlers, or Python's default one for
warnings and errors, print the records). dtkv's command-line tools call :func:`dtkv._log.setup_cli_logging`,
which adds one stderr handler and uses ``DTKV_LOGLEVEL`` or, unset, ``INFO`` (their per-phase progress lines).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Iterator
from typing import Literal, TypedDict

__all__ = [
    "Backend",
    "debug_enabled",
    "debug_mode",
    "default_backend",
    "get_backend",
    "log_level",
    "transfer_secret",
    "transfer_timeout_s",
]

Backend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


def _read_bool(name: str) -> bool:
    raw = os.environ.get(name, "0").strip().lower()
    if raw in ("", "0", "false", "off", "no"):
        return False
    if raw in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{name} must be one of 0/1/true/false/on/off/yes/no, got {name}={raw!r}")


def _read_backend() -> Backend:
    raw = os.environ.get("DTKV_BACKEND", "auto").strip().lower() or "auto"
    if raw not in _BACKENDS:
        raise ValueError(f"DTKV_BACKEND must be one of {_BACKENDS}, got DTKV_BACKEND={raw!r}")
    return raw  # type: ignore[return-value]


def _read_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {name}={raw!r}") from None
    if not (value > 0 and math.isfinite(value)):  # inf would unbound every wait; nan compares false
        raise ValueError(f"{name} must be a positive finite number of seconds, got {name}={raw!r}")
    return value


def _read_level(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw.lstrip("-").isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())  # the number of a level name, or "Level X" for an unknown one
    if not isinstance(level, int):
        names = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        warnings.warn(
            f"{name} must be a logging level name {names} or a number, got {name}={raw!r}; ignored (as if unset)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return level


class _State(TypedDict):
    debug: bool
    backend: Backend
    transfer_timeout_s: float
    transfer_secret: bytes | None
    log_level: int | None


_state: _State = {
    "debug": _read_bool("DTKV_DEBUG"),
    "backend": _read_backend(),
    "transfer_timeout_s": _read_float("DTKV_TRANSFER_TIMEOUT_S", 30.0),
    "transfer_secret": os.environ.get("DTKV_TRANSFER_SECRET", "").encode() or None,
    "log_level": _read_level("DTKV_LOGLEVEL"),
}

if _state["log_level"] is not None:  # the user asked for this level; unset, the logger is left alone
    logging.getLogger("dtkv").setLevel(_state["log_level"])


def debug_enabled() -> bool:
    """True when ``DTKV_DEBUG=1`` (or inside :func:`debug_mode`): ops run synchronizing checks."""
    return _state["debug"]


def get_backend() -> Backend:
    """The process-wide default backend (``DTKV_BACKEND``, or :func:`default_backend`)."""
    return _state["backend"]


def transfer_timeout_s() -> float:
    """Bound in seconds on every wait of the transfer path (``DTKV_TRANSFER_TIMEOUT_S``)."""
    return _state["transfer_timeout_s"]


def log_level() -> int | None:
    """The ``logging`` level ``DTKV_LOGLEVEL`` names (``None`` when unset): what
    :func:`dtkv._log.setup_cli_logging` gives the ``dtkv`` logger."""
    return _state["log_level"]


def transfer_secret() -> bytes | None:
    """The shared secret authenticating rendezvous-store values (``DTKV_TRANSFER_SECRET``; ``None`` when unset)."""
    return _state["transfer_secret"]


@contextlib.contextmanager
def debug_mode(enabled: bool = True) -> Iterator[None]:
    """Turn the synchronizing debug checks on (or off) inside a ``with`` block."""
    old = _state["debug"]
    _state["debug"] = bool(enabled)
    try:
        yield
    finally:
        _state["debug"] = old


@contextlib.contextmanager
def default_backend(backend: Backend) -> Iterator[None]:
    """Set the default backend of every op inside a ``with`` block."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got backend={backend!r}")
    old = _state["backend"]
    _state["backend"] = backend
    try:
        yield
    finally:
        _state["backend"] = old
