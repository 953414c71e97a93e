"""Shared fixtures: long-lived gloo rank groups of sizes 2 and 4 (one per test session)."""

from __future__ import annotations

import pytest

from tests._multirank import RankGroup


@pytest.fixture(scope="session")
def ranks2():
    group = RankGroup(2)
    yield group
    group.close()


@pytest.fixture(scope="session")
def ranks4():
    group = RankGroup(4)
    yield group
    group.close()


@pytest.fixture(params=[2, 4], ids=["world2", "world4"])
def ranks(request, ranks2, ranks4):
    """Parametrizes a test over world sizes 2 and 4."""
    return ranks2 if request.param == 2 else ranks4
