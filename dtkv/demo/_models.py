"""The demo's models and prompts: the reference model, the tiny transformers models, or a checkpoint directory.

:class:`DemoModel` is what one process of the demo holds: the transformers model (loaded once, wrapped by one
runtime at a time) or the reference model's config, and :meth:`DemoModel.adapter` makes a fresh
:class:`dtkv.runtime.ModelAdapter` of it for a runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["DTYPES", "FLASHMLA_DIMS", "REFERENCE_FLASHMLA", "DemoModel", "load", "prompts", "vocab_of"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLASHMLA_DIMS = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
}
"""``--attention flashmla``: the tiny transformers models at FlashMLA's dims (pages of 64 tokens; the indexer's rope
of 64 dims needs more than 64 indexer dims)."""
REFERENCE_FLASHMLA = {"num_heads": 64, "kv_lora_rank": 512, "rope_dim": 64, "quant_block": 128}
"""``--attention flashmla``: the reference model at FlashMLA's dims."""


@dataclass
class DemoModel:
    """One process's model of the run."""

    name: str
    """``"reference"``, ``"deepseek-v32"``, ``"glm5"`` or the checkpoint directory."""
    kv_dtype: str
    page_size: int
    device: torch.device
    lm: Any = None
    """The transformers causal LM (``None`` for the reference model)."""
    cfg: Any = None
    """The reference model's :class:`dtkv.model.ModelConfig` (``None`` for transformers models)."""

    @property
    def reference(self) -> bool:
        return self.lm is None

    @property
    def dtype(self) -> str:
        """The model's dtype name (``"float64"`` for the reference model)."""
        if self.lm is None:
            return "float64"
        return {v: k for k, v in DTYPES.items()}.get(next(self.lm.parameters()).dtype, "float32")

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size if self.lm is None else int(self.lm.config.vocab_size)

    def adapter(self):
        """A fresh model adapter (the transformers model is bound by the runtime that gets it; close that first)."""
        if self.lm is None:
            from dtkv.model import ReferenceAdapter

            return ReferenceAdapter(self.cfg, self.device)
        from dtkv.integrations.transformers import TransformersAdapter

        return TransformersAdapter(self.lm, kv_dtype=self.kv_dtype, page_size=self.page_size)


def load(args: dict, device: torch.device) -> DemoModel:
    """The run's model on ``device`` (tiny models are seeded with ``--seed``; a directory goes through
    :func:`dtkv.integrations.transformers.load_model`)."""
    m = DemoModel(name=args["model"], kv_dtype=args["kv_dtype"], page_size=args["page_size"], device=device)
    if args["model"] == "reference":
        from dtkv.model import ModelConfig

        m.cfg = replace(ModelConfig(), page_size=args["page_size"], kv_dtype=args["kv_dtype"])
        if args.get("attention") == "flashmla":
            f = REFERENCE_FLASHMLA
            m.cfg = replace(m.cfg, num_heads=f["num_heads"], kv_lora_rank=f["kv_lora_rank"], rope_dim=f["rope_dim"],
                            quant_block=f["quant_block"])  # fmt: skip
        return m
    dtype = DTYPES[args["dtype"]] if args.get("dtype") else None
    if args["model"] in ("deepseek-v32", "glm5"):
        from dtkv.integrations.transformers import tiny_model

        flashmla = args.get("attention") == "flashmla"
        dims = FLASHMLA_DIMS if flashmla else {}
        default = torch.bfloat16 if flashmla else torch.float32  # FlashMLA attends in bf16: the model matches it
        m.lm = tiny_model(args["model"], seed=args["seed"], dtype=dtype or default, device=device, **dims)
    else:
        from dtkv.integrations.transformers import load_model

        m.lm = load_model(args["model"], device=device, dtype=dtype)
    return m


def vocab_of(args: dict) -> int:
    """The vocabulary of ``args``'s model without loading its weights."""
    if args["model"] == "reference":
        from dtkv.model import ModelConfig

        return ModelConfig().vocab_size
    if args["model"] in ("deepseek-v32", "glm5"):
        from dtkv.integrations.transformers import tiny_config

        return tiny_config(args["model"]).vocab_size
    from dtkv.demo._args import checkpoint_config

    cfg, error = checkpoint_config(args["model"])  # checked before any rank started: this is a usage error
    if cfg is None:
        raise ValueError(error)
    return int(cfg["vocab_size"])


def prompts(tokens: int, num_requests: int, vocab: int, seed: int) -> list[list[int]]:
    """``num_requests`` seeded prompts of ``tokens`` in all, lengths in the ratio ``n : n-1 : ... : 1``."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(num_requests, 0, -1, dtype=torch.float64)
    lens = (weights / weights.sum() * tokens).floor().long().clamp(min=1)
    lens[0] += tokens - int(lens.sum())
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lens]
