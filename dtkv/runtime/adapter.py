"""What a model must provide to the runtime: :class:`ModelSpec` (its KV geometry) and :class:`ModelAdapter`.

See :mod:`dtkv.runtime` for how a step calls an adapter and what the adapter's attention calls back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dtkv._checks import check_int
from dtkv.layouts import KVLayout, total_page_bytes

if TYPE_CHECKING:
    from dtkv.runtime.context import StepContext

__all__ = ["LAYOUT_NAMES", "ModelAdapter", "ModelSpec"]

LAYOUT_NAMES = ("index", "kv")
"""The pools every DSA model stores: ``"kv"`` (the MLA latent row) and ``"index"`` (the indexer key)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelSpec:
    """The KV geometry of a model, as the runtime sizes pools, pages and decode traffic from it."""

    layouts: Mapping[str, KVLayout] = field(repr=False)
    """Stored format of each pool, by name: ``"kv"`` (MLA latent + rope) and ``"index"`` (indexer keys); one
    ``page_size`` for all."""
    num_layers: int
    """Layers (each has its own pages in every pool)."""
    vocab_size: int
    """Token ids are in ``[0, vocab_size)``."""
    index_topk: int
    """Keys each query attends to."""
    num_heads: int
    """Query heads of the sparse attention (on this rank)."""
    kv_lora_rank: int
    """Latent dims of a KV row (``R``)."""
    rope_dim: int
    """Rotary dims of a KV row (``E``)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "vocab_size", "index_topk", "num_heads", "kv_lora_rank"):
            check_int(name, getattr(self, name), min_value=1)
        check_int("rope_dim", self.rope_dim, min_value=0)
        if sorted(self.layouts) != sorted(LAYOUT_NAMES):
            raise ValueError(f"layouts must name the pools {sorted(LAYOUT_NAMES)}, got {sorted(self.layouts)}")
        sizes = {lay.page_size for lay in self.layouts.values()}
        if len(sizes) != 1:
            raise ValueError(f"layouts must share one page_size, got {sorted(sizes)}")

    @property
    def page_size(self) -> int:
        """Tokens per page (every layout's)."""
        return next(iter(self.layouts.values())).page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of every pool, one layer."""
        return total_page_bytes(self.layouts)


class ModelAdapter(ABC):
    """A model as the runtime runs it (see :mod:`dtkv.runtime` for the contract).

    Attributes:
        spec: the model's :class:`ModelSpec`.
        device: where its weights live (pools and plans go there too).
    """

    spec: ModelSpec
    device: torch.device

    @abstractmethod
    def forward(self, ctx: StepContext) -> torch.Tensor:
        """Run the model over ``ctx.ids`` at ``ctx.positions`` (this rank's rows; run phase, collective).

        Every layer's attention stores its rows with ``ctx.write`` and reads KV through ``ctx.views`` (extend
        steps) or ``ctx.decode_attention`` (sharded decode steps, where ``ctx.decode`` is set).

        Returns:
            Final hidden states ``[n, D]`` (before the LM head), one row per row of ``ctx.ids``.
        """

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``[m, D]`` -> ``[m, vocab_size]``; each row independent of the others."""

    def bind(self) -> None:  # noqa: B027 - optional hook
        """Attach to the model (called once by the runtime that runs it); default: nothing to do."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Detach from the model (the runtime's ``close``); default: nothing to do."""

    def graph_reason(self, decode_mode: str) -> str:
        """Why this model's decode steps cannot be captured as CUDA graphs in ``decode_mode`` (``""``: they can;
        :mod:`dtkv.runtime._graphs`), e.g. a module that synchronizes with the host. Default: ``""``."""
        return ""

    def describe(self) -> dict[str, object]:
        """What the ranks of a CP group must agree on about the model (JSON-able)."""
        s = self.spec
        return {
            "adapter": type(self).__name__,
            "num_layers": s.num_layers,
            "vocab_size": s.vocab_size,
            "index_topk": s.index_topk,
            "layouts": {k: v.describe() for k, v in sorted(s.layouts.items())},
        }
