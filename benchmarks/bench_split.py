"""Latency of CP split planning (:func:`dtkv.split.plan_cp_split`) for a 64-request, 128K-token batch.

Three numbers per configuration, p50/p90 in microseconds over ``--iters`` calls:

- ``plan``: host metadata only (boundaries, alignment, per-rank counts; what the scheduler needs).
- ``plan+rank``: plus what one rank touches per step: ``restore_index`` and ``local(rank 0)`` (token index,
  positions, request index, prev/next indices) -- every per-token tensor a rank reads.
- ``plan+all``: plus ``gather_index`` and ``local(r)`` of every rank (debugging/test use).

Per-token tensors are built on ``--device`` (CPU by default, where first-touch page faults of freshly
allocated memory can dominate: the result depends on how the C allocator reuses memory between calls; run with
``MALLOC_TRIM_THRESHOLD_``/``MALLOC_MMAP_THRESHOLD_`` set high to see the compute-only cost).

Usage: ``python benchmarks/bench_split.py [--iters 500] [--device cpu]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from dtkv._log import Progress, setup_cli_logging
from dtkv.split import plan_cp_split


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitConfig:
    num_reqs: int = 64
    total_tokens: int = 128 * 1024
    cp_size: int = 4
    page_size: int = 64
    mode: str = "zigzag"
    page_aligned: bool = True
    max_prefix: int = 8192
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitResult:
    config: SplitConfig
    plan_p50_us: float
    plan_p90_us: float
    rank_p50_us: float
    rank_p90_us: float
    all_p50_us: float
    all_p90_us: float
    num_aligned: int


def _batch(cfg: SplitConfig) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(cfg.seed)
    extend = rng.multinomial(cfg.total_tokens - cfg.num_reqs, np.ones(cfg.num_reqs) / cfg.num_reqs) + 1
    prefix = rng.integers(0, cfg.max_prefix, cfg.num_reqs)
    return prefix.tolist(), extend.tolist()


def _time_us(fn, iters: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def run(cfg: SplitConfig, *, iters: int, warmup: int, device: str) -> SplitResult:
    prefix, extend = _batch(cfg)
    kwargs = dict(cp_size=cfg.cp_size, page_size=cfg.page_size, mode=cfg.mode, page_aligned=cfg.page_aligned)

    def plan():
        return plan_cp_split(prefix, extend, device=device, **kwargs)

    def plan_rank():
        s = plan()
        return s.restore_index, s.local(0)

    def plan_all():
        s = plan()
        return s.restore_index, s.gather_index, [s.local(r) for r in range(cfg.cp_size)]

    def synced(fn):
        if torch.device(device).type == "cuda":
            return lambda: (fn(), torch.cuda.synchronize())
        return fn

    p50, p90 = _time_us(synced(plan), iters, warmup)
    r50, r90 = _time_us(synced(plan_rank), iters, warmup)
    a50, a90 = _time_us(synced(plan_all), iters, warmup)
    split = plan()
    assert split.total_tokens == cfg.total_tokens
    return SplitResult(
        config=cfg,
        plan_p50_us=p50,
        plan_p90_us=p90,
        rank_p50_us=r50,
        rank_p90_us=r90,
        all_p50_us=a50,
        all_p90_us=a90,
        num_aligned=int(split.page_aligned.sum()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=500, help="timed plans per configuration (default 500)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed plans first (default 50)")
    parser.add_argument("--device", default="cpu", help="where the plan's tensors go (default cpu)")
    args = parser.parse_args()
    setup_cli_logging()
    torch.set_num_threads(1)
    sweep = [
        SplitConfig(cp_size=cp, mode=mode, page_aligned=aligned)
        for mode, aligned in (("zigzag", True), ("zigzag", False), ("round_robin", True))
        for cp in (2, 4, 8)
    ]
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"device={args.device}, iters={args.iters}"
    )
    print(f"# batch: {sweep[0].num_reqs} requests, {sweep[0].total_tokens} tokens, page_size={sweep[0].page_size}")
    header = f"{'mode':<12} {'aligned':>7} {'cp':>3} {'#al':>4} | {'plan p50':>9} {'p90':>7} | "
    header += f"{'plan+rank p50':>13} {'p90':>7} | {'plan+all p50':>12} {'p90':>7}   (us)"
    print(header)
    configs = Progress("split configuration", total=len(sweep))
    for cfg in sweep:
        r = run(cfg, iters=args.iters, warmup=args.warmup, device=args.device)
        configs.step(f"{cfg.mode} cp={cfg.cp_size}")
        print(
            f"{cfg.mode:<12} {str(cfg.page_aligned):>7} {cfg.cp_size:>3} {r.num_aligned:>4} | "
            f"{r.plan_p50_us:>9.1f} {r.plan_p90_us:>7.1f} | {r.rank_p50_us:>13.1f} {r.rank_p90_us:>7.1f} | "
            f"{r.all_p50_us:>12.1f} {r.all_p90_us:>7.1f}"
        )


if __name__ == "__main__":
    main()
