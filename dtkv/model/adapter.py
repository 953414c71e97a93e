"""``ReferenceAdapter``: the tiny DSA reference model (:class:`dtkv.model.TinyDSA`) as a runtime model adapter.

Per layer (:meth:`ReferenceAdapter.forward`): :meth:`TinyDSA.project` gives the latent row, the indexer key and the
queries; the rows go to ``ctx.write``; an extend step reads the full views and runs :meth:`TinyDSA.attend_view` per
request segment over its key-table rows (:attr:`dtkv.runtime.ExtendPlan.groups`) through the runtime's attention
backend, a sharded decode step calls
``ctx.decode_attention`` with the queries (the reference model's attention is MLA in absorbed form already:
``q_nope`` is ``[N, H, R]``); :meth:`TinyDSA.finish_layer` continues. Everything is float64 and rounded to the
stored formats (see :mod:`dtkv.model.model`).
"""

from __future__ import annotations

import torch

from dtkv.decode import DecodeQueries
from dtkv.kvio import read_rows
from dtkv.model.config import ModelConfig
from dtkv.model.model import TinyDSA
from dtkv.runtime import ModelAdapter, ModelSpec, StepContext

__all__ = ["ReferenceAdapter"]


class ReferenceAdapter(ModelAdapter):
    """The reference model of ``cfg`` (deterministic seeded weights) on ``device``.

    Attributes:
        cfg: the :class:`ModelConfig`.
        model: the :class:`TinyDSA` (weights and per-layer math).
        spec: its :class:`dtkv.runtime.ModelSpec` (``cfg.layouts``, heads, latent and rope dims, top-k).
    """

    def __init__(self, cfg: ModelConfig | None = None, device: torch.device | str = "cpu") -> None:
        self.cfg = ModelConfig() if cfg is None else cfg
        if not isinstance(self.cfg, ModelConfig):
            raise TypeError(f"cfg must be a dtkv.model.ModelConfig, got {type(self.cfg).__name__}")
        self.device = torch.device(device)
        self.model = TinyDSA(self.cfg, self.device)
        c = self.cfg
        self.spec = ModelSpec(
            layouts=c.layouts, num_layers=c.num_layers, vocab_size=c.vocab_size, index_topk=c.index_topk,
            num_heads=c.num_heads, kv_lora_rank=c.kv_lora_rank, rope_dim=c.rope_dim,
        )  # fmt: skip
        self.softmax_scale = self.model.softmax_scale

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "seed": self.cfg.seed, "d_model": self.cfg.d_model}

    def forward(self, ctx: StepContext) -> torch.Tensor:
        model, cfg = self.model, self.cfg
        h = model.embed_tokens(ctx.ids)
        positions = ctx.positions
        for layer in range(cfg.num_layers):
            q = model.project(layer, h, positions)
            ctx.write("kv", layer, q["kv"])
            ctx.write("index", layer, q["index_k"])
            if ctx.sharded_decode:
                queries = DecodeQueries(iq=q["iq"], iw=q["iw"], q_nope=q["q_nope"], q_rope=q["q_rope"])
                res = ctx.decode_attention(layer, queries, softmax_scale=self.softmax_scale, return_positions=False)
                attn = res.out.reshape(h.shape[0], -1)
            else:
                attn = self._attend(ctx, layer, q, h)
            h = model.finish_layer(layer, h, attn)
        return h

    def _attend(self, ctx: StepContext, layer: int, q: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """Sparse attention of this rank's rows over the step's full views, request segment by segment: the
        indexer's top-k (:meth:`TinyDSA.select`) over the dequantized index keys, then ``ctx.attention`` (the
        runtime's backend) over the stored MLA pages (:meth:`TinyDSA.attend_view`)."""
        cfg, plan = self.cfg, ctx.plan
        assert plan is not None, "an extend step's context holds its plan"
        views = ctx.views(layer, ("index", "kv"))
        index_keys = read_rows(views["index"], cfg.index_layout, torch.float64)
        attn = h.new_zeros((h.shape[0], cfg.num_heads * cfg.kv_lora_rank), dtype=torch.float64)
        queries = {k: v for k, v in q.items() if k not in ("kv", "index_k")}
        for req_i, lo, hi, kv_len in plan.groups:
            start = plan.key_indptr[req_i]
            rows = plan.key_slots[start : start + kv_len]
            qs = {k: v[lo:hi] for k, v in queries.items()}
            schedule = None
            if ctx.decoding:  # one query per request: the backend's decode kernel, its schedule kept across steps
                width = ctx.attention.index_width(min(cfg.index_topk, kv_len))
                schedule = ctx.decode_schedule(hi - lo, width)
            attn[lo:hi] = self.model.attend_view(
                qs, plan.positions[lo:hi], views["kv"], rows, index_keys[rows], ctx.attention, schedule
            )
        return attn

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float64 logits ``[m, V]``, each row summed in a fixed order (:meth:`TinyDSA.logits`)."""
        return self.model.logits(hidden)
