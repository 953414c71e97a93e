"""``bench_runtime.py`` with the prefill path's two one-pass ops switched off, for a same-lease A/B.

The transformers adapter's extend steps write the MLA query's rope with :func:`dtkv.ops.rope_interleave_into`
(:func:`dtkv.integrations.transformers.attention.fuses_query_rope`), and the FlashMLA backend's dequantized
prefill decodes fp8 pages with :func:`dtkv.ops.dequantize_mla_rows`. A variant turns either off in this process
and runs the benchmark's :func:`main` unchanged, its results in ``--out-dir``/``VARIANT``:

- ``both``: the shipped path;
- ``no-rope-op``: the query rotated by the model's rope in ``projections`` and copied into the query buffer;
- ``no-dequant-op``: the pages decoded by the op's torch reference (a float32 decode, then a rounding to bf16);
- ``neither``: both off.

    python benchmarks/scripts/runtime_ab.py --variant neither -- --graph --attention flashmla --phases prefill \\
        --adapters transformers --prefill 32768x8192,131072x8192 --no-kernels --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

VARIANTS = ("both", "no-rope-op", "no-dequant-op", "neither")


def apply(variant: str) -> None:
    """Switch off what ``variant`` names (module attributes of this process)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant in ("no-rope-op", "neither"):
        from dtkv.integrations.transformers import attention as hf_attention

        hf_attention.fuses_query_rope = lambda *args, **kwargs: False
    if variant in ("no-dequant-op", "neither"):
        import torch

        from dtkv.attention import _flashmla
        from dtkv.ops import dequantize_mla_rows

        def torch_rows(kv, layout):
            return dequantize_mla_rows(kv, layout, dtype=torch.bfloat16, backend="torch").unsqueeze(1)

        _flashmla._bf16_rows = torch_rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, choices=VARIANTS)
    ns = p.parse_args(argv[:split])
    rest = argv[split + 1 :]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import bench_runtime

    apply(ns.variant)
    if "--out-dir" not in rest:
        p.error("pass bench_runtime.py an --out-dir (the variant's results go to a folder of that name in it)")
    i = rest.index("--out-dir") + 1
    out = Path(rest[i]) / ns.variant
    out.mkdir(parents=True, exist_ok=True)
    rest[i] = str(out)
    rc = bench_runtime.main(rest)
    mark(out, ns.variant)
    return rc


def mark(out: Path, variant: str) -> None:
    """Name the variant in the results of ``out``: a ``variant`` key on every row, a line under the summary."""
    import json

    for path in out.glob("runtime_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(json.dumps({**r, "variant": variant}) + "\n" for r in rows))
    for path in out.glob("runtime_*.md"):
        with path.open("a") as f:
            f.write(
                f"\nRun through `benchmarks/scripts/runtime_ab.py --variant {variant}` ({VARIANTS_TEXT[variant]}).\n"
            )


VARIANTS_TEXT = {
    "both": "the shipped path",
    "no-rope-op": "the MLA query rotated in projections and copied, not written by dtkv::rope_interleave_into",
    "no-dequant-op": "fp8 pages decoded by dequantize_mla_rows' torch reference, not its kernel",
    "neither": "both one-pass ops off",
}


if __name__ == "__main__":
    sys.exit(main())
