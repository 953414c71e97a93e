"""The tiny DSA reference model: MLA latent attention + top-k indexer over paged KV served by dtkv.

Entry points: :class:`ModelConfig`, :class:`TinyDSA` (weights and per-layer math) and :class:`PrefillEngine`
(chunked CP prefill and greedy decode in the ``single``/``replicated``/``sharded``/``sharded_direct`` modes;
decode over a full view or, with ``decode_mode="sharded"``, straight on the sharded pool).
"""

from __future__ import annotations

from dtkv.model.config import KVDtype, ModelConfig
from dtkv.model.engine import DecodeMode, KVMode, PrefillEngine, Request, StepPlan
from dtkv.model.model import TinyDSA

__all__ = ["DecodeMode", "KVDtype", "KVMode", "ModelConfig", "PrefillEngine", "Request", "StepPlan", "TinyDSA"]
