"""The reference the integration is compared with: the model's own forward, with one documented patch.

transformers 5.17's DSA indexer ends with ``index_scores.topk(topk, dim=-1)``. Index scores are
``sum_h w_h * relu(q_h . k)``, so every key for which all indexer heads' dot products are negative scores
exactly ``0.0``, and such exact ties are common (with 4 indexer heads about one key in 16). ``torch.topk`` breaks
ties in an unspecified order that depends on the row length, so which tied keys a query keeps changes with the
total length of the forward and with chunking against a cache: :func:`stable_topk` replaces that one call, for
the indexers of one model and only inside the ``with`` block, by a stable sort (highest score first, ties to
the lowest position), the rule :func:`dtkv.integrations.transformers.dsa_attention` implements. Nothing else of
the model changes. See :mod:`dtkv.integrations.transformers` for the measurements and a minimal repro.

Also here: :func:`tiny_config` / :func:`tiny_model`, the small random DSA models of the tests, demo and
tutorial (built on CPU in well under a second, no download), and :func:`reference_logits`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from dtkv.integrations.transformers._family import FAMILIES, family_of
from dtkv.kvio import round_trip
from dtkv.layouts import IndexerFp8Layout, KVLayout

__all__ = ["MODEL_TYPES", "reference_logits", "stable_topk", "tiny_config", "tiny_model"]

MODEL_TYPES: dict[str, str] = {"deepseek-v32": "deepseek_v32", "glm5": "glm_moe_dsa"}
"""Short names (as ``python -m dtkv.demo --model`` takes them) -> ``config.model_type``."""


class _StableTopk(TorchFunctionMode):
    """An indexer's forward as the parity reference runs it (one instance per call).

    Always: ``Tensor.topk`` / ``torch.topk`` become a stable descending sort (ties to the lower index). The
    indexer's score product -- the ``torch.matmul`` whose left operand is the queries ``[..., heads, head_dim]``
    and whose right operand is the keys ``[..., head_dim, T]`` (transformers 5.17 to 5.24 score with it) -- may also
    read its operands as dtkv holds them: ``fp8_queries`` rounds the queries as the fp8 indexer takes them,
    ``key_layout`` gives the keys back as a pool of that layout stores them (:func:`dtkv.kvio.round_trip` of the
    keys in ``key_dtype``, the dtype the model computes them in). No argument of the model's forward is involved:
    the model runs without a cache, as loaded.
    """

    def __init__(
        self,
        scores: tuple[int, int],
        *,
        fp8_queries: bool = False,
        key_layout: KVLayout | None = None,
        key_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.scores, self.fp8_queries, self.key_layout, self.key_dtype = scores, fp8_queries, key_layout, key_dtype

    def _score_product(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        heads, dim = self.scores
        return q.dim() >= 2 and tuple(q.shape[-2:]) == (heads, dim) and k.dim() >= 2 and k.shape[-2] == dim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.matmul and len(args) == 2 and (self.fp8_queries or self.key_layout is not None):
            q, k = args
            if self._score_product(q, k):
                if self.fp8_queries:
                    q = round_trip(q.float(), IndexerFp8Layout(page_size=1, head_dim=q.shape[-1]))
                if self.key_layout is not None:  # rows of head_dim: the keys' own dtype, stored, read back
                    rows = k.transpose(-1, -2).to(self.key_dtype)
                    k = round_trip(rows, self.key_layout).to(k.dtype).transpose(-1, -2)
                return func(q, k, **kwargs)
        if func is torch.Tensor.topk or func is torch.topk:
            x, k = args[0], args[1] if len(args) > 1 else kwargs.pop("k")
            dim = args[2] if len(args) > 2 else kwargs.pop("dim", -1)
            largest = args[3] if len(args) > 3 else kwargs.pop("largest", True)
            values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
            return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def stable_topk(
    model: torch.nn.Module, *, layouts: Mapping[str, KVLayout] | None = None, fp8_indexer: bool = False
) -> Iterator[torch.nn.Module]:
    """Inside the block, ``model`` runs as the parity reference (module docstring); outside, as loaded.

    Always: the DSA indexers break top-k ties by position. With ``layouts`` (``{"kv": ..., "index": ...}``,
    as :func:`dtkv.integrations.transformers.kv_layouts` gives them), the model also reads its keys as those
    stored formats hold them: the MLA latent row ``[kv_a_layernorm(kv), rope(k_rot)]`` goes through
    :func:`dtkv.kvio.round_trip` before ``expand_kv`` and the indexer key (after its rope) before scoring. That is the
    model with its KV cache in the pools' formats (an identity for fp32 KV of a float32 model). ``fp8_indexer``
    (with fp8 index pages, for a run that :func:`dtkv.integrations.transformers.attention.uses_fp8_indexer`):
    the indexer is DeepSeek-V3.2's fp8 one as dtkv runs it, its queries (after their rope) rounded per (token,
    head) to e4m3 too (:func:`dtkv.kvio.round_trip` through an :class:`dtkv.IndexerFp8Layout`, bitwise
    :func:`dtkv.integrations.transformers.attention.fp8_indexer_queries`).

    The wraps are instance attributes of the attention and indexer modules, removed on exit; every other
    module, and every other model, is untouched.
    """
    family_of(model)
    wrapped = []
    for layer in model.model.layers:
        attn = layer.self_attn
        indexer = getattr(attn, "indexer", None)
        if indexer is not None:
            original = type(indexer).forward.__get__(indexer)
            mode = dict(
                scores=(indexer.n_heads, indexer.head_dim), fp8_queries=fp8_indexer,
                key_layout=None if layouts is None else layouts["index"], key_dtype=indexer.wk.weight.dtype,
            )  # fmt: skip

            def forward(*args, _original=original, _mode=mode, **kwargs):
                with _StableTopk(**_mode):
                    return _original(*args, **kwargs)

            indexer.forward = forward
            wrapped.append((indexer, "forward"))
        if layouts is not None:
            expand = type(attn).expand_kv.__get__(attn)
            r = attn.kv_lora_rank

            def expand_kv(kv_nope, k_rot, _expand=expand, _r=r):
                row = round_trip(torch.cat((kv_nope, k_rot), dim=-1), layouts["kv"])
                return _expand(row[..., :_r], row[..., _r:])

            attn.expand_kv = expand_kv
            wrapped.append((attn, "expand_kv"))
    try:
        yield model
    finally:
        for module, name in wrapped:
            module.__dict__.pop(name, None)


@torch.no_grad()
def reference_logits(
    model: torch.nn.Module,
    token_ids: Sequence[int],
    *,
    layouts: Mapping[str, KVLayout] | None = None,
    rounded_probabilities: bool = False,
    fp8_indexer: bool = False,
) -> torch.Tensor:
    """The model's own full forward over one sequence under :func:`stable_topk`: float32 ``[len(ids), V]``.

    Teacher-forced over a prompt followed by greedily generated tokens, ``argmax`` of row ``p`` is the model's
    greedy choice after position ``p``: one forward gives the reference of a whole prefill + decode.
    ``layouts``: read keys as these stored formats hold them (see :func:`stable_topk`).
    ``rounded_probabilities``: attention as a half-precision kernel computes it -- transformers' eager attention,
    whose softmax probabilities are rounded to the model's dtype before they multiply V (FlashMLA and SDPA's fused
    kernels do the same) -- instead of :func:`float32_attention`; the two differ by what that rounding costs.
    ``fp8_indexer``: the indexer's queries in fp8 too (see :func:`stable_topk`).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=device)
    if not rounded_probabilities:
        with stable_topk(model, layouts=layouts, fp8_indexer=fp8_indexer), float32_attention():
            return model(input_ids=ids, use_cache=False).logits[0].float()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        with stable_topk(model, layouts=layouts, fp8_indexer=fp8_indexer):
            return model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        config._attn_implementation = before


def float32_attention() -> contextlib.AbstractContextManager:
    """SDPA's math backend inside the block: half-precision attention computed in float32, rounded once.

    That is what :func:`dtkv.integrations.transformers.dsa_attention` computes. SDPA's fused CUDA kernels
    round the probabilities to the input dtype before multiplying by V; in a bfloat16 model that alone moves the
    logits of these small random models as much as swapping SDPA for the eager attention does (mean 0.09,
    greedy choices change at ~14% of the positions, measured on CPU and H200), so it would hide what a
    comparison is for. Float32 models are unaffected.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def tiny_config(model: str, **overrides):
    """A small DSA config (transformers config object) for ``model`` in :data:`MODEL_TYPES` or a model_type.

    Hidden 256, 3 layers (the first dense, then MoE with 4 routed experts, top 2, one shared; ``n_group=1``,
    ``topk_group=1``), 4 heads, ``q_lora_rank=64``, ``kv_lora_rank=64``, rope 16, nope 32, v 32, indexer
    4 heads x 32 dims, ``index_topk=16``, vocabulary 256. ``overrides`` replace any field.
    """
    model_type = MODEL_TYPES.get(model, model)
    if model_type not in FAMILIES:
        raise ValueError(f"model must be one of {sorted(MODEL_TYPES)} or {sorted(FAMILIES)}, got model={model!r}")
    import transformers

    fields = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=8192,
    )
    fields.update(overrides)
    return getattr(transformers, FAMILIES[model_type].config_class)(**fields)


def tiny_model(
    model: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **overrides,
) -> torch.nn.Module:
    """A random-weight DSA causal LM of :func:`tiny_config`, in eval mode (deterministic in ``seed``).

    The global RNG state is left as it was.
    """
    import transformers

    cfg = tiny_config(model, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = getattr(transformers, FAMILIES[cfg.model_type].causal_lm)(cfg)
    return lm.to(device=device, dtype=dtype).eval()
