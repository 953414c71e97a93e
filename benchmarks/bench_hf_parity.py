"""Parity of transformers DSA models on dtkv over a real process group (one torchrun job), written to a results file.

For every case of the grid (models x splits x KV dtypes x page sizes x model dtypes) each rank runs the same tiny
random model in a :class:`dtkv.runtime.Runtime` (:class:`dtkv.integrations.transformers.TransformersAdapter`), runs chunked CP prefill of several
requests and greedy decode, and rank 0 compares every prompt and decode logit with the model's own forward
(the reference of :mod:`dtkv.integrations.transformers`), as ``python -m dtkv.demo --model ...`` does. Rank 0
writes ``benchmarks/results/hf_parity_<device>_<date>.md`` (a table with versions and the command) and a
``.jsonl`` twin with every field.

Usage, from the repository root (2 GPUs, NCCL; a few minutes, mostly Triton JIT and the reference forwards)::

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/bench_hf_parity.py --device cuda

CPU/gloo works the same (``--device cpu``, slower). ``--dtypes bfloat16`` restricts the model dtypes (default:
``bfloat16,float32``; float32 matmuls on CUDA do not use TF32 unless asked, so float32 rows give the tight check).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtkv._log import Progress, setup_cli_logging
from dtkv.demo._launch import json_all_gather
from dtkv.demo._report import summary
from dtkv.demo._run import run_rank

ROOT = Path(__file__).resolve().parent


def _versions(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }


def _table(rows: list[dict]) -> str:
    head = (
        "| model | dtype | KV | split | page | cp | parity | tokens equal (flips, max margin) | max abs logit diff | within tol | tol "
        "| full-precision diff | KV bytes/rank | replicated | seconds |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = [
        f"| {r['model']} | {r['dtype']} | {r['kv_dtype']} | {r['split']} | {r['page_size']} | {r['cp']} "
        f"| {r['parity']} | {r['tokens_equal']} ({r.get('token_flips', 0)}, {r.get('max_flip_margin', 0.0):.2e}) "
        f"| {r['max_abs_logit_diff']:.2e} | {100 * r['within_tolerance']:.1f}% "
        f"| {r['tolerance']:.0e} | {r['max_abs_logit_diff_full_precision']:.2e} | {r['kv_bytes_per_rank']} "
        f"| {r['kv_bytes_replicated']} | {r['seconds_sharded']:.2f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dtypes", default="bfloat16,float32", help="model dtypes, comma-separated")
    p.add_argument("--models", default="deepseek-v32,glm5")
    p.add_argument("--splits", default="zigzag,round_robin")
    p.add_argument("--kv-dtypes", default="bf16,fp8")
    p.add_argument("--page-sizes", default="1,16,64")
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "results"), help="directory of the results files")
    ns = p.parse_args()
    setup_cli_logging()
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        print(
            "error: run under torchrun (e.g. torchrun --nproc-per-node 2 benchmarks/bench_hf_parity.py)",
            file=sys.stderr,
        )
        return 2
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if ns.device == "cuda":
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if ns.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if ns.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=600))
    meta = dist.new_group(backend="gloo") if ns.device == "cuda" else dist.group.WORLD
    group = dist.group.WORLD if world > 1 else None
    rows, failed = [], 0
    grid = itertools.product(
        ns.models.split(","), ns.dtypes.split(","), ns.splits.split(","), ns.kv_dtypes.split(","),
        [int(x) for x in ns.page_sizes.split(",")],
    )  # fmt: skip
    grid = list(grid)
    cases = Progress("parity case", total=len(grid))
    t0 = time.perf_counter()
    for model, dtype, split, kv_dtype, page_size in grid:
        cases.step(f"{model} {dtype} {split} {kv_dtype} page size {page_size}")
        args = {
            "model": model, "dtype": dtype, "split": split, "kv_dtype": kv_dtype, "page_size": page_size,
            "tokens": ns.tokens, "requests": ns.requests, "chunk": ns.chunk, "decode_steps": ns.decode_steps,
            "seed": 0, "cp": world, "decode": "full", "attention": "torch", "multi_turn": False,
            "device": ns.device,
        }  # fmt: skip
        try:
            result = run_rank(rank, world, args, group, device)
        except Exception as e:  # a case that fails is reported, the grid goes on only if every rank got here
            result = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
        results = json_all_gather(result, meta)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            failed += 1
            if rank == 0:
                print(f"{model} {dtype} {split} {kv_dtype} ps{page_size}: FAILED {errors[0]}", flush=True)
            continue
        row = summary(args, results, 0.0, None)
        row["dtype"] = dtype
        rows.append(row)
        failed += not row["parity"]
        if rank == 0:
            print(
                f"{model} {dtype} {split} {kv_dtype} ps{page_size} cp{world}: parity {row['parity']} "
                f"max {row['max_abs_logit_diff']:.2e} within {row['within_tolerance']:.3f}",
                flush=True,
            )
    wall = time.perf_counter() - t0
    if rank == 0:
        day = datetime.date.today().isoformat()
        info = _versions(device)
        slug = "h200" if "H200" in info["device"] else ns.device
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"hf_parity_{slug}_{day}"
        cmd = "torchrun --nproc-per-node {} benchmarks/bench_hf_parity.py {}".format(world, " ".join(sys.argv[1:]))
        text = (
            f"# transformers DSA models on dtkv: parity with the model's own forward -- {day}\n\n"
            f"- **Command**: `{cmd}`\n"
            f"- **Hardware**: {world} x {info['device']} ({'NCCL' if ns.device == 'cuda' else 'gloo'})\n"
            f"- **Software**: torch {info['torch']}, transformers {info['transformers']}, Triton {info['triton']}, "
            f"Python {info['python']}\n"
            f"- **Runs**: tiny random models (`tiny_model`), {ns.requests} requests / {ns.tokens} prompt tokens, "
            f"chunk {ns.chunk}, {ns.decode_steps} decode steps; {len(rows)} cases, {failed} failed, {wall:.0f} s.\n"
            "- **Reference**: the model's own forward with stable index top-k ties and keys read in the pools' "
            "formats; `full-precision diff` is against full-precision keys (the KV format's own cost). "
            "The reference runs SDPA's math backend (float32 inside, as dtkv's attention). `within tol`: positions whose "
            "logits are within `tol`. Parity: max <= 1; >= 97% within for float32 models with fp32/bf16 KV, >= 90% "
            "otherwise; tokens equal, except that a bfloat16 model's token may differ where the reference's margin "
            "between the two is at most 2 tol (flips, max margin); see `dtkv/demo/_verdict.py`.\n\n"
        )
        stem.with_suffix(".md").write_text(text + _table(rows))
        with open(stem.with_suffix(".jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps({**r, **info}) + "\n")
        print(f"wrote {stem.with_suffix('.md')} ({len(rows)} cases, {failed} failed, {wall:.0f} s)")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
