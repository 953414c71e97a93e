"""The GPU matrix's cells at FlashMLA's dims split by attention backend and indexer precision: how far FlashMLA and
Triton move the reference and the transformers models from the CPU torch run (``tests/test_gpu_matrix.py``).

Run from the repository root on a GPU machine: ``python benchmarks/scripts/gpu_matrix_flashmla_diag.py``; results of
2026-12-02: ``benchmarks/results/gpu_matrix_flashmla_h200x1_2026-12-02.md``.
"""

import sys
import time

sys.path.insert(0, "tests")
import test_gpu_matrix as M  # noqa: E402

from dtkv.integrations.transformers import indexer_precision  # noqa: E402

for model, dtype, kv, att, prec in [
    ("transformers", "float32", "fp8", "flashmla", "auto"),
    ("transformers", "float32", "fp8", "flashmla", "exact"),
    ("transformers", "float32", "fp8", "triton", "auto"),
    ("transformers", "float32", "bf16", "flashmla", "auto"),
    ("reference", "float64", "bf16", "flashmla", "auto"),
    ("reference", "float64", "bf16", "triton", "auto"),
    ("reference", "float64", "fp8", "flashmla", "auto"),
]:
    t0 = time.time()
    try:
        with indexer_precision(prec):
            fp8 = M._uses_fp8_indexer(model, kv, att) if prec == "auto" else False
            ref = M._reference(model, "flashmla", dtype, kv, "full", fp8)
            got = M._serve(
                M._adapter(model, "flashmla", dtype, kv, "cuda"),
                attention=att,
                decode_mode="full",
                teacher=ref["tokens"],
            )
        d, eq, margins = M._compare(ref["logits"], got["logits"])
        scale = float(ref["logits"].abs().max())
        worst = d.topk(4)
        print(
            f"{model} {dtype} kv={kv} {att} indexer={prec}(fp8={fp8}): max {float(d.max()):.3e} rel "
            f"{float(d.max()) / scale:.4f} mean {float(d.mean()):.3e} flips {len(margins)}/{d.numel()} "
            f"worst at {worst.indices.tolist()} {[round(v, 4) for v in worst.values.tolist()]} ({time.time() - t0:.0f}s)",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - a cell's error is printed, the others still run
        print(model, dtype, kv, att, prec, "ERROR", type(e).__name__, str(e)[:300], flush=True)
