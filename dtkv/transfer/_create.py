"""``create_engine``: a transfer engine by name (``engine="mooncake" | "nixl" | "local"`` where a side is made).

Apart from ``engine.py`` so that the engines' own modules (``engine.py``, ``_nixl.py``) do not import each other.
"""

from __future__ import annotations

from dtkv.transfer._nixl import NixlEngine
from dtkv.transfer.engine import ENGINES, LocalEngine, MooncakeEngine, _EngineBase

__all__ = ["create_engine"]


def create_engine(kind: str, *, timeout_s: float | None = None) -> _EngineBase:
    """A new engine of ``kind`` (one of :data:`ENGINES`), its own timeouts set from ``timeout_s``.

    - ``"mooncake"``: :class:`MooncakeEngine` on 127.0.0.1 (what sglang's PD disaggregation uses);
    - ``"nixl"``: :class:`NixlEngine` (UCX; what vLLM's ``NixlConnector`` uses);
    - ``"local"``: :class:`LocalEngine` (in-process peers only).

    Raises:
        ValueError: ``kind`` is not one of :data:`ENGINES`.
        ImportError: the engine's package is missing (the message says which extra to install).
    """
    if kind == "mooncake":
        return MooncakeEngine(timeout_s=timeout_s)
    if kind == "nixl":
        return NixlEngine(timeout_s=timeout_s)
    if kind == "local":
        return LocalEngine()
    raise ValueError(f"engine must be one of {list(ENGINES)}, got engine={kind!r}")
