"""One timed region of ``bench_runtime.py`` under ``torch.profiler``: dtkv's host ranges, the device's busy time.

:func:`dtkv_ranges` opens a ``torch.profiler.record_function`` range named ``dtkv.<call>`` around each call through
which a model reaches dtkv (for the profiled run only, and undone after it): the step context's ``write``,
``views``, ``decode_attention`` and ``finish`` (:class:`dtkv.runtime.StepContext`), the attention backend's
``indices``, ``prefill`` and ``decode`` (the runtime's :attr:`~dtkv.runtime.Runtime.attention`), and the transformers
adapter's extend-step indexer and top-k (``select_topk`` of :mod:`dtkv.integrations.transformers.attention`, when
that module has it). dtkv's registered ops are ``dtkv::*`` ranges of their own. What is not inside such a range is
the model's: its projections, norms, MoE, the absorbed products, the LM head, and the runtime's host work.

:func:`profiled` runs a callable once under the profiler (CPU and, on a CUDA device, CUDA activity) inside those
ranges and reduces its chrome trace with :func:`_trace.device_split` (busy time over every stream merged, dtkv's
part) and :func:`_trace.trace_summary` (kernel time per category). :func:`device_busy` runs one under device
activity only: the profiler's host instrumentation (a record for every operator the host plans with) lengthens the
host's part of a step, so a share taken from the CPU-and-CUDA profile counts the profiler's own overhead as idle.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _trace import device_split, trace_summary

__all__ = ["device_busy", "dtkv_ranges", "profiled"]

_CONTEXT_CALLS = ("write", "views", "decode_attention", "finish")
_BACKEND_CALLS = ("indices", "prefill", "decode")


def _wrapped(fn: Callable, label: str) -> Callable:
    from torch.profiler import record_function

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def dtkv_ranges(runtime) -> Iterator[list[str]]:
    """Inside the block, dtkv's calls run in ``dtkv.<call>`` ranges (module docstring); yields the ranges opened."""
    from dtkv.runtime import StepContext

    undo: list[Callable[[], None]] = []
    names: list[str] = []

    def patch(owner, attr: str, label: str, *, instance: bool) -> None:
        fn = getattr(owner, attr, None)
        if not callable(fn):
            return
        setattr(owner, attr, _wrapped(fn, label))
        names.append(label)
        undo.append((lambda: delattr(owner, attr)) if instance else (lambda: setattr(owner, attr, fn)))

    try:
        for attr in _CONTEXT_CALLS:
            patch(StepContext, attr, f"dtkv.{attr}", instance=False)
        for attr in _BACKEND_CALLS:
            patch(runtime.attention, attr, f"dtkv.attention.{attr}", instance=True)
        module = sys.modules.get("dtkv.integrations.transformers.attention")
        if module is not None:
            patch(module, "select_topk", "dtkv.indexer_topk", instance=False)
        yield names
    finally:
        for fn in reversed(undo):
            fn()


def profiled(fn: Callable[[], object], device: torch.device, runtime, *, trace_dir: str | None = None,
             name: str = "trace") -> dict:  # fmt: skip
    """Run ``fn()`` once under the profiler inside :func:`dtkv_ranges`; the trace's reduction (ms).

    Returns:
        :func:`_trace.device_split`'s keys, plus ``wall_ms`` (the profiled call, synchronized), ``ranges`` (those
        opened), ``categories_ms`` (kernel time per category on the busiest stream) and ``trace`` (the chrome trace's
        path when ``trace_dir`` keeps it).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    with dtkv_ranges(runtime) as names:
        sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - t0
    keep = trace_dir is not None
    if keep:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        path = str(Path(trace_dir) / f"{name}.json")
    else:
        fd, path = tempfile.mkstemp(prefix="dtkv_runtime_", suffix=".json")
        os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
        out = device_split(events)
        out["categories_ms"] = trace_summary(Path(path))["categories_ms"] if out["kernels"] else {}
    finally:
        if not keep:
            os.unlink(path)
    return {**out, "wall_ms": wall * 1e3, "ranges": names, "trace": path if keep else None}


def device_busy(fn: Callable[[], object], device: torch.device) -> dict:
    """Run ``fn()`` once under the profiler with CUDA activity only: ``busy_ms`` (every stream merged) and
    ``wall_ms`` (the call, synchronized), the inputs of the GPU-busy share without the host instrumentation's cost.

    Raises:
        ValueError: ``device`` is not CUDA.
    """
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        raise ValueError(f"device_busy measures a CUDA device, got device={device}")
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(prefix="dtkv_busy_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)
    return {"busy_ms": device_split(events)["busy_ms"], "wall_ms": wall * 1e3}
