"""The backend names, the geometry a backend must fit, and the error that names a broken fit rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtkv._checks import check_int
from dtkv.layouts import MLAFp8Layout, MLALatentLayout

__all__ = ["AUTO_ORDER", "BACKENDS", "AttentionFitError", "AttentionName", "AttentionSpec"]

AttentionName = Literal["auto", "torch", "triton", "flashmla"]
BACKENDS: tuple[str, ...] = ("torch", "triton", "flashmla")
"""The concrete backends."""
AUTO_ORDER: tuple[str, ...] = ("flashmla", "triton", "torch")
"""``"auto"`` takes the first of these that is available on the device and fits (fastest first)."""


class AttentionFitError(ValueError):
    """A model, pool or device does not fit a backend's rules; the message names each broken rule."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSpec:
    """What a layer's sparse attention looks like to a backend (checked by :func:`dtkv.attention.check_fit`)."""

    num_heads: int
    """Query heads per rank (after any tensor-parallel split of the heads)."""
    layout: MLALatentLayout | MLAFp8Layout
    """Stored format of the KV pages attention reads (its ``kv_lora_rank``, ``rope_dim``, ``page_size``)."""
    topk: int
    """Keys each query attends to (before any padding to a kernel's multiple)."""

    def __post_init__(self) -> None:
        check_int("num_heads", self.num_heads, min_value=1)
        check_int("topk", self.topk, min_value=1)
        if not isinstance(self.layout, (MLALatentLayout, MLAFp8Layout)):
            raise TypeError(f"layout must be MLALatentLayout or MLAFp8Layout, got {type(self.layout).__name__}")

    @property
    def kv_lora_rank(self) -> int:
        return self.layout.kv_lora_rank

    @property
    def rope_dim(self) -> int:
        return self.layout.rope_dim

    @property
    def head_dim(self) -> int:
        """Query/key dims (``kv_lora_rank + rope_dim``: the absorbed latent, then rope)."""
        return self.layout.kv_lora_rank + self.layout.rope_dim

    @property
    def fp8(self) -> bool:
        """Whether the pages are the fp8 row format (:class:`dtkv.MLAFp8Layout`)."""
        return isinstance(self.layout, MLAFp8Layout)
