"""``ModelRunner``: the reference model's runner of 0.1, now :class:`dtkv.runtime.Runtime` over a
:class:`dtkv.model.ReferenceAdapter` (deprecated for one release).

``ModelRunner(cfg, mode=..., group=..., num_pages=...)`` is ``Runtime(ReferenceAdapter(cfg, device), mode=...,
group=..., num_pages=..., scheme=ownership_scheme, ...)`` with the old defaults (``prefill(chunk, prefetch=False)``)
and the old attribute names (``cfg``, ``model``, ``spec`` for the ownership spec). The KV modes, the plan/run split
and the decode modes are documented in :mod:`dtkv.runtime`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from dtkv._util import warn_deprecated
from dtkv.attention import AttentionBackend, AttentionName
from dtkv.model.adapter import ReferenceAdapter
from dtkv.model.config import ModelConfig
from dtkv.ownership import OwnershipScheme
from dtkv.runtime import KV_MODES, DecodeMode, KVMode, Request, Runtime, StepPlan

__all__ = ["DecodeMode", "KVMode", "ModelRunner", "Request", "StepPlan"]


class ModelRunner(Runtime):
    """Deprecated: use ``dtkv.runtime.Runtime(dtkv.model.ReferenceAdapter(cfg, device), ...)``.

    Args:
        cfg: model geometry.
        mode: KV mode (:mod:`dtkv.runtime`).
        split: CP split, ``"zigzag"`` or ``"round_robin"``.
        group: the CP process group (ignored for ``single``).
        num_pages: logical pages of the pool.
        ownership_scheme: ``Runtime(scheme=...)``.
        ownership_layout: deprecated name of ``ownership_scheme`` (warns).
        device: where pools and compute live.
        prefix_cache, decode_mode, attention: as :class:`dtkv.runtime.Runtime`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        mode: KVMode,
        split: Literal["zigzag", "round_robin"] = "zigzag",
        group: dist.ProcessGroup | None = None,
        num_pages: int,
        ownership_scheme: OwnershipScheme = "interleave",
        ownership_layout: OwnershipScheme | None = None,
        device: torch.device | str = "cpu",
        prefix_cache: bool = False,
        decode_mode: DecodeMode = "full",
        attention: AttentionName | AttentionBackend = "auto",
    ) -> None:
        warn_deprecated("dtkv.model.ModelRunner", "dtkv.runtime.Runtime(dtkv.model.ReferenceAdapter(cfg), ...)")
        if ownership_layout is not None:
            warn_deprecated("ModelRunner(ownership_layout=...)", "ModelRunner(ownership_scheme=...)")
            ownership_scheme = ownership_layout
        if mode not in KV_MODES:
            raise ValueError(f"mode must be one of {KV_MODES}, got mode={mode!r}")
        super().__init__(
            ReferenceAdapter(cfg, device), num_pages=num_pages, group=group, mode=mode, split=split,
            scheme=ownership_scheme, decode_mode=decode_mode, prefix_cache=prefix_cache, attention=attention,
        )  # fmt: skip

    @property
    def cfg(self) -> ModelConfig:
        """The model's :class:`ModelConfig`."""
        return self.adapter.cfg

    @property
    def model(self):
        """The :class:`dtkv.model.TinyDSA`."""
        return self.adapter.model

    @property
    def spec(self):
        """The pool's ownership as plain ints (``Runtime.ownership_spec``)."""
        return self.ownership_spec

    def prefill(self, chunk: int, *, prefetch: bool = False) -> list[int]:
        """Chunked prefill of every request, ``chunk`` tokens per request per step; returns each first token."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be >= 1, got chunk={chunk}")
        return super().prefill(chunk, prefetch=prefetch)
