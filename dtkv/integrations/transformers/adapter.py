"""``TransformersAdapter``: a loaded transformers DSA model (DeepSeek-V3.2, GLM-5) as a runtime model adapter.

The model runs its own forward (``model.model``: embedding, decoder layers, norms, MoE, rotary embedding) over the
step's rows, with its attention modules bound to :func:`dtkv.integrations.transformers.dsa_attention`
(:meth:`TransformersAdapter.bind`, reversibly: :meth:`TransformersAdapter.close`); the runtime gathers the final
hidden states and the model's ``lm_head`` gives the logits. The MLA latent and the indexer key of every layer live
in the runtime's pools in the formats of :func:`dtkv.integrations.transformers.kv_layouts`.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from dtkv.integrations.transformers._compile import (
    compile_targets,
    compiled_function,
    install_compiled,
    uninstall_compiled,
)
from dtkv.integrations.transformers._family import KV_DTYPES, KVDtype, family_of, geometry_of, kv_layouts
from dtkv.integrations.transformers.attention import check_unbound, install, projections, uninstall
from dtkv.runtime import ModelAdapter, ModelSpec, StepContext

__all__ = ["TransformersAdapter"]


def _experts_graph_reason(impl: str | None, weight) -> str:
    """Why MoE experts of transformers' implementation ``impl`` with parameter ``weight`` (any of theirs; ``None``:
    no experts) cannot be captured in a CUDA graph (``""``: they can).

    ``"eager"`` walks the hit experts on the host. ``"grouped_mm"`` calls torch's grouped GEMM, whose CUDA kernels
    take bf16 only: with other weights its fallback copies the group offsets to the host (``offs.cpu()``), which a
    capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph capture", measured on an H200 with
    torch 2.11 and float32 weights). ``"batched_mm"`` gathers each token's expert weights on the device.
    """
    if weight is None:
        return ""
    if impl == "eager":
        return (
            "the model's MoE experts run transformers' 'eager' implementation, which synchronizes with the host: "
            "model.set_experts_implementation('batched_mm') (sync-free) lets them capture"
        )
    if impl == "grouped_mm" and weight.device.type == "cuda" and weight.dtype != torch.bfloat16:
        return (
            f"the model's MoE experts run transformers' 'grouped_mm' with {weight.dtype} weights, whose CUDA "
            "fallback copies the group offsets to the host (torch's grouped GEMM kernels take bf16 only): bf16 "
            "weights or model.set_experts_implementation('batched_mm') let them capture"
        )
    return ""


class TransformersAdapter(ModelAdapter):
    """A ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` (on this rank's device, eval mode, any dtype).

    Args:
        model: the causal LM; every rank of a CP group wraps the same weights.
        kv_dtype: stored formats (:func:`dtkv.integrations.transformers.kv_layouts`): ``"bf16"``, ``"fp32"`` or
            ``"fp8"``.
        page_size: tokens per KV page.
        compile_modules: run the model's per-layer norms and MLP / MoE blocks, and the attention's projections
            (:func:`dtkv.integrations.transformers.attention.projections`), compiled (``torch.compile``) in decode
            steps while bound (:mod:`dtkv.integrations.transformers._compile`: their elementwise kernels fused; the
            rest of the attention stays dtkv's ops, prefill steps stay eager); ``None`` (default): on for a model
            on CUDA, off elsewhere. The first decode step of each new shape compiles (seconds). A 61-layer
            DeepSeek-V3.2 at its attention dims, 32K context, batch 1, CUDA graphs: 25.1 ms a step against 32.3
            with the modules alone (one H200); 18.2 ms against 20.9 with the projections too (one H100).

    Attributes:
        model, family, geometry, layouts, kv_dtype: the model, its :class:`DSAFamily`, its :class:`DSAGeometry`,
            the pools' layouts and their name.
        compile_modules: the resolved switch (a bool).
        ctx: the step the bound attention runs in (``None`` between steps: the model runs its own forward).

    Raises:
        TypeError: ``model`` is not a supported DSA causal LM.
        ValueError: bad ``kv_dtype`` or ``page_size``, a first layer that shares a top-k, or ``model`` already wrapped
            by a runtime that was not closed.
        TypeError: ``compile_modules`` is not a bool or ``None``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        kv_dtype: KVDtype = "bf16",
        page_size: int = 64,
        compile_modules: bool | None = None,
    ) -> None:
        self.family = family_of(model)
        self.geometry = geometry_of(model)
        check_unbound(model)
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got kv_dtype={kv_dtype!r}")
        if compile_modules is not None and not isinstance(compile_modules, bool):
            raise TypeError(f"compile_modules must be a bool or None, got compile_modules={compile_modules!r}")
        self.model: Any = model  # a transformers causal LM (its config and submodules are dynamic attributes)
        self.kv_dtype = kv_dtype
        self.layouts = kv_layouts(self.geometry, kv_dtype, page_size)
        self.device = next(model.parameters()).device
        self.compile_modules = self.device.type == "cuda" if compile_modules is None else compile_modules
        self._compiled: list[torch.nn.Module] = []
        g, config = self.geometry, cast(Any, model).config
        self.spec = ModelSpec(
            layouts=self.layouts, num_layers=g.num_layers, vocab_size=g.vocab_size, index_topk=g.index_topk,
            num_heads=config.num_attention_heads, kv_lora_rank=g.kv_lora_rank, rope_dim=g.rope_dim,
        )  # fmt: skip
        self.ctx: StepContext | None = None
        self._masks = {t: None for t in config.layer_types}  # the replacement attention needs no mask

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "model_type": self.family.model_type, "kv_dtype": self.kv_dtype,
                "compile_modules": self.compile_modules}  # fmt: skip

    def graph_reason(self, decode_mode: str) -> str:
        """Why decode steps cannot be CUDA graphs (``""``: they can). transformers' ``"eager"`` MoE experts walk
        the hit experts on the host (a ``nonzero`` and a loop: a sync); ``"batched_mm"`` is sync-free, and so is
        ``"grouped_mm"`` (transformers 5.17's default) with bf16 weights only (:func:`_experts_graph_reason`). Dynamic
        and long RoPE read the largest position on the host. GLM-5 layers that reuse the previous layer's selection
        run sharded decode's float64 path, planned on the host."""
        why = self._experts_reason()
        if why:
            return why
        rope = getattr(getattr(self.model.model, "rotary_emb", None), "rope_type", "default")
        if isinstance(rope, str) and ("dynamic" in rope or rope == "longrope"):
            return f"the model's rotary embedding ({rope!r}) reads the largest position on the host"
        if decode_mode == "sharded" and not all(self.geometry.indexer_layers):
            return "sharded decode of layers that reuse the previous layer's selection runs the float64 path"
        return ""

    def _experts_reason(self) -> str:
        impl = getattr(self.model.config, "_experts_implementation", None)
        experts = [layer.mlp.experts for layer in self.model.model.layers if hasattr(layer.mlp, "experts")]
        return _experts_graph_reason(impl, next(experts[0].parameters(), None) if experts else None)

    def bind(self) -> None:
        """Bind the replacement attention to the model's attention modules, and with ``compile_modules`` the
        compiled forwards of its norms and MLP / MoE blocks and the attention's compiled projections."""
        if not self.compile_modules:
            install(self.model, self)
            return
        decoding = lambda: self.ctx is not None and self.ctx.decoding  # noqa: E731
        targets = compile_targets(self.model, moe_ok=not self._experts_reason())
        install(self.model, self, project=compiled_function(projections, when=decoding))
        try:
            install_compiled(targets, when=decoding)
        except BaseException:
            uninstall(self.model)
            raise
        self._compiled = targets

    def close(self) -> None:
        """Unbind the replacement attention and the compiled forwards (the model is then exactly as loaded)."""
        uninstall_compiled(self._compiled)
        self._compiled = []
        uninstall(self.model)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        self.ctx = ctx
        try:
            out = self.model.model(
                input_ids=ctx.ids[None], position_ids=ctx.positions[None], attention_mask=self._masks, use_cache=False
            )
            return out.last_hidden_state[0]
        finally:
            self.ctx = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's ``lm_head``, as float32 ``[m, V]``."""
        return self.model.lm_head(hidden).float()
