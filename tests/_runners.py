"""Both model adapters behind one factory, and a snapshot of everything a runner step may change.

``make_runner("reference" | "transformers", ...)`` builds a :class:`dtkv.runtime.Runtime` over the reference model
(one layer) or the tiny DeepSeek-V3.2 model; :func:`snapshot` records
the requests, the allocator (digest and every reference count), the prefix cache, the stats and every pool byte, so
a test can show that a refused call changed nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch

ADAPTERS = [
    "reference",
    pytest.param(
        "transformers",
        marks=pytest.mark.skipif(
            __import__("importlib").util.find_spec("transformers") is None, reason="the hf extra (transformers)"
        ),
    ),
]
PAGE_SIZE = 4


@functools.cache
def _tiny_lm():
    from dtkv.integrations.transformers import tiny_model

    return tiny_model("deepseek-v32")


@contextlib.contextmanager
def make_runner(
    adapter: str,
    *,
    group=None,
    num_pages: int = 16,
    prefix_cache: bool = False,
    mode: str | None = None,
    decode_mode: str = "full",
) -> Iterator[object]:
    """A :class:`dtkv.runtime.Runtime` of ``adapter`` (every rank of ``group`` builds the same one); closed on exit.

    ``"reference"``: the reference model with one layer; ``"transformers"``: the tiny DeepSeek-V3.2 model with fp32
    KV. Every argument applies to both (one runtime, one set of rules).
    """
    from dtkv.runtime import Runtime

    if adapter == "reference":
        from dtkv.model import ModelConfig, ReferenceAdapter

        model = ReferenceAdapter(ModelConfig(num_layers=1, page_size=PAGE_SIZE))
        mode = mode or ("single" if group is None else "sharded_direct")
    else:
        from dtkv.integrations.transformers import TransformersAdapter

        model = TransformersAdapter(_tiny_lm(), kv_dtype="fp32", page_size=PAGE_SIZE)
    runner = Runtime(
        model, num_pages=num_pages, group=group, mode=mode, prefix_cache=prefix_cache, decode_mode=decode_mode
    )
    try:
        yield runner
    finally:
        runner.close()


def snapshot(runner) -> tuple[dict, dict[str, torch.Tensor]]:
    """Host state (requests, allocator, prefix cache, stats) and a copy of every pool buffer."""
    alloc = runner.allocator
    state = {
        "requests": [
            (r.rid, list(r.prompt), list(r.pages), r.num_computed, list(r.output), getattr(r, "finished", None))
            for r in runner.requests
        ],
        "allocator": alloc.digest(),
        "refcounts": [alloc.refcount(p) for p in range(alloc.ownership.num_pages)],
        "stats": dict(runner.stats),
    }
    cache = getattr(runner, "prefix_cache", None)
    if cache is not None:
        state["prefix_cache"] = (cache.digest(), cache.cached_pages())
    pools = {name: runner.pool.buffer(name).clone() for name in sorted(runner.pool.layouts)}
    return state, pools


def unchanged(runner, before: tuple[dict, dict[str, torch.Tensor]]) -> bool:
    """Whether ``runner`` still holds exactly the state of ``before`` (pool bytes compared bit for bit)."""
    state, pools = snapshot(runner)
    if state != before[0]:
        return False
    return all(torch.equal(pools[n].view(torch.uint8), before[1][n].view(torch.uint8)) for n in pools)


def refused(fn, *args, **kwargs) -> tuple[str, str]:
    """Call ``fn``; return the type name and message of what it raised (``("", "")`` if it returned)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return "", ""


def free(runner, rid: int) -> None:
    """End request ``rid`` with the adapter's call (``finish_request`` / ``free_request``)."""
    (getattr(runner, "finish_request", None) or runner.free_request)(rid)
