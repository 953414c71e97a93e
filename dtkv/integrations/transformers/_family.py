"""Which transformers models the integration runs, their KV geometry, and the stored layouts it picks.

A *family* names the modeling module of a DSA model and the two RoPE functions its attention uses (the MLA
rope and the indexer rope: DeepSeek-V3.2's indexer rotates half-split pairs, GLM-5's interleaved pairs). The
*geometry* is read from the model's config; the layouts are dtkv's stored formats at those dims.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from dtkv._checks import check_int
from dtkv.layouts import IndexerFp8Layout, KVLayout, MLAFp8Layout, MLALatentLayout

__all__ = ["FAMILIES", "KV_DTYPES", "DSAFamily", "DSAGeometry", "KVDtype", "family_of", "geometry_of", "kv_layouts"]

KVDtype = Literal["bf16", "fp32", "fp8"]
KV_DTYPES: tuple[str, ...] = ("bf16", "fp32", "fp8")


@dataclass(frozen=True, kw_only=True, slots=True)
class DSAFamily:
    """A DSA model family of transformers (5.17)."""

    model_type: str
    """``config.model_type``."""
    module: str
    """The modeling module (imported on demand)."""
    causal_lm: str
    """Class name of the causal LM."""
    config_class: str
    """Class name of the config."""
    index_rope: str
    """Name of the indexer's rope function in :attr:`module`."""
    returns_topk: bool
    """The attention returns ``(out, weights, topk_indices)`` and reads ``prev_topk_indices`` (GLM's cross-layer
    top-k sharing), instead of ``(out, weights)``."""

    def modeling(self):
        return importlib.import_module(self.module)

    @property
    def mla_rope(self) -> Callable:
        """``apply_rotary_pos_emb_interleave``: the MLA rope of both families."""
        return self.modeling().apply_rotary_pos_emb_interleave

    @property
    def indexer_rope(self) -> Callable:
        return getattr(self.modeling(), self.index_rope)


FAMILIES: dict[str, DSAFamily] = {
    "deepseek_v32": DSAFamily(
        model_type="deepseek_v32",
        module="transformers.models.deepseek_v32.modeling_deepseek_v32",
        causal_lm="DeepseekV32ForCausalLM",
        config_class="DeepseekV32Config",
        index_rope="apply_rotary_pos_emb",
        returns_topk=False,
    ),
    "glm_moe_dsa": DSAFamily(
        model_type="glm_moe_dsa",
        module="transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
        causal_lm="GlmMoeDsaForCausalLM",
        config_class="GlmMoeDsaConfig",
        index_rope="apply_rotary_pos_emb_interleave",
        returns_topk=True,
    ),
}
"""The supported families, by ``config.model_type``."""


def family_of(model: torch.nn.Module) -> DSAFamily:
    """The :class:`DSAFamily` of a loaded causal LM.

    Raises:
        TypeError: ``model`` is not a ``DeepseekV32ForCausalLM`` or ``GlmMoeDsaForCausalLM``.
    """
    cfg = getattr(model, "config", None)
    fam = FAMILIES.get(getattr(cfg, "model_type", None))
    if fam is None or type(model).__name__ != fam.causal_lm:
        names = sorted(f.causal_lm for f in FAMILIES.values())
        raise TypeError(f"model must be one of {names} (a loaded transformers DSA model), got {type(model).__name__}")
    return fam


@dataclass(frozen=True, kw_only=True, slots=True)
class DSAGeometry:
    """The KV dims of a DSA model, from its config."""

    num_layers: int
    """Decoder layers (each has its own MLA latent cache)."""
    kv_lora_rank: int
    """Latent dims of a KV row."""
    rope_dim: int
    """Rotary dims kept beside the latent (``qk_rope_head_dim``)."""
    index_head_dim: int
    """Indexer key dims."""
    index_topk: int
    """Keys each query attends to."""
    indexer_layers: tuple[bool, ...]
    """Per layer, whether it runs its own indexer (GLM's ``"shared"`` layers reuse the previous top-k)."""
    vocab_size: int

    @property
    def quant_block(self) -> int:
        """Latent dims per fp8 scale: 128 when it divides ``kv_lora_rank`` (the real models), else the gcd."""
        return math.gcd(128, self.kv_lora_rank)


def geometry_of(model: torch.nn.Module) -> DSAGeometry:
    """Read the :class:`DSAGeometry` of a DSA causal LM (see :func:`family_of`).

    Raises:
        TypeError: not a supported model.
        ValueError: the first layer shares a top-k (``indexer_types[0] == "shared"``): there is none to share.
    """
    family_of(model)
    cfg = model.config
    types = getattr(cfg, "indexer_types", None) or ["full"] * cfg.num_hidden_layers
    indexer_layers = tuple(t == "full" for t in types[: cfg.num_hidden_layers])
    if not indexer_layers[0]:
        raise ValueError(f"indexer_types[0] must be 'full' (layer 0 has no top-k to share), got {list(types)}")
    return DSAGeometry(
        num_layers=cfg.num_hidden_layers,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        indexer_layers=indexer_layers,
        vocab_size=cfg.vocab_size,
    )


def kv_layouts(geometry: DSAGeometry, kv_dtype: KVDtype, page_size: int) -> dict[str, KVLayout]:
    """The pool layouts of a model: ``"kv"`` (MLA latent + rope) and ``"index"`` (indexer K).

    ======== ============================================= ==================================================
    kv_dtype ``"kv"``                                      ``"index"``
    ======== ============================================= ==================================================
    bf16     ``MLALatentLayout`` (bf16 rows)               bf16 rows (``MLALatentLayout`` of ``index_head_dim``
                                                           dims, no rope part)
    fp32     the same in float32 (lossless for float32     the same in float32
             models: isolates dtkv's arithmetic)
    fp8      ``MLAFp8Layout`` (e4m3 latent, fp32 scales    ``IndexerFp8Layout`` (e4m3 K, one fp32 scale a
             per ``quant_block`` dims, bf16 rope)          token, page-packed)
    ======== ============================================= ==================================================
    """
    check_int("page_size", page_size, min_value=1)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got kv_dtype={kv_dtype!r}")
    g = geometry
    if kv_dtype == "fp8":
        return {
            "kv": MLAFp8Layout(
                page_size=page_size, kv_lora_rank=g.kv_lora_rank, rope_dim=g.rope_dim, quant_block=g.quant_block
            ),
            "index": IndexerFp8Layout(page_size=page_size, head_dim=g.index_head_dim),
        }
    store = torch.bfloat16 if kv_dtype == "bf16" else torch.float32
    return {
        "kv": MLALatentLayout(page_size=page_size, kv_lora_rank=g.kv_lora_rank, rope_dim=g.rope_dim, store_dtype=store),
        "index": MLALatentLayout(page_size=page_size, kv_lora_rank=g.index_head_dim, rope_dim=0, store_dtype=store),
    }
