"""The transfer engines the PD tests run on: every test that runs on Mooncake runs on NIXL too.

- ``ENGINES``: ``pytest.param("mooncake")`` and ``pytest.param("nixl")``, each with its marker (``mooncake`` /
  ``nixl``) and a skip saying why when the engine does not load (``tests/conftest.py`` stops the run instead when
  an installed engine does not load); the ``transfer_engine`` fixture (``tests/conftest.py``) is parametrized
  over them.
- ``engine_class(kind)`` / ``make(kind, **kw)``: the engine class and a new engine (both take ``timeout_s``).
- ``session_prefix(kind)``: how a session of that engine starts (named in every engine error's peer).
- ``released(engine)``: whether the engine let its transport go (``close()`` ran to the end).
"""

from __future__ import annotations

import pytest

from dtkv.transfer import mooncake_available, nixl_available

MOONCAKE_OK, MOONCAKE_WHY = mooncake_available()
NIXL_OK, NIXL_WHY = nixl_available()

ENGINES = [
    pytest.param(
        "mooncake",
        marks=[
            pytest.mark.mooncake,
            pytest.mark.skipif(not MOONCAKE_OK, reason=f"Mooncake transfer engine unavailable: {MOONCAKE_WHY}"),
        ],
        id="mooncake",
    ),
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(not NIXL_OK, reason=f"NIXL transfer engine unavailable: {NIXL_WHY}"),
        ],
        id="nixl",
    ),
]


def engine_class(kind: str):
    from dtkv.transfer import MooncakeEngine, NixlEngine

    return {"mooncake": MooncakeEngine, "nixl": NixlEngine}[kind]


def make(kind: str, **kwargs):
    return engine_class(kind)(**kwargs)


def session_prefix(kind: str) -> str:
    return {"mooncake": "127.0.0.1:", "nixl": "nixl:"}[kind]


def released(engine) -> bool:
    return getattr(engine, "_engine", getattr(engine, "_agent", None)) is None
