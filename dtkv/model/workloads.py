"""Deprecated (one release): the multi-turn workloads are :mod:`dtkv.demo.workloads` (they drive any runtime)."""

from __future__ import annotations

from dtkv._util import warn_deprecated
from dtkv.demo.workloads import ChatWorkload, WorkloadRun, chat_workload, compare_runs, run_workload

__all__ = ["ChatWorkload", "WorkloadRun", "chat_workload", "compare_runs", "run_workload"]

warn_deprecated("dtkv.model.workloads", "dtkv.demo.workloads")
