"""The models ``bench_runtime.py`` serves, their FLOPs, and requests whose KV is already stored.

- :func:`build_transformers`: a transformers DeepSeek-V3.2 causal LM at DeepSeek-V3.2's attention dims
  (:data:`DSV32_ATTENTION`; hidden size, layers and routed experts chosen), built on the device directly with
  transformers' initialization skipped and every weight drawn afterwards on the device (seeded): a 61-layer model in
  seconds instead of a CPU initialization of minutes. :func:`reference_config`: the reference model
  (:class:`dtkv.model.ReferenceAdapter`) at FlashMLA's dims.
- :func:`transformers_flops`, :func:`reference_flops`: a prefill's FLOPs from the config, split as the roofline
  takes them (:func:`roofline_s`): ``gemm`` (2 x in x out per token for every projection -- ``kv_b_proj`` counts
  as its two absorbed products do -- the dense MLP or the router, the active routed experts and the shared ones,
  and the LM head on each step's last row), ``attention`` (``2 x index_topk x heads x (2 x kv_lora_rank + rope)``
  per query and layer) and ``indexer`` (``2 x visible keys x index_heads x index_head_dim`` per query and layer
  with an indexer; a query at position ``p`` sees ``p + 1`` keys).
- :func:`synthetic_requests`: decode requests of a given context whose pages hold random bytes in the stored
  formats, set up as :func:`dtkv.runtime.pd.receive_prefilled` sets up a received request (its pages from the
  runtime's allocator, ``num_computed`` and the first token): a batch of 16 x 128K tokens decodes without a
  2M-token prefill.
"""

from __future__ import annotations

import time

import torch

from dtkv import IndexerFp8Layout, MLAFp8Layout, MLALatentLayout
from dtkv._util import cdiv

__all__ = [
    "BF16_TFLOPS",
    "DSV32_ATTENTION",
    "FP8_TFLOPS",
    "build_transformers",
    "fill_pages",
    "reference_config",
    "reference_flops",
    "roofline_s",
    "synthetic_requests",
    "transformers_dims",
    "transformers_flops",
]

BF16_TFLOPS = 700.0
"""The roofline's rate for bf16 GEMMs and attention (one H200)."""
FP8_TFLOPS = 1400.0
"""The roofline's rate for the fp8 indexer (one H200)."""

DSV32_ATTENTION = {
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 2048, "vocab_size": 4096, "max_position_embeddings": 262144,
}  # fmt: skip
"""DeepSeek-V3.2's attention and indexer dims (the vocabulary cut to 4096: the LM head runs on one row a step)."""


def transformers_dims(*, layers: int, hidden: int, experts: int, active: int, smoke: bool) -> dict:
    """The config fields of the benchmark's model (``smoke``: :func:`tiny_config`'s tiny dims, ``layers`` deep)."""
    if smoke:
        return {"num_hidden_layers": layers}
    return {**DSV32_ATTENTION, "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden // 2, "n_routed_experts": experts, "num_experts_per_tok": active}  # fmt: skip


def build_transformers(dims: dict, *, device: torch.device, dtype: torch.dtype, init: str = "skip", seed: int = 0):
    """``(model, seconds)``: a ``DeepseekV32ForCausalLM`` of :func:`dtkv.integrations.transformers.tiny_config`
    with ``dims``, created on ``device`` in ``dtype`` (eval mode).

    ``init="skip"``: transformers' initialization is skipped and every weight drawn on the device afterwards
    (matrices ``N(0, initializer_range)``, norm weights 1, biases 0: what transformers' init gives, seeded);
    ``"default"``: transformers' own initialization (on the device).
    """
    import transformers
    from transformers.initialization import no_init_weights

    from dtkv.integrations.transformers import tiny_config

    cfg = tiny_config("deepseek-v32", **dims)
    cls = transformers.DeepseekV32ForCausalLM
    t0 = time.perf_counter()
    with torch.device(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        if init == "skip":
            with no_init_weights():
                lm = cls._from_config(cfg, dtype=dtype)
            _draw_weights(lm, seed, cfg.initializer_range)
        else:
            lm = cls._from_config(cfg, dtype=dtype)
    lm.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return lm, time.perf_counter() - t0


@torch.no_grad()
def _draw_weights(lm: torch.nn.Module, seed: int, std: float) -> None:
    dev = next(lm.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in lm.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=g)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)
    for name, b in lm.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


def reference_config(*, layers: int, smoke: bool, page_size: int):
    """The reference model at FlashMLA's dims (128 heads, latent 512 + rope 64, fp8 rows of 656 bytes, pages of
    64, top-k 2048); ``smoke``: its tiny defaults with fp8 rows."""
    from dtkv.model import ModelConfig

    if smoke:
        return ModelConfig(num_layers=layers, page_size=page_size, kv_dtype="fp8")
    return ModelConfig(num_layers=layers, num_heads=128, kv_lora_rank=512, rope_dim=64, quant_block=128,
                       page_size=page_size, kv_dtype="fp8", index_topk=2048)  # fmt: skip


def _visible(tokens: int) -> int:
    """Keys the queries of a ``tokens``-token prompt see in all: ``sum_p (p + 1)``."""
    return tokens * (tokens + 1) // 2


def transformers_flops(cfg, tokens: int, steps: int) -> dict[str, float]:
    """FLOPs of a ``tokens``-token prefill in ``steps`` chunks of a DeepSeek-V3.2 / GLM-5 config (module doc)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    ql = getattr(cfg, "q_lora_rank", None)
    ih, ij = cfg.index_n_heads, cfg.index_head_dim
    q = d * ql + ql * h * (nope + rope) if ql else d * h * (nope + rope)
    attn = q + d * (r + rope) + r * h * (nope + v) + h * v * d
    types = getattr(cfg, "indexer_types", None) or ["full"] * cfg.num_hidden_layers
    dense = getattr(cfg, "first_k_dense_replace", 0)
    per_token = 0
    indexer_layers = 0
    for layer in range(cfg.num_hidden_layers):
        per_token += attn
        if types[layer] == "full":
            indexer_layers += 1
            per_token += (ql or d) * ih * ij + d * ij + d * ih
        if layer < dense or not getattr(cfg, "n_routed_experts", 0):
            per_token += 3 * d * cfg.intermediate_size
        else:
            active = cfg.num_experts_per_tok + getattr(cfg, "n_shared_experts", 0)
            per_token += d * cfg.n_routed_experts + active * 3 * d * cfg.moe_intermediate_size
    return {
        "gemm": 2.0 * tokens * per_token + 2.0 * steps * d * cfg.vocab_size,
        "attention": 2.0 * cfg.num_hidden_layers * tokens * cfg.index_topk * h * (2 * r + rope),
        "indexer": 2.0 * indexer_layers * _visible(tokens) * ih * ij,
    }


def reference_flops(cfg, tokens: int, steps: int) -> dict[str, float]:
    """FLOPs of a ``tokens``-token prefill of the reference model (:class:`dtkv.model.TinyDSA`'s projections and
    MLP, its sparse attention and indexer), as :func:`transformers_flops` counts them."""
    d, h, r, e = cfg.d_model, cfg.num_heads, cfg.kv_lora_rank, cfg.rope_dim
    i, j = cfg.index_heads, cfg.index_head_dim
    per_token = d * (h * r + h * e + r + e + i * j + j + i) + h * r * d + 4 * d * d
    return {
        "gemm": 2.0 * tokens * cfg.num_layers * per_token + 2.0 * steps * d * cfg.vocab_size,
        "attention": 2.0 * cfg.num_layers * tokens * cfg.index_topk * h * (2 * r + e),
        "indexer": 2.0 * cfg.num_layers * _visible(tokens) * i * j,
    }


def roofline_s(flops: dict[str, float], cp: int = 1) -> float:
    """Seconds the FLOPs take at the roofline's rates on ``cp`` GPUs."""
    return ((flops["gemm"] + flops["attention"]) / BF16_TFLOPS + flops["indexer"] / FP8_TFLOPS) / 1e12 / cp


@torch.no_grad()
def fill_pages(pool, seed: int) -> None:
    """Random bytes in the stored formats in every page of ``pool`` (this rank's): fp8 codes without NaN, positive
    scales, normal bf16 rope and latent rows."""
    g = torch.Generator(device=pool.device).manual_seed(seed)
    for name, lay in pool.layouts.items():
        for layer in range(pool.num_layers):
            buf = pool.local(name, layer)
            if isinstance(lay, MLALatentLayout):
                buf.view(lay.dtype).normal_(0.0, 0.5, generator=g)
                continue
            buf.random_(0, 256, generator=g)
            if isinstance(lay, MLAFp8Layout):
                codes, rope = buf[..., : lay.kv_lora_rank], buf[..., lay.rope_offset :]
                buf[..., lay.scale_offset : lay.rope_offset].view(torch.float32).uniform_(2e-3, 4e-3, generator=g)
                rope.view(torch.bfloat16).normal_(generator=g)
            elif isinstance(lay, IndexerFp8Layout):
                codes = buf[:, : lay.scale_offset]
                buf[:, lay.scale_offset :].view(torch.float32).uniform_(2e-3, 4e-3, generator=g)
            else:
                raise TypeError(f"no random fill for layout {type(lay).__name__} of pool {name!r}")
            codes.masked_fill_((codes & 0x7F) == 0x7F, 0x7E)  # 0x7F / 0xFF are NaN in e4m3fn


def synthetic_requests(runtime, *, batch: int, context: int, seed: int) -> list:
    """``batch`` requests of ``context`` random tokens, each with its first generated token, whose KV pages hold
    random bytes (:func:`fill_pages`): ready for ``runtime.decode`` (SPMD: every rank the same calls).

    Set up as :func:`dtkv.runtime.pd.receive_prefilled` sets up a received request: the prompt is added, its pages
    come from the runtime's allocator (``alloc_balanced``, the same on every rank), then ``num_computed`` and the
    first token are set.
    """
    g = torch.Generator().manual_seed(seed)
    vocab, ps = runtime.model_spec.vocab_size, runtime.page_size
    reqs = []
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        req = runtime.add_request(prompt)
        req.pages = runtime.allocator.alloc_balanced(cdiv(context, ps)).tolist()
        req.num_computed = context
        req.output = [prompt[-1]]
        reqs.append(req)
    fill_pages(runtime.pool, seed + 1000 * runtime.pool.rank)
    return reqs
