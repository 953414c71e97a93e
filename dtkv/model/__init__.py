"""The tiny DSA reference model: MLA latent attention + top-k indexer over paged KV served by dtkv.

Entry points: :class:`ModelConfig`, :class:`TinyDSA` (weights and per-layer math) and :class:`ReferenceAdapter`
(the model as a :class:`dtkv.runtime.ModelAdapter`)::

    from dtkv.model import ModelConfig, ReferenceAdapter
    from dtkv.runtime import Runtime
    runtime = Runtime(ReferenceAdapter(ModelConfig()), group=cp_group, num_pages=256)
"""

from __future__ import annotations

from dtkv.model.adapter import ReferenceAdapter
from dtkv.model.config import KVDtype, ModelConfig
from dtkv.model.model import TinyDSA

__all__ = ["KVDtype", "ModelConfig", "ReferenceAdapter", "TinyDSA"]
