"""Byte layouts of the stored KV formats: one frozen spec per format, one page per row of dim 0.

=====================  ===============================  ======================================  ============
spec                   local tensor per layer           one token / page                        bytes @ ps 64
=====================  ===============================  ======================================  ============
``MLALatentLayout``    ``[pages, ps, 576]`` bfloat16     512 latent + 64 rope, bf16               73 728 / page
``MLAFp8Layout``       ``[pages, ps, 656]`` uint8        ``[0,512)`` e4m3, ``[512,528)`` 4 fp32    41 984 / page
                                                         scales (one per 128 dims),
                                                         ``[528,656)`` 64 bf16 rope
``IndexerFp8Layout``   ``[pages, ps*132]`` uint8         ``[0, ps*128)`` e4m3 K (token t at        8 448 / page
                                                         ``t*128``), then ``ps`` fp32 scales
                                                         (token t at ``ps*128 + 4t``)
=====================  ===============================  ======================================  ============

Small dims (``kv_lora_rank``, ``rope_dim``, ``head_dim``, ``quant_block``) are parameters so the reference model
runs on CPU in seconds; the defaults are the DeepSeek-V3.2 / GLM-5 geometry. The fp8 scale of a block is
``amax / 448`` (e4m3's largest finite value), stored as fp32.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dtkv._checks import check_int

__all__ = ["FP8_E4M3_MAX", "IndexerFp8Layout", "KVLayout", "MLAFp8Layout", "MLALatentLayout", "total_page_bytes"]

FP8_E4M3_MAX = 448.0


@dataclass(frozen=True, kw_only=True, slots=True)
class KVLayout(ABC):
    """Base of the stored-format specs: a page is ``page_shape`` elements of ``dtype``."""

    page_size: int = 64
    """Tokens per page."""

    kind: ClassVar[str] = "abstract"

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, min_value=1)

    @property
    @abstractmethod
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page (dim 0 of a pool is pages)."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """Element dtype of the stored page."""

    @property
    def page_bytes(self) -> int:
        n = 1
        for s in self.page_shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def token_bytes(self) -> float:
        """Bytes per token (page bytes / page size)."""
        return self.page_bytes / self.page_size

    def describe(self) -> dict[str, object]:
        """Every field plus the kind: what startup checks compare across ranks."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {"kind": self.kind, **fields}


@dataclass(frozen=True, kw_only=True, slots=True)
class MLALatentLayout(KVLayout):
    """MLA latent KV stored unquantized: ``[pages, page_size, kv_lora_rank + rope_dim]`` of ``store_dtype``."""

    kv_lora_rank: int = 512
    """Latent (nope) dims."""
    rope_dim: int = 64
    """Rotary dims kept beside the latent."""
    store_dtype: torch.dtype = torch.bfloat16
    """Element dtype (bf16 by default)."""

    kind: ClassVar[str] = "mla_latent"

    def __post_init__(self) -> None:
        KVLayout.__post_init__(self)
        check_int("kv_lora_rank", self.kv_lora_rank, min_value=1)
        check_int("rope_dim", self.rope_dim, min_value=0)
        if not isinstance(self.store_dtype, torch.dtype) or not self.store_dtype.is_floating_point:
            raise TypeError(f"store_dtype must be a floating torch.dtype, got store_dtype={self.store_dtype!r}")

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.page_size, self.row_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.store_dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class MLAFp8Layout(KVLayout):
    """MLA latent KV as fp8 rows: e4m3 latent, one fp32 scale per ``quant_block`` dims, bf16 rope.

    Row of ``row_bytes = kv_lora_rank + 4 * kv_lora_rank // quant_block + 2 * rope_dim`` bytes (656 by default).
    """

    kv_lora_rank: int = 512
    """Latent dims, quantized to e4m3."""
    rope_dim: int = 64
    """Rope dims, kept in bf16."""
    quant_block: int = 128
    """Latent dims per fp32 scale; must divide ``kv_lora_rank``."""

    kind: ClassVar[str] = "mla_fp8"

    def __post_init__(self) -> None:
        KVLayout.__post_init__(self)
        check_int("kv_lora_rank", self.kv_lora_rank, min_value=1)
        check_int("rope_dim", self.rope_dim, min_value=0)
        check_int("quant_block", self.quant_block, min_value=1)
        if self.kv_lora_rank % self.quant_block:
            raise ValueError(
                "kv_lora_rank must be divisible by quant_block, "
                f"got kv_lora_rank={self.kv_lora_rank}, quant_block={self.quant_block}"
            )

    @property
    def num_scales(self) -> int:
        return self.kv_lora_rank // self.quant_block

    @property
    def scale_offset(self) -> int:
        return self.kv_lora_rank

    @property
    def rope_offset(self) -> int:
        return self.kv_lora_rank + 4 * self.num_scales

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_dim

    @property
    def row_dim(self) -> int:
        """Dims of the unquantized input row (``kv_lora_rank + rope_dim``)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.page_size, self.row_bytes)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexerFp8Layout(KVLayout):
    """NSA indexer K page: ``page_size * head_dim`` e4m3 bytes, then ``page_size`` fp32 scales (one per token).

    A page row is ``page_size * (head_dim + 4)`` bytes: 8448 at page 64, head_dim 128.
    """

    head_dim: int = 128
    """Indexer key dims (one fp32 scale per token covers them all)."""

    kind: ClassVar[str] = "indexer_fp8"

    def __post_init__(self) -> None:
        KVLayout.__post_init__(self)
        check_int("head_dim", self.head_dim, min_value=1)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scale block inside a page."""
        return self.page_size * self.head_dim

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.page_size * (self.head_dim + 4),)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8


def total_page_bytes(layouts: Mapping[str, KVLayout] | Iterable[KVLayout]) -> int:
    """Bytes of one page of each of ``layouts`` together (a pool's pages of one layer): what a page costs in every
    sizing rule (pools, scratch, transfer, capacity). A mapping's values count, any other iterable's items."""
    lays = layouts.values() if isinstance(layouts, Mapping) else layouts
    return sum(lay.page_bytes for lay in lays)
