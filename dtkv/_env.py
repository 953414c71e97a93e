"""Every ``DTKV_*`` environment variable, read in this one place.

| variable | values | default | effect |
| --- | --- | --- | --- |
| ``DTKV_DEBUG`` | 0/1 | 0 | synchronizing ownership checks in writes and materialization |
| ``DTKV_BACKEND`` | auto/torch/triton | auto | default op backend (``auto``: Triton on CUDA, else torch) |
| ``DTKV_LOGLEVEL`` | a ``logging`` level name | WARNING | level of the ``dtkv`` logger |
| ``DTKV_TRANSFER_TIMEOUT_S`` | float seconds | 30 | bound on every wait of the Mooncake transfer path |
| ``DTKV_TRANSFER_SECRET`` | a string | unset | shared key: rendezvous-store values are HMAC-SHA256 signed and checked |

Variables are read once, at import. Tests flip switches through the context managers below
(:func:`debug_mode`, :func:`default_backend`), never by editing ``os.environ``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Literal

__all__ = [
    "Backend",
    "debug_enabled",
    "debug_mode",
    "default_backend",
    "get_backend",
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
        raise ValueError(f"{name} must be a positive number of seconds, got {name}={raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {name}={raw!r}")
    return value


_state = {
    "debug": _read_bool("DTKV_DEBUG"),
    "backend": _read_backend(),
    "transfer_timeout_s": _read_float("DTKV_TRANSFER_TIMEOUT_S", 30.0),
    "transfer_secret": os.environ.get("DTKV_TRANSFER_SECRET", "").encode() or None,
}

logging.getLogger("dtkv").setLevel(os.environ.get("DTKV_LOGLEVEL", "WARNING").strip().upper() or "WARNING")


def debug_enabled() -> bool:
    """True when ``DTKV_DEBUG=1`` (or inside :func:`debug_mode`): ops run synchronizing checks."""
    return _state["debug"]


def get_backend() -> Backend:
    """The process-wide default backend (``DTKV_BACKEND``, or :func:`default_backend`)."""
    return _state["backend"]


def transfer_timeout_s() -> float:
    """Bound in seconds on every wait of the transfer path (``DTKV_TRANSFER_TIMEOUT_S``)."""
    return _state["transfer_timeout_s"]


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
