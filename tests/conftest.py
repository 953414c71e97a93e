"""Shared fixtures: long-lived gloo rank groups of sizes 2, 3 and 4 (one per test session)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter; the flag must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests._multirank import RankGroup


@pytest.fixture(scope="session")
def ranks2():
    group = RankGroup(2)
    yield group
    group.close()


@pytest.fixture(scope="session")
def ranks3():
    group = RankGroup(3)
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


@pytest.fixture(params=[2, 3, 4], ids=["world2", "world3", "world4"])
def ranks234(request):
    """Parametrizes a test over world sizes 2, 3 and 4."""
    return request.getfixturevalue(f"ranks{request.param}")
