"""``DSAModelRunner``: the transformers models' runner of 0.1, now :class:`dtkv.runtime.Runtime` over a
:class:`dtkv.integrations.transformers.TransformersAdapter` (deprecated for one release).

``DSAModelRunner(model, group=..., num_pages=..., page_size=..., kv_dtype=..., split=...)`` is
``Runtime(TransformersAdapter(model, kv_dtype=..., page_size=...), group=..., num_pages=..., split=...)``, with the
old attribute names (``model``, ``family``, ``geometry``, ``layouts``, ``kv_dtype``, ``cp_size``) and
``free_request``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from dtkv._collectives import group_size
from dtkv._util import warn_deprecated
from dtkv.attention import AttentionBackend, AttentionName
from dtkv.integrations.transformers._family import KVDtype
from dtkv.integrations.transformers.adapter import TransformersAdapter
from dtkv.runtime import KVMode, Runtime, num_pages_for

__all__ = ["DSAModelRunner", "KVMode", "num_pages_for"]


class DSAModelRunner(Runtime):
    """Deprecated: use ``dtkv.runtime.Runtime(TransformersAdapter(model, kv_dtype=, page_size=), ...)``.

    Args:
        model: the causal LM, on this rank's device, in eval mode, any dtype.
        num_pages: logical KV pages of the pool (:func:`num_pages_for` sizes it).
        group: the CP process group; ``None`` (or a group of one) for a single process.
        page_size: tokens per KV page.
        kv_dtype: ``"bf16"``, ``"fp32"`` or ``"fp8"``.
        split: ``"zigzag"`` or ``"round_robin"``.
        direct_writes: compute-owner direct writes (mode ``sharded_direct``); default: with zigzag. Needs zigzag.
        scheme: ownership scheme of the pool, ``"interleave"`` or ``"block"``.
        attention: the attention backend (``Runtime(attention=)``): ``"torch"`` runs the expanded form (the parity
            reference), ``"triton"`` / ``"flashmla"`` the absorbed form through ``kv_b_proj``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_pages: int,
        group: dist.ProcessGroup | None = None,
        page_size: int = 64,
        kv_dtype: KVDtype = "bf16",
        split: Literal["zigzag", "round_robin"] = "zigzag",
        direct_writes: bool | None = None,
        scheme: Literal["interleave", "block"] = "interleave",
        attention: AttentionName | AttentionBackend = "auto",
    ) -> None:
        warn_deprecated(
            "dtkv.integrations.transformers.DSAModelRunner",
            "dtkv.runtime.Runtime(dtkv.integrations.transformers.TransformersAdapter(model, ...), ...)",
        )
        adapter = TransformersAdapter(model, kv_dtype=kv_dtype, page_size=page_size)
        if split not in ("zigzag", "round_robin"):
            raise ValueError(f"split must be 'zigzag' or 'round_robin', got split={split!r}")
        if direct_writes and split != "zigzag":
            raise ValueError(
                "direct_writes=True needs split='zigzag': round-robin never gives a page one compute owner"
            )
        if group_size(group) == 1:
            mode: KVMode = "single"
        else:
            mode = "sharded_direct" if (split == "zigzag" if direct_writes is None else direct_writes) else "sharded"
        super().__init__(
            adapter, num_pages=num_pages, group=group, mode=mode, split=split, scheme=scheme, attention=attention
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.adapter.model

    @property
    def family(self):
        return self.adapter.family

    @property
    def geometry(self):
        return self.adapter.geometry

    @property
    def layouts(self):
        return self.adapter.layouts

    @property
    def kv_dtype(self) -> str:
        return self.adapter.kv_dtype

    @property
    def cp_size(self) -> int:
        return self.cp

    def free_request(self, rid: int) -> None:
        """Deprecated: :meth:`finish_request` (the request's pages are released; it is never stepped again)."""
        warn_deprecated("DSAModelRunner.free_request", "Runtime.finish_request")
        self.finish_request(rid)
