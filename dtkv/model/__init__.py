"""The tiny DSA reference model: MLA latent attention + top-k indexer over paged KV served by dtkv.

Entry points: :class:`ModelConfig`, :class:`TinyDSA` (weights and per-layer math) and :class:`ReferenceAdapter`
(the model as a :class:`dtkv.runtime.ModelAdapter`)::

    from dtkv.model import ModelConfig, ReferenceAdapter
    from dtkv.runtime import Runtime
    runtime = Runtime(ReferenceAdapter(ModelConfig()), group=cp_group, num_pages=256)

:class:`ModelRunner` (and its older name ``PrefillEngine``) is the deprecated 0.1 entry point (one release).
"""

from __future__ import annotations

from dtkv.model.adapter import ReferenceAdapter
from dtkv.model.config import KVDtype, ModelConfig
from dtkv.model.model import TinyDSA
from dtkv.model.runner import ModelRunner

__all__ = ["KVDtype", "ModelConfig", "ModelRunner", "ReferenceAdapter", "TinyDSA"]

_RUNTIME_NAMES = ("DecodeMode", "KVMode", "Request", "StepPlan")
"""Importable from here as in 0.1; they are :mod:`dtkv.runtime`'s (documented there)."""


def __getattr__(name: str):
    if name in _RUNTIME_NAMES:
        import dtkv.runtime

        return getattr(dtkv.runtime, name)
    if name == "PrefillEngine":  # the pre-0.1 name of ModelRunner (it runs prefill and decode)
        from dtkv._util import warn_deprecated

        warn_deprecated("dtkv.model.PrefillEngine", "dtkv.model.ModelRunner")
        return ModelRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
