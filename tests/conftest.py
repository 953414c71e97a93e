"""Shared fixtures: long-lived gloo rank groups of sizes 2, 3 and 4 (one per test session), and
``transfer_engine``, which runs a PD test once per transfer engine (``mooncake``, ``nixl``; ``tests/_engines.py``).

Also the ``gpu`` marker: every test that needs a CUDA device carries it (``pytest.mark.gpu``; a device
parametrization marks its ``cuda`` case, as ``tests/ops_reference.DEVICES`` does), and without CUDA each such test
is skipped here with one reason. ``python -m pytest -m gpu`` on a GPU machine runs exactly the GPU cases;
``tests/test_gpu_marker.py`` keeps the suite from saying "needs CUDA" any other way.

Also the engine checks: when the ``mooncake`` extra is installed but its engine cannot load (Debian's
``libibverbs1`` missing, typically), or the ``nixl`` extra is installed but NIXL or its UCX plugin does not load,
the run stops at once saying how to fix it, instead of skipping the PD tests among the CUDA skips. To accept that
on purpose: ``DTKV_TEST_NO_MOONCAKE=1`` / ``DTKV_TEST_NO_NIXL=1`` (that engine's tests then skip, each saying why)
or ``-m "not mooncake"`` / ``-m "not nixl"`` (they are deselected). The summary ends with the tests run per engine.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter; the flag must be set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# xdist workers share the CPUs: each takes its share of intra-op threads (two workers of two threads on two cores
# spun on each other's cores: the interpreted kernels' tests took 13% longer).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

from tests import _engines
from tests._long_tail import mark as _mark_long_tail
from tests._multirank import RankGroup

_MOONCAKE_FIX = (
    "the `mooncake` extra is installed but its transfer engine does not load, so the PD transfer tests would "
    "be skipped: {why}\n"
    "Fix: install Debian's `libibverbs1` (`apt-get install libibverbs1`; `.ci/run` does), or run without the "
    "Mooncake tests on purpose: `DTKV_TEST_NO_MOONCAKE=1 python -m pytest` (they skip, saying why) or "
    '`python -m pytest -m "not mooncake"` (they are deselected).'
)


_NIXL_FIX = (
    "the `nixl` extra is installed but NIXL does not load, so the NIXL PD transfer tests would be skipped: {why}\n"
    "Fix: reinstall it (`pip install -e '.[nixl]' -c .ci/constraints.txt`: nixl, nixl-cu12, nixl-cu13 1.5.1), or "
    "run without the NIXL tests on purpose: `DTKV_TEST_NO_NIXL=1 python -m pytest` (they skip, saying why) or "
    '`python -m pytest -m "not nixl"` (they are deselected).'
)


def _nixl_state() -> tuple[str, str]:
    """``("ok" | "not installed" | "broken" | "check off", detail)``."""
    if os.environ.get("DTKV_TEST_NO_NIXL", "").strip() not in ("", "0"):
        return "check off", "DTKV_TEST_NO_NIXL is set: NIXL tests skip if the engine does not load"
    if importlib.util.find_spec("nixl") is None:
        return "not installed", "the `nixl` extra is not installed: the NIXL PD transfer tests skip"
    from dtkv.transfer import nixl_available

    ok, why = nixl_available()
    return ("ok", "NIXL and its UCX plugin load") if ok else ("broken", why)


def _mooncake_state() -> tuple[str, str]:
    """``("ok" | "not installed" | "broken" | "check off", detail)``."""
    if os.environ.get("DTKV_TEST_NO_MOONCAKE", "").strip() not in ("", "0"):
        return "check off", "DTKV_TEST_NO_MOONCAKE is set: Mooncake tests skip if the engine does not load"
    if importlib.util.find_spec("mooncake") is None:
        return "not installed", "the `mooncake` extra is not installed: the PD transfer tests skip"
    from dtkv.transfer import mooncake_available

    ok, why = mooncake_available()
    return ("ok", "the transfer engine loads") if ok else ("broken", why)


def pytest_configure(config):
    markexpr = config.getoption("markexpr", "") or ""
    state, detail = _mooncake_state()
    config._dtkv_mooncake = (state, detail)
    if state == "broken" and "not mooncake" not in markexpr:
        raise pytest.UsageError(_MOONCAKE_FIX.format(why=detail))
    state, detail = _nixl_state()
    config._dtkv_nixl = (state, detail)
    if state == "broken" and "not nixl" not in markexpr:
        raise pytest.UsageError(_NIXL_FIX.format(why=detail))


GPU_SKIP_REASON = "needs a CUDA device (the gpu marker: python -m pytest -m gpu on a GPU machine)"


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``pyproject.toml``'s addopts): ``DTKV_TEST_WORKERS`` if set, else the CPUs this process may use,
    at most 4 (each worker starts its own gloo rank groups; past 4 the multi-rank tests only queue for cores)."""
    raw = os.environ.get("DTKV_TEST_WORKERS", "").strip()
    if raw:
        if not raw.isdigit():
            raise pytest.UsageError(f"DTKV_TEST_WORKERS must be a count of worker processes (0: none), got {raw!r}")
        return int(raw)
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _wants_build(config) -> bool:
    """Whether the run selects the ``build`` tests: ``-m`` names the marker, or an argument names their file."""
    markexpr = config.getoption("markexpr", "") or ""
    return "build" in markexpr or any("test_ops_compile" in str(a) for a in config.args)


def pytest_collection_modifyitems(config, items):
    _mark_long_tail(items, list(config.args))  # the quick subset's long tail (tests/_long_tail.py): slow
    if not _wants_build(config):  # the offline sm_90 build: a CI step of its own (`python -m pytest -m build`)
        build = [item for item in items if item.get_closest_marker("build") is not None]
        if build:
            config.hook.pytest_deselected(items=build)
            items[:] = [item for item in items if item.get_closest_marker("build") is None]
    for item in items:  # reports carry user_properties to the controller, also from xdist workers
        engine = getattr(getattr(item, "callspec", None), "params", {}).get("transfer_engine")
        if engine is not None:
            item.user_properties.append(("dtkv_pd_suite", engine))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_report_header(config):
    lines = []
    for name in ("mooncake", "nixl"):
        state, detail = getattr(config, f"_dtkv_{name}", ("?", ""))
        lines.append(f"{name}: {state} ({detail})")
    return lines


def pytest_terminal_summary(terminalreporter, config):
    """Two lines: the PD tests run once per engine (``transfer_engine``) and the engine-specific ones, by engine and
    outcome (CI's log shows both counts)."""
    counts: dict[str, dict[str, dict[str, int]]] = {"the PD suite": {}, "engine-specific tests": {}}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            keywords = getattr(rep, "keywords", {})
            if not (rep.when == "call" or outcome in ("skipped", "error")):
                continue
            pd_suite = any(k == "dtkv_pd_suite" for k, _ in getattr(rep, "user_properties", ()))
            group = counts["the PD suite" if pd_suite else "engine-specific tests"]
            for name in ("mooncake", "nixl"):
                if name in keywords:
                    c = group.setdefault(name, {})
                    c[outcome] = c.get(outcome, 0) + 1
    for title, group in counts.items():
        if group:
            parts = [f"{name} " + ", ".join(f"{n} {o}" for o, n in c.items()) for name, c in sorted(group.items())]
            terminalreporter.write_line(f"transfer engines, {title}: " + "; ".join(parts))


@pytest.fixture(params=_engines.ENGINES)
def transfer_engine(request) -> str:
    """Runs a test once per transfer engine: ``"mooncake"`` and ``"nixl"`` (``tests/_engines.py``)."""
    return request.param


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
