"""Runtimes of both model adapters for the tests, and a snapshot of everything a runtime step may change.

- ``runtime(model, group=..., kv_dtype=..., page_size=..., **runtime_kwargs)`` builds a
  :class:`dtkv.runtime.Runtime` over ``ReferenceAdapter`` (``model="reference"``) or ``TransformersAdapter`` of a
  cached tiny model (``"deepseek-v32"``, ``"glm5"``, ``"glm5-shared"``: GLM-5 whose layer 1 reuses layer 0's
  top-k); :func:`reference_runtime` the reference model of a :class:`dtkv.model.ModelConfig`.
- ``make_runtime("reference" | "transformers", ...)`` (a context manager) either adapter behind one set of
  arguments (:data:`ADAPTERS` parametrizes over them); :func:`snapshot` / :func:`unchanged` record the requests, the
  allocator (digest and every reference count), the prefix cache, the stats and every pool byte, so a test can show
  that a refused call changed nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import pytest
import torch

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime

__all__ = [
    "ADAPTERS",
    "MODELS",
    "PAGE_SIZE",
    "adapter",
    "make_runtime",
    "plan_sharded",
    "reference_runtime",
    "refused",
    "runtime",
    "snapshot",
    "tiny_lm",
    "unchanged",
]

MODELS = ("reference", "deepseek-v32", "glm5", "glm5-shared")
GLM_SHARED = (("indexer_types", ("full", "shared", "full")),)
ADAPTERS = [
    "reference",
    pytest.param(
        "transformers",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("transformers") is None, reason="the hf extra (transformers)"
        ),
    ),
]
"""The two adapters of :func:`make_runtime`, as a parametrization (the transformers one skips without the extra)."""
PAGE_SIZE = 4
"""Tokens per page of :func:`make_runtime`'s runtimes."""


@functools.cache
def tiny_lm(name: str):
    """The tiny transformers model of ``name`` (cached per process; one thread: tiny GEMMs on a busy box)."""
    from dtkv.integrations.transformers import tiny_model

    torch.set_num_threads(1)
    overrides = dict(GLM_SHARED) if name == "glm5-shared" else {}
    overrides = {k: list(v) for k, v in overrides.items()}
    return tiny_model("glm5" if name == "glm5-shared" else name, **overrides)


def adapter(name: str, *, kv_dtype: str = "bf16", page_size: int = 4, num_layers: int = 2):
    """A fresh adapter of model ``name`` (the reference model with ``num_layers`` layers)."""
    if name == "reference":
        return ReferenceAdapter(ModelConfig(kv_dtype=kv_dtype, page_size=page_size, num_layers=num_layers))
    from dtkv.integrations.transformers import TransformersAdapter

    return TransformersAdapter(tiny_lm(name), kv_dtype=kv_dtype, page_size=page_size)


def runtime(name: str, *, group=None, kv_dtype: str = "bf16", page_size: int = 4, **kwargs) -> Runtime:
    """A :class:`Runtime` over :func:`adapter` (``kwargs`` go to the runtime; close it when done)."""
    return Runtime(adapter(name, kv_dtype=kv_dtype, page_size=page_size), group=group, **kwargs)


def reference_runtime(cfg: ModelConfig, *, mode: str, num_pages: int, group=None, device: str = "cpu", **kwargs):
    """The reference model of ``cfg`` in a :class:`Runtime` of KV mode ``mode`` (``group`` is dropped for
    ``"single"``; ``kwargs`` go to the runtime: ``split``, ``scheme``, ``prefix_cache``, ``decode_mode``, ...)."""
    group = None if mode == "single" else group
    return Runtime(ReferenceAdapter(cfg, device), mode=mode, num_pages=num_pages, group=group, **kwargs)


def plan_sharded(rt: Runtime, reqs):
    """The plan phase of a sharded decode step of ``reqs`` on ``rt`` (what ``rt.decode_step`` plans first: each
    request's next page allocated, the step's :class:`dtkv.decode.DecodePlan`)."""
    from dtkv.runtime._decode import plan_sharded_step

    return plan_sharded_step(reqs, allocator=rt.allocator, ownership=rt.ownership, rank=rt.pool.rank,
                             page_size=rt.page_size, topk=rt.model_spec.index_topk, device=rt.device)  # fmt: skip


@contextlib.contextmanager
def make_runtime(
    which: str,
    *,
    group=None,
    num_pages: int = 16,
    prefix_cache: bool = False,
    mode: str | None = None,
    decode_mode: str = "full",
) -> Iterator[Runtime]:
    """A :class:`Runtime` of ``which`` adapter (every rank of ``group`` builds the same one); closed on exit.

    ``"reference"``: the reference model with one layer; ``"transformers"``: the tiny DeepSeek-V3.2 model with fp32
    KV. Every argument applies to both (one runtime, one set of rules).
    """
    if which == "reference":
        model = ReferenceAdapter(ModelConfig(num_layers=1, page_size=PAGE_SIZE))
        mode = mode or ("single" if group is None else "sharded_direct")
    else:
        from dtkv.integrations.transformers import TransformersAdapter

        model = TransformersAdapter(tiny_lm("deepseek-v32"), kv_dtype="fp32", page_size=PAGE_SIZE)
    rt = Runtime(model, num_pages=num_pages, group=group, mode=mode, prefix_cache=prefix_cache, decode_mode=decode_mode)
    try:
        yield rt
    finally:
        rt.close()


def snapshot(rt: Runtime) -> tuple[dict, dict[str, torch.Tensor]]:
    """Host state (requests, allocator, prefix cache, stats) and a copy of every pool buffer."""
    alloc = rt.allocator
    state = {
        "requests": [(r.rid, list(r.prompt), list(r.pages), r.num_computed, list(r.output), r.finished)
                     for r in rt.requests],
        "allocator": alloc.digest(),
        "refcounts": [alloc.refcount(p) for p in range(alloc.ownership.num_pages)],
        "stats": dict(rt.stats),
    }  # fmt: skip
    if rt.prefix_cache is not None:
        state["prefix_cache"] = (rt.prefix_cache.digest(), rt.prefix_cache.cached_pages())
    pools = {name: rt.pool.buffer(name).clone() for name in sorted(rt.pool.layouts)}
    return state, pools


def unchanged(rt: Runtime, before: tuple[dict, dict[str, torch.Tensor]]) -> bool:
    """Whether ``rt`` still holds exactly the state of ``before`` (pool bytes compared bit for bit)."""
    state, pools = snapshot(rt)
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
