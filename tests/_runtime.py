"""Runtimes of both model adapters for the tests: the reference model and the tiny transformers DSA models.

``runtime(model, group=..., kv_dtype=..., page_size=..., **runtime_kwargs)`` builds a :class:`dtkv.runtime.Runtime`
over ``ReferenceAdapter`` (``model="reference"``) or ``TransformersAdapter`` of a cached tiny model
(``"deepseek-v32"``, ``"glm5"``, ``"glm5-shared"``: GLM-5 whose layer 1 reuses layer 0's top-k).
"""

from __future__ import annotations

import functools

import torch

from dtkv.model import ModelConfig, ReferenceAdapter
from dtkv.runtime import Runtime

__all__ = ["MODELS", "adapter", "reference_runtime", "runtime", "tiny_lm"]

MODELS = ("reference", "deepseek-v32", "glm5", "glm5-shared")
GLM_SHARED = (("indexer_types", ("full", "shared", "full")),)


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


def reference_runtime(
    cfg: ModelConfig,
    *,
    mode: str,
    num_pages: int,
    group=None,
    split: str = "zigzag",
    ownership_scheme: str = "interleave",
    device: str = "cpu",
    prefix_cache: bool = False,
    decode_mode: str = "full",
    attention: str = "auto",
) -> Runtime:
    """The reference model of ``cfg`` in a :class:`Runtime` (the arguments of the 0.1 ``ModelRunner``)."""
    return Runtime(
        ReferenceAdapter(cfg, device), mode=mode, num_pages=num_pages, group=None if mode == "single" else group,
        split=split, scheme=ownership_scheme, prefix_cache=prefix_cache, decode_mode=decode_mode, attention=attention,
    )  # fmt: skip
