"""Availability and fit rules of each backend, checked up front (plan time), with errors that name the rule.

*Available* means the backend can run on the device at all (its package imports, the device type is right);
*fits* means a given :class:`AttentionSpec` meets its rules. The FlashMLA rules are those of the ``sgl-flash-mla``
1.0.0 wheel's SM90/SM100 kernels (``use_legacy=True``, the DeepSeek-V3.2 KV format; read from its interface, its
checks and deepseek-ai/FlashMLA's ``csrc/sm90`` sources):

==============================  ====================================================================================
rule                            why
==============================  ====================================================================================
64 or 128 query heads per rank  the kernels tile heads by 64 (``h_q == 64 || h_q == 128``); 16 heads per rank (128
                                heads over tensor-parallel 8) does not fit
kv_lora_rank 512, rope_dim 64   ``d_qk == 576``, ``d_v == 512``: the absorbed latent plus rope
fp8 pages: page_size 64         ``page_block_size must be 64`` (the fp8 decode kernel reads pages of 64 tokens)
fp8 pages: quant_block 128      the 656-byte row: 512 e4m3, 4 fp32 scales, 64 bf16 rope (:class:`dtkv.MLAFp8Layout`)
latent pages: bf16              ``kv must have dtype BFloat16`` (the bf16 sparse prefill kernel)
index width: multiple of 64     ``topk mod B_TOPK must be 0`` with ``B_TOPK = 64`` (the fp8 kernel's
(fp8), 128 (bf16 latent)        ``TOPK_BLOCK_SIZE``); the bf16 sparse prefill kernel needs ``topk % (2*B_TOPK) == 0``
                                (measured on an H200); :func:`dtkv.attention.sparse_indices` pads with ``-1``
CUDA, compute capability 9 / 10 SM90a (Hopper) and SM100f kernels only (tested on H200)
==============================  ====================================================================================

Triton: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), ``kv_lora_rank`` and ``rope_dim`` powers of two >= 16,
latent pages of bf16/fp16/fp32. Torch: every device and geometry.
"""

from __future__ import annotations

import functools

import torch

from dtkv.attention._spec import BACKENDS, AttentionFitError, AttentionSpec
from dtkv.layouts import MLAFp8Layout, MLALatentLayout
from dtkv.ops import HAS_TRITON
from dtkv.ops._common import INTERPRET

__all__ = [
    "B_TOPK",
    "FLASHMLA_HEADS",
    "FLASHMLA_INSTALL",
    "FLASHMLA_PAGE_SIZE",
    "availability",
    "check_fit",
    "fit_errors",
    "flashmla_module",
]

B_TOPK = 64
"""FlashMLA's top-k block: index widths must be a multiple of it."""
FLASHMLA_HEADS = (64, 128)
"""Query heads per rank FlashMLA's kernels take."""
FLASHMLA_PAGE_SIZE = 64
"""Tokens per page of FlashMLA's fp8 cache."""
FLASHMLA_INSTALL = "pip install --no-deps sgl-flash-mla==1.0.0"
"""How to install FlashMLA next to an existing torch (its metadata asks for torch>=2.14.1: ``--no-deps`` keeps the
installed torch; the wheel loads on torch 2.11+ through the stable ABI)."""


@functools.cache
def flashmla_module():
    """``(flash_mla module or None, why not)``: imported once; the legacy (SM90, V3.2-format) kernels must load."""
    try:
        import flash_mla
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError of a CUDA library that does not load
        return None, f"the flash_mla package does not import ({type(e).__name__}: {e}); install it with " + (
            f"`{FLASHMLA_INSTALL}`"
        )
    if not flash_mla.has_legacy():
        return None, "flash_mla imports but its legacy kernels (SM90, DeepSeek-V3.2 KV format) did not load"
    return flash_mla, ""


def availability(name: str, device: torch.device | str) -> str:
    """Why backend ``name`` cannot run on ``device`` at all (empty string: it can).

    Raises:
        ValueError: ``name`` is not a backend.
    """
    _check_name(name)
    dev = torch.device(device)
    if name == "torch":
        return ""
    if name == "triton":
        if not HAS_TRITON:
            return "the triton package does not import"
        if dev.type != "cuda" and not INTERPRET:
            return f"triton needs a CUDA device (or TRITON_INTERPRET=1 before dtkv.ops is imported), got {dev.type}"
        return ""
    if dev.type != "cuda":
        return f"flashmla needs a CUDA device, got {dev.type}"
    return flashmla_module()[1]


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def fit_errors(
    name: str,
    spec: AttentionSpec,
    *,
    device: torch.device | str | None = None,
    capability: tuple[int, int] | None = None,
) -> list[str]:
    """The rules of backend ``name`` that ``spec`` (and ``device``) break, one sentence each (empty: it fits).

    Args:
        name: ``"torch"``, ``"triton"`` or ``"flashmla"``.
        spec: the layer's heads per rank, KV layout and top-k.
        device: where attention runs; with a CUDA device, FlashMLA's compute-capability rule is checked too
            (``capability`` overrides what the device reports; None on CPU).
    """
    _check_name(name)
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    lay, errors = spec.layout, []
    if name == "triton":
        if not all(x >= 16 and x & (x - 1) == 0 for x in (spec.kv_lora_rank, spec.rope_dim)):
            errors.append(
                "triton needs kv_lora_rank and rope_dim to be powers of two >= 16, "
                f"got kv_lora_rank={spec.kv_lora_rank}, rope_dim={spec.rope_dim}"
            )
        if isinstance(lay, MLALatentLayout) and lay.store_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            errors.append(f"triton reads bf16/fp16/fp32 latent pages, got store_dtype={lay.store_dtype}")
    elif name == "flashmla":
        if spec.num_heads not in FLASHMLA_HEADS:
            errors.append(
                f"flashmla needs 64 or 128 query heads per rank, got num_heads={spec.num_heads} "
                "(heads per rank after any tensor-parallel split)"
            )
        if (spec.kv_lora_rank, spec.rope_dim) != (512, 64):
            errors.append(
                "flashmla needs kv_lora_rank=512 and rope_dim=64 (d_qk 576, d_v 512), "
                f"got kv_lora_rank={spec.kv_lora_rank}, rope_dim={spec.rope_dim}"
            )
        if isinstance(lay, MLAFp8Layout):
            if lay.page_size != FLASHMLA_PAGE_SIZE:
                errors.append(f"flashmla reads fp8 pages of page_size=64 only, got page_size={lay.page_size}")
            if lay.quant_block != 128:
                errors.append(
                    f"flashmla reads the 656-byte fp8 row (quant_block=128), got quant_block={lay.quant_block}"
                )
        elif lay.store_dtype != torch.bfloat16:
            errors.append(f"flashmla reads bf16 latent pages, got store_dtype={lay.store_dtype}")
        dev = None if device is None else torch.device(device)
        cap = capability if capability is not None else (None if dev is None else _capability(dev))
        if cap is not None and cap[0] not in (9, 10):
            errors.append(
                "flashmla's kernels run on compute capability 9.x (SM90, Hopper) or 10.x (SM100), "
                f"got {cap[0]}.{cap[1]}"
            )
    return errors


def check_fit(
    name: str,
    spec: AttentionSpec,
    *,
    device: torch.device | str | None = None,
    capability: tuple[int, int] | None = None,
) -> None:
    """Raise :class:`AttentionFitError` naming every rule of backend ``name`` that ``spec`` breaks.

    See :func:`fit_errors` for the arguments; the message is ``"attention does not fit '<name>': <rule>; <rule>"``.
    """
    errors = fit_errors(name, spec, device=device, capability=capability)
    if errors:
        raise AttentionFitError(f"attention does not fit {name!r}: " + "; ".join(errors))
