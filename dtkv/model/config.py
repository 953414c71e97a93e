"""Configuration of the tiny DSA reference model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtkv._checks import check_int
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout

__all__ = ["KVDtype", "ModelConfig"]

KVDtype = Literal["bf16", "fp8"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Geometry of the tiny DSA model: MLA latent attention with an indexer that picks top-k history tokens.

    The defaults are small enough that a CPU runs a few thousand tokens in seconds; the stored layouts are the
    real formats at reduced dims (``MLAFp8Layout`` rows, ``IndexerFp8Layout`` pages).
    """

    vocab_size: int = 97
    """Token ids are in ``[0, vocab_size)``."""
    d_model: int = 64
    """Residual width."""
    num_layers: int = 3
    """Transformer layers (each has its own KV)."""
    num_heads: int = 2
    """Query heads of the latent attention (MQA over the shared latent row)."""
    kv_lora_rank: int = 64
    """Latent dims of a KV row."""
    rope_dim: int = 16
    """Rotary dims of a KV row."""
    quant_block: int = 32
    """Latent dims per fp8 scale."""
    index_heads: int = 2
    """Indexer query heads."""
    index_head_dim: int = 32
    """Indexer key dims."""
    index_topk: int = 24
    """History tokens each query attends to (all of them when fewer)."""
    page_size: int = 4
    """Tokens per KV page."""
    kv_dtype: KVDtype = "bf16"
    """Stored MLA format: ``"bf16"`` (``MLALatentLayout``) or ``"fp8"`` (``MLAFp8Layout``)."""
    seed: int = 0
    """Seed of the deterministic weights."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "quant_block",
            "index_heads",
            "index_head_dim",
            "index_topk",
            "page_size",
        ):
            check_int(name, getattr(self, name), min_value=1)
        check_int("rope_dim", self.rope_dim, min_value=0)
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even (rotary pairs), got rope_dim={self.rope_dim}")
        if self.kv_dtype not in ("bf16", "fp8"):
            raise ValueError(f"kv_dtype must be 'bf16' or 'fp8', got kv_dtype={self.kv_dtype!r}")

    @property
    def kv_layout(self) -> KVLayout:
        if self.kv_dtype == "fp8":
            return MLAFp8Layout(
                page_size=self.page_size,
                kv_lora_rank=self.kv_lora_rank,
                rope_dim=self.rope_dim,
                quant_block=self.quant_block,
            )
        return MLALatentLayout(page_size=self.page_size, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim)

    @property
    def index_layout(self) -> IndexerFp8Layout:
        return IndexerFp8Layout(page_size=self.page_size, head_dim=self.index_head_dim)

    @property
    def layouts(self) -> dict[str, KVLayout]:
        """The pool layouts: ``"kv"`` (MLA latent) and ``"index"`` (indexer K)."""
        return {"kv": self.kv_layout, "index": self.index_layout}
