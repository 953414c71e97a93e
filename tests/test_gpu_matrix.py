"""Every mode on the GPU: ``Runtime`` with both adapters over model dtype x KV dtype x decode mode x attention,
each cell against the same model served on the CPU with the torch backend.

The grid: the tiny DeepSeek-V3.2 model (``TransformersAdapter``) in {bfloat16, float32} x KV {bf16, fp8} x decode
{full, sharded} x attention {torch, triton, flashmla}; the reference model (``ReferenceAdapter``, float64) x KV x
decode x attention. FlashMLA runs where it fits: the models at FlashMLA's dims (64 heads, ``kv_lora_rank`` 512,
rope 64, pages of 64 tokens: the demo's ``FLASHMLA_DIMS`` / ``REFERENCE_FLASHMLA``), as ``--attention flashmla``
runs them; torch and Triton at the tiny dims (pages of 16). A cell whose backend is not installed skips, saying so.

The reference of a cell: the same weights (built on the CPU and copied), KV dtype and decode mode on the CPU with the
torch backend, its every prompt position and decode step; where the cell scores with DeepSeek-V3.2's fp8 indexer
(fp8 index pages on triton or flashmla), the reference does too (``indexer_precision("fp8")``, the kernel's math on
the torch backend, as the demo's reference does). The GPU run is teacher-forced on the reference's greedy tokens, so
each step compares the same inputs. The rules, per position:

- the reference model (float64): on torch, greedy tokens equal at every position, logits within
  ``REFERENCE_RTOL`` of their scale (a KV element quantized from rows equal to the last bits may still land in the
  neighbouring code) and >= 99.9% of the stored KV bytes equal (``tests/test_model.py``); on triton the bounds of ``tests/test_attention_cuda.py``: the largest logit difference
  within ``LOGIT_TOL`` of the scale, at most ``MAX_FLIP_FRACTION`` of the positions choosing another token, each
  a near tie (the reference's margin within twice the largest difference);
- FlashMLA cells of the reference model and the float32 transformers model: :data:`FLASHMLA_BOUNDS` (largest and
  mean difference, flip fraction, each flip's reference margin). FlashMLA rounds queries, keys, probabilities and
  the output to bf16, and these small random models amplify that (index top-k 16: a moved score selects another
  key; fp8 indexer queries: a moved query lands in another code): on an H200 the same cells on Triton (float32
  math) moved by 7e-5 and 6.6% of the scale, FlashMLA by 5.8-7.9% and 31.6%. That FlashMLA over dtkv's pages reads
  what it should is tested bit for bit in ``tests/test_attention_cuda.py`` (a dtkv view against a replicated pool
  holding the same bytes), its accuracy at the op there too (``out`` within 1.5e-2 of the float32 reference);
- a float32 transformers model: on torch the demo's verdict (:func:`dtkv.demo._verdict.parity_of`: the tolerance
  and the fraction within it per KV dtype, no position above 1, tokens equal), on triton the bounds above;
- a bfloat16 transformers model is held to the noise its own bf16 rounding makes (as the demo holds a FlashMLA run
  to its rounded forward, :func:`dtkv.demo._verdict.rounded_attention_check`): ``base`` is the same weights in
  float32 on the CPU (teacher-forced alike) against the bf16 reference; the cell's mean difference at most
  ``ROUNDED_NOISE_RATIO`` times the base's, no position beyond ``max(1, the base's worst)``, a token flip only where
  the reference's margin is within the base's worst. Measured on CPU (the tiny model, Triton interpreter vs torch): the base is 0.10-0.21
  mean, 0.61-1.45 worst; triton moves the bf16 model by 0.05-0.09 mean, 0.55-0.73 worst (and a float32 model by
  4e-6-4e-5). A bf16 model this small is chaotic (MoE top-2 routing, index top-k, logits in bf16 steps): its
  cells catch gross errors only; the float32 and reference cells are the precise ones.

Each cell prints its numbers (``-s``). A GPU run: ``python -m pytest -m gpu`` (``benchmarks/gpu_flashmla.sh``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu

CHUNK = 64
STEPS = 3
PROMPT_LENS = (150, 61, 7)  # three chunks, one chunk, a request shorter than a page
REFERENCE_RTOL = 1e-3
LOGIT_TOL = {"reference": 0.05, "transformers": 0.15}
MAX_FLIP_FRACTION = 0.05
FLASHMLA_BOUNDS = {  # (max, mean, flip margin) relative to the logits' scale; flip fraction
    "reference": (0.12, 0.012, 0.06, 0.05),
    "transformers": (0.45, 0.06, 0.07, 0.12),
}
"""FlashMLA cells (see the module docstring): measured on an H200 (2026-12-02) at 5.8-7.9% max / 0.3-0.6% mean
(reference model, 0-1 flips in 227 positions, largest margin 3.1%) and 11.2-31.6% max / 1.1-3.0% mean (the float32
transformers model: 5 flips with bf16 pages, largest margin 4.75%; 19 with fp8 pages, largest margin 5.90%);
Triton at the same dims: 7e-5 and 6.6%."""
ROUNDED_NOISE_RATIO = 1.5
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _page_size(attention: str) -> int:
    return 64 if attention == "flashmla" else 16


def _skip_unavailable(attention: str) -> None:
    from dtkv.attention import availability

    why = availability(attention, "cuda")
    if why:
        pytest.skip(f"--attention {attention} is not available here: {why}")


@functools.cache
def _cpu_lm(dims: str, dtype: str):
    from dtkv.demo._models import FLASHMLA_DIMS
    from dtkv.integrations.transformers import tiny_model

    return tiny_model("deepseek-v32", seed=0, dtype=DTYPES[dtype], **(FLASHMLA_DIMS if dims == "flashmla" else {}))


@functools.cache
def _gpu_lm(dims: str, dtype: str):
    return copy.deepcopy(_cpu_lm(dims, dtype)).to("cuda")


def _adapter(model: str, dims: str, dtype: str, kv: str, device: str):
    page_size = 64 if dims == "flashmla" else 16
    if model == "reference":
        from dtkv.demo._models import REFERENCE_FLASHMLA
        from dtkv.model import ModelConfig, ReferenceAdapter

        cfg = replace(ModelConfig(num_layers=2), page_size=page_size, kv_dtype=kv)
        if dims == "flashmla":
            cfg = replace(cfg, **REFERENCE_FLASHMLA)
        return ReferenceAdapter(cfg, device)
    from dtkv.integrations.transformers import TransformersAdapter

    lm = _cpu_lm(dims, dtype) if device == "cpu" else _gpu_lm(dims, dtype)
    return TransformersAdapter(lm, kv_dtype=kv, page_size=page_size)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _serve(adapter, *, attention: str, decode_mode: str, teacher: list[list[int]] | None = None) -> dict:
    """Prefill then ``STEPS`` decode steps (teacher-forced on ``teacher``, the reference's greedy tokens per step);
    every position's logits ``[positions, V]`` (float32, CPU), the greedy tokens per step, the stored KV bytes."""
    from dtkv.runtime import Runtime, num_pages_for

    prompts = _prompts(adapter.spec.vocab_size)
    page_size = adapter.spec.page_size
    pages = num_pages_for([len(p) for p in prompts], page_size=page_size, decode_steps=STEPS)
    with Runtime(adapter, num_pages=pages, attention=attention, decode_mode=decode_mode) as rt:
        assert rt.attention.name == attention
        for p in prompts:
            rt.add_request(p)
        first, logits = rt.prefill(CHUNK, return_logits=True)
        rows, tokens = [torch.cat(logits).float().cpu()], [list(first)]
        if teacher is not None:
            for r, t in zip(rt.requests, teacher[0]):
                r.output[0] = t
        for s in range(STEPS):
            step = rt.decode_step(rt.requests).float().cpu()
            rows.append(step)
            tokens.append(step.argmax(-1).tolist())
            nxt = tokens[-1] if teacher is None else teacher[s + 1]
            for r, t in zip(rt.requests, nxt):
                r.output.append(int(t))
        kv = [rt.kv_bytes(r.rid) for r in rt.requests]
    return {"logits": torch.cat(rows), "tokens": tokens, "kv": kv}


@functools.cache
def _reference(model: str, dims: str, dtype: str, kv: str, decode_mode: str, fp8_indexer: bool) -> dict:
    """The cell's reference: the same model on the CPU with the torch backend (cached per cell family), on the fp8
    indexer's math where the cell scores with it."""
    torch.set_num_threads(max(1, min(8, torch.get_num_threads())))
    adapter = _adapter(model, dims, dtype, kv, "cpu")
    if model == "reference":
        return _serve(adapter, attention="torch", decode_mode=decode_mode)
    from dtkv.integrations.transformers import indexer_precision

    with indexer_precision("fp8" if fp8_indexer else "exact"):
        return _serve(adapter, attention="torch", decode_mode=decode_mode)


@functools.cache
def _bf16_noise(dims: str, kv: str, decode_mode: str, fp8_indexer: bool) -> torch.Tensor:
    """The float32 weights' logits on the CPU, teacher-forced on the bfloat16 reference's tokens: how far the bf16
    model's own rounding is from float32 at every position of the bf16 reference."""
    from dtkv.integrations.transformers import indexer_precision

    teacher = _reference("transformers", dims, "bfloat16", kv, decode_mode, fp8_indexer)["tokens"]
    with indexer_precision("fp8" if fp8_indexer else "exact"):
        run = _serve(_adapter("transformers", dims, "float32", kv, "cpu"), attention="torch", decode_mode=decode_mode,
                     teacher=teacher)  # fmt: skip
    return run["logits"]


def _uses_fp8_indexer(model: str, kv: str, attention: str) -> bool:
    if model == "reference":
        return False
    from dtkv.integrations.transformers import uses_fp8_indexer
    from dtkv.layouts import IndexerFp8Layout

    return uses_fp8_indexer(attention, IndexerFp8Layout(page_size=16) if kv == "fp8" else None)


def _compare(ref: torch.Tensor, got: torch.Tensor):
    """Per position: max ``|logit diff|``, whether the greedy tokens all agree, the reference margins of flips."""
    diffs = (ref - got).abs().amax(-1)
    a, b = ref.argmax(-1), got.argmax(-1)
    flips = torch.nonzero(a != b).flatten().tolist()
    margins = [float(ref[i, a[i]] - ref[i, b[i]]) for i in flips]
    return diffs, not flips, margins


def _check_rounded(ref: torch.Tensor, got: torch.Tensor, tol_rel: float, what: str) -> None:
    """The bounds of tests/test_attention_cuda.py for a backend that rounds attention to bf16."""
    diffs, _, margins = _compare(ref, got)
    diff, scale = float(diffs.max()), float(ref.abs().max())
    print(f"\n{what}: max |logit diff| {diff:.3e} ({diff / scale:.2%} of {scale:.3f}), {len(margins)} flips in "
          f"{ref.shape[0]} positions, margins {[round(m, 4) for m in margins[:8]]}")  # fmt: skip
    assert diff <= tol_rel * scale, (what, diff, scale)
    assert len(margins) <= max(1, MAX_FLIP_FRACTION * ref.shape[0]), (what, margins)
    assert all(m <= 2 * diff for m in margins), (what, margins)


def _check_flashmla(ref: torch.Tensor, got: torch.Tensor, bounds: tuple[float, float, float, float], what: str) -> None:
    """FlashMLA against the float32 reference: its bf16 queries, keys, probabilities and output, amplified by a small
    random model whose index top-k (16 of up to 153 keys) turns a moved score into another key."""
    max_rel, mean_rel, margin_rel, flip_fraction = bounds
    diffs, _, margins = _compare(ref, got)
    diff, mean, scale = float(diffs.max()), float(diffs.mean()), float(ref.abs().max())
    print(f"\n{what}: max |logit diff| {diff:.3e} ({diff / scale:.2%} of {scale:.3f}), mean {mean:.3e} "
          f"({mean / scale:.2%}), {len(margins)} flips in {ref.shape[0]} positions, largest margin "
          f"{max(margins, default=0.0) / scale:.2%}, margins {[round(m, 4) for m in margins[:8]]}")  # fmt: skip
    assert diff <= max_rel * scale, (what, diff, scale)
    assert mean <= mean_rel * scale, (what, mean, scale)
    assert len(margins) <= max(1, flip_fraction * ref.shape[0]), (what, margins)
    assert all(m <= margin_rel * scale for m in margins), (what, margins, scale)


def _check_bf16(ref: torch.Tensor, got: torch.Tensor, base: torch.Tensor, what: str) -> None:
    """A bfloat16 model against the noise of its own rounding (``base``: the float32 weights' run, same reference)."""
    diffs, _, margins = _compare(ref, got)
    base_diffs = (ref - base).abs().amax(-1)
    mean, base_mean = float(diffs.mean()), float(base_diffs.mean())
    worst, base_worst = float(diffs.max()), float(base_diffs.max())
    print(f"\n{what}: mean |logit diff| {mean:.3e} vs bf16 rounding's {base_mean:.3e}, max {worst:.3e} vs "
          f"{base_worst:.3e}, {len(margins)} flips in {ref.shape[0]} positions, margins "
          f"{[round(m, 4) for m in margins[:8]]}")  # fmt: skip
    assert mean <= ROUNDED_NOISE_RATIO * base_mean + 1e-6, (what, mean, base_mean)
    assert worst <= max(1.0, base_worst), (what, worst, base_worst)
    assert all(m <= base_worst for m in margins), (what, margins, base_worst)


def _cell(model: str, dtype: str, kv: str, decode_mode: str, attention: str) -> None:
    _skip_unavailable(attention)
    dims = "flashmla" if attention == "flashmla" else "tiny"
    fp8_indexer = _uses_fp8_indexer(model, kv, attention)
    ref = _reference(model, dims, dtype, kv, decode_mode, fp8_indexer)
    got = _serve(_adapter(model, dims, dtype, kv, "cuda"), attention=attention, decode_mode=decode_mode,
                 teacher=ref["tokens"])  # fmt: skip
    what = f"{model} {dtype if model != 'reference' else 'float64'} KV {kv}, {decode_mode} decode, {attention}"
    assert got["logits"].shape == ref["logits"].shape
    assert torch.isfinite(got["logits"]).all(), f"{what}: non-finite logits"
    if dtype == "bfloat16":
        _check_bf16(ref["logits"], got["logits"], _bf16_noise(dims, kv, decode_mode, fp8_indexer), what)
        return
    if attention == "flashmla":
        _check_flashmla(ref["logits"], got["logits"], FLASHMLA_BOUNDS[model], what)
        return
    if attention != "torch":
        _check_rounded(ref["logits"], got["logits"], LOGIT_TOL["reference" if model == "reference" else "transformers"],
                       what)  # fmt: skip
        return
    diffs, tokens_equal, margins = _compare(ref["logits"], got["logits"])
    if model == "reference":
        scale = float(ref["logits"].abs().max())
        same = sum(int((a[n] == b[n]).sum()) for a, b in zip(ref["kv"], got["kv"]) for n in a)
        total = sum(a[n].numel() for a in ref["kv"] for n in a)
        print(f"\n{what}: max |logit diff| {float(diffs.max()):.3e} of {scale:.3f}, KV bytes equal "
              f"{same / total:.5f}, tokens equal {tokens_equal}")  # fmt: skip
        assert tokens_equal, (what, margins)
        assert float(diffs.max()) <= REFERENCE_RTOL * scale, (what, float(diffs.max()), scale)
        assert same / total >= 0.999, (what, same / total)
        return
    from dtkv.demo._verdict import parity_of

    v = parity_of(dtype, kv, diffs, tokens_equal, margins)
    print(f"\n{what}: max |logit diff| {v['max_abs_logit_diff']:.3e}, within {v['tolerance']:g} at "
          f"{v['within_tolerance']:.3f} (>= {v['min_within_tolerance']}), flips {v['token_flips']}")  # fmt: skip
    assert v["parity"], (what, v)


ATTENTION = ["torch", "triton", "flashmla"]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_transformers_model_on_the_gpu_matches_the_cpu_torch_run(dtype, kv, decode_mode, attention):
    pytest.importorskip("transformers", reason="the hf extra (transformers==5.17.0)")
    _cell("transformers", dtype, kv, decode_mode, attention)


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("decode_mode", ["full", "sharded"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_reference_model_on_the_gpu_matches_the_cpu_torch_run(kv, decode_mode, attention):
    _cell("reference", "float64", kv, decode_mode, attention)
